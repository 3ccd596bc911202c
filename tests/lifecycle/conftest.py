"""Fixtures for the lifecycle tests; the pretend cluster itself is in lifecycle_cluster.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from lifecycle_cluster import STANDINS, Cluster, build_wheel, make_bundle


@pytest.fixture(scope="session")
def standins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    bin_dir = tmp_path_factory.mktemp("standin-bin")
    for name, body in STANDINS.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\n[ -n "$STANDIN_LOG" ] && echo "{name} $*" >>"$STANDIN_LOG"\n{body}\n')
        path.chmod(0o755)
    # The node's python3 is this machine's interpreter, put first on PATH directly (not through
    # a version-manager shim, which costs ~50 ms a call).
    real_python = Path(os.path.realpath(sys.executable))
    for name in ("python3", "python3.11"):
        (bin_dir / name).symlink_to(real_python)
    return bin_dir


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dist = tmp_path_factory.mktemp("wheels")
    return {name: build_wheel(dist, name) for name in ("torch", "torch_xla")}



@pytest.fixture
def make_cluster(tmp_path: Path, standins: Path, wheels: dict[str, Path]):
    """Factory: a fresh cluster (own FSx) from a bundle with the given package hash/requirements."""
    def make(name: str = "cluster", **bundle_kwargs) -> Cluster:
        base = tmp_path / name
        bundle_kwargs.setdefault("package_hash", "pkg0001")
        return Cluster(base, make_bundle(base / "bundle", wheels, **bundle_kwargs), standins)
    return make
