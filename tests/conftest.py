"""Fixtures shared by every test package: a real S3 endpoint on loopback (moto's server)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stress import CpuStress

REPO = Path(__file__).resolve().parents[1]

# No test asks the real instance metadata service: botocore's credential chain ends with an
# IMDS lookup (169.254.169.254) when nothing else has credentials, and this machine is not an
# EC2 node. Tests that need the service start a stand-in in a network namespace of their own
# (tests/lifecycle/test_imds_block.py); subprocesses inherit this too.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def skip_or_fail(reason: str, *, required_by: str) -> None:
    """Skip locally; fail where ``required_by`` is "1" (.ci/run sets it: in CI `make test` has
    built everything, so a missing piece is a broken set-up, not a reason to skip)."""
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{required_by}=1: {reason}")
    pytest.skip(reason)


def xla_python() -> Path:
    """.venv-xla's interpreter (torch-xla on PJRT CPU), or skip/fail as ``skip_or_fail`` says."""
    python = REPO / ".venv-xla" / "bin" / "python"
    if not python.exists():
        skip_or_fail(".venv-xla not built (make setup-xla)", required_by="SANA_REQUIRE_ALL")
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a moto S3 server in its own process on 127.0.0.1 (session-wide).

    Also sets AWS_ENDPOINT_URL_S3 and dummy credentials in this process's environment so
    that code under test (and subprocesses it starts) reach it through boto3's standard
    configuration, exactly as on the cluster they reach real S3.
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto S3 server did not start on loopback") from None
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                                             "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL_S3=url, AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        yield url
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the loopback S3 server; returns its name."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def cpu_stress(request: pytest.FixtureRequest) -> Iterator[CpuStress]:
    """Busy processes beside the test for its whole duration (tests/stress.py); the
    ``cpu_stress`` marker requests it, ``@pytest.mark.cpu_stress(workers=N)`` sizes it."""
    marker = request.node.get_closest_marker("cpu_stress")
    workers = marker.kwargs.get("workers") if marker is not None else None
    with CpuStress(workers) as stress:
        yield stress


@pytest.fixture(autouse=True)
def _stress_when_marked(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cpu_stress") is not None:
        request.getfixturevalue("cpu_stress")
