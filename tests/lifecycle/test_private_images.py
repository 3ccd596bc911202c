"""lifecycle_scripts/import_image.sh on a private cluster: only this account's ECR, refused in one line.

The import is root's (the image store is root's), on a node that the lifecycle provisioned: the
script reads the node's settings.env and node.env (on_init_complete.sh writes them). The refusal comes
before any AWS call or pull, so neither ECR nor enroot is needed here; an `enroot` stand-in that
records its calls proves nothing was pulled. The import itself against moto's ECR is
tests/slurm/test_container_job.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lifecycle_scripts" / "import_image.sh"
OWN = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="import_image.sh runs as root (the store is root's)")


def provisioned_node(tmp_path: Path, *, private: bool) -> dict[str, str]:
    state = tmp_path / "node" / "var/lib/sana-platform"
    state.mkdir(parents=True)
    (tmp_path / "fsx/images").mkdir(parents=True)
    (state / "settings.env").write_text(
        f"export FSX={tmp_path / 'fsx'}\nexport ENV_GPU_DIR={tmp_path / 'env'}\n"
        f"export CFG_PRIVATE_NETWORK={str(private).lower()}\nexport CFG_IMAGE_REGISTRY={OWN}\n")
    (state / "node.env").write_text("export NODE_NAME=login-1 NODE_ROLE=login\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "enroot").write_text(f'#!/bin/sh\necho "enroot $*" >>{tmp_path}/enroot-calls\nexit 1\n')
    (bin_dir / "enroot").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PLATFORM_ROOT": str(tmp_path / "node"),
            "IMPORT_PYTHON": str(tmp_path / "no-python")}


def run(env: dict[str, str], image: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), image], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("image", ["210987654321.dkr.ecr.eu-west-1.amazonaws.com/theirs/sana:v1",
                                   f"{OWN.replace('eu-west-1', 'us-east-1')}/sana/sana-gpu:v1",
                                   "docker.io/library/ubuntu:24.04"])
def test_a_private_cluster_imports_only_from_its_own_registry(tmp_path, image):
    done = run(provisioned_node(tmp_path, private=True), image)
    assert done.returncode == 1
    last = done.stdout.strip().splitlines()[-1]
    assert last.endswith(
        f"[import-image] FAILED: '{image.split('/')[0]}' is not this cluster's registry {OWN}: a private cluster "
        "(privateNetwork) pulls only from its own ECR, through its VPC endpoints; push the image there "
        f"(make push-image REGISTRY={OWN})")
    assert not (tmp_path / "enroot-calls").exists()


def test_an_online_cluster_still_takes_another_accounts_ecr(tmp_path):
    """Only the private check is new: elsewhere the import goes on (here to the missing python)."""
    done = run(provisioned_node(tmp_path, private=False), "210987654321.dkr.ecr.eu-west-1.amazonaws.com/theirs/sana:v1")
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1].endswith(
        f"[import-image] FAILED: no python with boto3 at {tmp_path / 'no-python'} (the GPU env); set IMPORT_PYTHON")
