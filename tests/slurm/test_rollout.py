"""training/slurm/rollout.sbatch submitted to the real Slurm daemons on localhost.

The node the job lands on is a node of the lifecycle tests' pretend cluster (provisioned for
real by on_init_complete.sh under a PLATFORM_ROOT, tests/lifecycle/lifecycle_cluster.py), and
the package comes from the loopback S3, so the job runs exactly what an operator's
`sudo sbatch --partition=... rollout.sbatch <hash>` runs: rollout.sh from the current package on
FSx. One job per partition (gpu, then trn): the first leaves `current` alone (PENDING), the
second flips it; a job for a prefix outside this cluster's lifecycle bucket ends FAILED with one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lifecycle"))
from lifecycle_cluster import (  # noqa: E402
    Cluster,
    build_wheel,
    bundle_hash,
    container_sources,
    make_bundle,
    make_standins,
    settings,
    upload_bundle,
)

if TYPE_CHECKING:  # conftest modules are not importable by name (several share it)
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "training/slurm/rollout.sbatch"
JOB_TIMEOUT = 300


@pytest.fixture
def pretend(tmp_path: Path) -> tuple[Cluster, dict[str, Path]]:
    """gpu-1 and trn-1 of a pretend cluster, provisioned with pkg0001; and its stand-in wheels."""
    standins = make_standins(tmp_path / "standin-bin")
    wheels = {name: build_wheel(tmp_path, name) for name in ("torch", "torch_xla", "torch_neuronx")}
    c = Cluster(tmp_path / "cluster", make_bundle(tmp_path / "cluster/bundle", wheels, package_hash="pkg0001"),
                standins, container_sources(tmp_path / "container-sources"))
    procs = [c.start(node) for node in ("gpu-1", "trn-1")]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    return c, wheels


def submit(slurm: SlurmCluster, c: Cluster, node: str, partition: str, target: str, out_dir: Path) -> tuple[dict, str]:
    """sudo sbatch --partition=P rollout.sbatch TARGET, with the job landing on pretend NODE."""
    env = c.env(node, ROLLOUT_PYTHON=sys.executable, SANA_FSX=str(c.root(node) / "fsx"))
    # Submitted from the current package on FSx, as the runbook says (root's job: cluster.sbatch default).
    job_id = slurm.sbatch(c.fsx / "platform/current/training/slurm/rollout.sbatch", target,
                          options=(f"--partition={partition}", f"--output={out_dir}/%x-%j.out"),
                          env=env, cwd=out_dir)
    info = slurm.wait(job_id, timeout=JOB_TIMEOUT)
    return info, (out_dir / f"sana-rollout-{job_id}.out").read_text()


def test_rollout_jobs_on_both_partitions_flip_current(slurm_cluster: SlurmCluster, pretend, s3_endpoint,
                                                      tmp_path: Path):
    import boto3

    c, wheels = pretend
    bucket = settings("x")["lifecycle_bucket"]  # the only bucket the rollout accepts: this cluster's
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
        s3.create_bucket(Bucket=bucket)
    # The package on FSx carries this repository's job script (the stand-in package has none).
    (c.fsx / "platform/pkg0001/training/slurm").mkdir(parents=True, exist_ok=True)
    (c.fsx / "platform/pkg0001/training/slurm/rollout.sbatch").write_bytes(SBATCH.read_bytes())
    new = make_bundle(tmp_path / "bundle-pkg0002", wheels, package_hash="pkg0002", content_hash=True,
                      gpu_requirements=f"# pkg0002\n{wheels['torch']}\n")
    (new / "training/slurm").mkdir()
    (new / "training/slurm/rollout.sbatch").write_bytes(SBATCH.read_bytes())
    # The hash covers every uploaded file, the job script added above included.
    h = json_rehash(new)
    assert h != "pkg0002" and bundle_hash(new) == h
    upload_bundle(new, s3_endpoint, bucket, f"lifecycle/{h}/")
    uri = f"s3://{bucket}/lifecycle/{h}/"
    out_dir = tmp_path / "slurm-out"
    out_dir.mkdir()

    info, log = submit(slurm_cluster, c, "gpu-1", "gpu", uri, out_dir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "rollout.sbatch: job " in log and "(partition gpu)" in log
    assert f"[rollout] PENDING {h}" in log.strip().splitlines()[-1]
    assert os.readlink(c.fsx / "platform/current") == "pkg0001"

    info, log = submit(slurm_cluster, c, "trn-1", "trn", uri, out_dir)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert f"[rollout] ROLLED OUT {h}: current -> {h} (was pkg0001)" in log.strip().splitlines()[-1]
    assert os.readlink(c.fsx / "platform/current") == h
    assert (c.fsx / "platform/pkg0001/training/__init__.py").exists()  # never deleted

    # A prefix outside this cluster's lifecycle bucket: the job fails, its output ends in the one line.
    info, log = submit(slurm_cluster, c, "gpu-1", "gpu", f"s3://other-bucket/lifecycle/{h}/", out_dir)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "1:0"), log[-3000:]
    last = log.strip().splitlines()[-1]
    assert f"[rollout] FAILED: 's3://other-bucket/lifecycle/{h}/' is not this cluster's lifecycle prefix" in last
    assert os.readlink(c.fsx / "platform/current") == h


def json_rehash(bundle: Path) -> str:
    """Re-name a bundle whose files changed after make_bundle by its content hash (as `cdk deploy` would)."""
    import json

    from lifecycle_cluster import SCRIPTS, _hash_module

    data = json.loads((bundle / "platform-settings.json").read_text())
    h = _hash_module().package_hash(SCRIPTS, bundle / "training", data)  # the code and the node settings
    data["package_hash"] = h
    (bundle / "platform-settings.json").write_text(json.dumps(data, indent=2))
    return h
