"""Shared, session-built serving fixtures: one tiny serving export, one CPU compile of it, and
model directories in the layout model.tar.gz extracts to (``export/`` [+ ``compiled/``]).

Built once per session (about 10 s on the shared machine): every test that serves reuses them.
The compile here covers only 64x64 of the export's two sizes (64x64, 32x64), so the compiled
model serves fewer sizes than serving.json lists, which the refusal tests rely on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from training.serve.spec import Size


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.serve.tiny import build_tiny_serving_export

    return build_tiny_serving_export(tmp_path_factory.mktemp("serve-tiny"))


@pytest.fixture(scope="session")
def compiled_cpu(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.serve.compile import compile_export

    return compile_export(tiny_export, tmp_path_factory.mktemp("serve-compiled") / "compiled", target="cpu",
                          sizes=(Size(64, 64),), log=lambda _: None)


@pytest.fixture(scope="session")
def compiled_model(tiny_export: Path, compiled_cpu: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """export/ + compiled/ (the --compiled package layout, weights kept)."""
    root = tmp_path_factory.mktemp("serve-model-compiled")
    shutil.copytree(tiny_export, root / "export")
    shutil.copytree(compiled_cpu, root / "compiled")
    return root


@pytest.fixture(scope="session")
def plain_model(tiny_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """export/ only: what a GPU endpoint serves (diffusers backend; CPU here)."""
    root = tmp_path_factory.mktemp("serve-model-plain")
    shutil.copytree(tiny_export, root / "export")
    return root
