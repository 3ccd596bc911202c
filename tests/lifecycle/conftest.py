"""Fixtures for the lifecycle tests; the pretend cluster itself is in lifecycle_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from lifecycle_cluster import Cluster, build_wheel, container_sources, make_bundle, make_standins, settings


@pytest.fixture(scope="session")
def standins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_standins(tmp_path_factory.mktemp("standin-bin"))


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dist = tmp_path_factory.mktemp("wheels")
    return {name: build_wheel(dist, name) for name in ("torch", "torch_xla", "torch_neuronx")}


@pytest.fixture(scope="session")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Stand-ins of NVIDIA's enroot .debs and pyxis source archive, and the settings naming them."""
    return container_sources(tmp_path_factory.mktemp("container-sources"))


@pytest.fixture
def make_cluster(tmp_path: Path, standins: Path, wheels: dict[str, Path], sources: dict[str, str]):
    """Factory: a fresh cluster (own FSx) from a bundle with the given package hash/requirements."""
    def make(name: str = "cluster", **bundle_kwargs) -> Cluster:
        base = tmp_path / name
        bundle_kwargs.setdefault("package_hash", "pkg0001")
        return Cluster(base, make_bundle(base / "bundle", wheels, **bundle_kwargs), standins, sources)
    return make


@pytest.fixture(scope="session")
def lifecycle_bucket(s3_endpoint) -> str:
    """This cluster's lifecycle bucket (platform-settings.json lifecycle_bucket) on the loopback S3:
    the only bucket the rollout accepts."""
    import boto3

    name = settings("x")["lifecycle_bucket"]
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    if name not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=name)
    return name
