"""The deployment smoke job on the local Slurm cluster (tests/slurm/conftest.py).

Real sinfo/scontrol output feeds the node-state check (and a drained node fails it by
name); then `sbatch training/slurm/smoke.sbatch` runs end to end on its local path: the
coordinator submits its own sub-jobs (gloo all-reduce of 2 processes, trn_smoke on PJRT CPU
with the Neuron version check), probes flock on the temp "FSx" and S3 on the moto server,
and prints one table whose every row must PASS.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.conftest import xla_python
from tests.slurm.conftest import install_package, point_current
from tests.slurm.job_site import free_port, lay_out_fsx, make_env, write_node_profile
from training.smoke import FAIL, PASS, SKIP, checks

if TYPE_CHECKING:  # conftest modules are not importable by name (several share it)
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
#: generous: the sub-jobs start torchrun twice and compile trn_smoke on 2 shared CPU cores
JOB_TIMEOUT = 600


def test_node_state_check_reads_real_sinfo_and_fails_on_a_drained_node(slurm_cluster: SlurmCluster):
    nodes = checks.slurm_nodes()
    assert {(n.partition, n.node) for n in nodes} == {("gpu", slurm_cluster.node), ("trn", slurm_cluster.node)}
    assert checks.slurm_row(nodes).verdict == PASS
    addresses = checks.node_addresses()
    assert addresses[slurm_cluster.node] >= {slurm_cluster.node, "127.0.0.1"}

    slurm_cluster.run("scontrol", "update", f"nodename={slurm_cluster.node}", "state=drain",
                      "reason=smoke test drain")
    try:
        row = checks.slurm_row(checks.slurm_nodes())
        assert row.verdict == FAIL
        assert f"{slurm_cluster.node} (gpu) drained reason 'smoke test drain'" in row.detail
    finally:
        slurm_cluster.run("scontrol", "update", f"nodename={slurm_cluster.node}", "state=resume")
        slurm_cluster.wait_node_idle(timeout=60)


@pytest.fixture
def site(slurm_cluster: SlurmCluster) -> Iterator[Path]:
    """A temp "FSx" laid out as on the cluster: the directories lifecycle_scripts/shared_dirs.sh
    makes (the job user's own logs/<user>/, root's logs/provision), the package installed
    root-owned and read-only under platform/<hash> with `current` pointing at it. Not tmp_path:
    pytest's base dir is 0700, the job user could not reach it."""
    root = Path(tempfile.mkdtemp(prefix="sana-smoke-"))
    root.chmod(0o755)
    fsx = root / "fsx"
    fsx.mkdir(mode=0o755)
    user = slurm_cluster.job_user
    if user is not None and os.getuid() == 0:
        lay_out_fsx(fsx, [user], user.gid)
    else:
        for sub in ("logs", "logs/provision"):
            (fsx / sub).mkdir()
    package = install_package(fsx / "platform")
    point_current(fsx / "platform", package.name)
    for kind, venv in (("gpu", REPO / ".venv"), ("neuron", REPO / ".venv-xla")):
        target = make_env(fsx / "envs", kind, venv, key=f"smoke{kind}")
        (fsx / "envs" / kind).symlink_to(target.name)
    yield fsx
    shutil.rmtree(root, ignore_errors=True)


def submit_smoke(cluster: SlurmCluster, fsx: Path, **extra: str) -> tuple[dict[str, str], str, int]:
    """sbatch smoke.sbatch as the job user from the installed package; (job info, output, id)."""
    port = free_port()
    profile = write_node_profile(fsx.parent / "node-gpu", role="gpu", fsx=fsx, rdzv_port=port)
    assert f"SANA_ENV_NEURON='{fsx}/envs/neuron'" in profile.read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANA_")}
    # What a login shell exports: the profile's FSx and envs (the login profile has them), the
    # artefacts bucket of this test; the rest comes from the node profile inside the job.
    env.update(SANA_PROFILE=str(profile), SANA_SMOKE_LOCAL="1", SANA_FSX=str(fsx),
               SANA_ENV_GPU=str(fsx / "envs" / "gpu"), SANA_ENV_NEURON=str(fsx / "envs" / "neuron"),
               SANA_SMOKE_RDZV_PORT=str(port), SANA_SMOKE_JOB_TIMEOUT_S=str(JOB_TIMEOUT - 60))
    env.update(extra)
    out = fsx / "logs" / "%u" / "sana-smoke-%j.out"  # the #SBATCH --output, under the temp FSx
    script = fsx / "platform" / "current" / "training" / "slurm" / "smoke.sbatch"
    job_id = cluster.sbatch(script, options=(f"--output={out}",), env=env, cwd=fsx / "logs", user=cluster.user)
    info = cluster.wait(job_id, timeout=JOB_TIMEOUT)
    return info, Path(str(out).replace("%j", str(job_id)).replace("%u", cluster.user or "root")).read_text(), job_id


def test_smoke_sbatch_exits_non_zero_with_one_line_per_failure(slurm_cluster: SlurmCluster, site: Path,
                                                               s3_endpoint: str):
    """A FAILED node status and an unreachable bucket: the job FAILS (exit 1) and the table
    has one FAIL line for each, naming the node's step and cause and the bucket. No
    accelerator partition here: those rows SKIP (nothing submitted)."""
    from tests.training.smoke.test_smoke import status_line

    fsx = site
    (fsx / "logs" / "provision" / "trn-7.status").write_text(status_line(
        "FAILED", "2026-12-01T07:00:00Z", "trn-7", "trn", "trn", "10.1.0.27", "env-neuron",
        "pip install -r requirements-neuron.txt failed: No matching distribution found for neuronx-cc==2.24.5133.0"))
    info, text, _ = submit_smoke(slurm_cluster, fsx, SANA_ARTEFACTS_BUCKET="no-such-bucket-smoke",
                                 SANA_SMOKE_GPU_PARTITION="none", SANA_SMOKE_TRN_PARTITION="none")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", f"{info}\n{text}"
    assert re.search(r"^node-status +FAIL +trn-7 FAILED at step env-neuron: pip install -r requirements-neuron.txt "
                     r"failed: No matching distribution found for neuronx-cc==2\.24\.5133\.0; no READY status "
                     rf"for Slurm node\(s\) {slurm_cluster.node} in ", text, re.M), text
    assert re.search(r"^s3 +FAIL +s3://no-such-bucket-smoke: bucket does not exist", text, re.M), text
    assert re.search(r"^gpu-allreduce +SKIP +no partition none in sinfo \(no gpu group: gpuInstanceCount=0\)", text,
                     re.M), text
    assert "SMOKE FAIL: 2 passed, 2 failed, 4 skipped" in text, text  # imds: the local path


@pytest.mark.slow
def test_smoke_sbatch_local_path_passes_every_row(slurm_cluster: SlurmCluster, site: Path,
                                                  s3_endpoint: str, s3_bucket: str):
    """`sbatch smoke.sbatch` as the unprivileged job user, from the read-only installed
    package: every row of the local path PASSes and the job exits 0."""
    xla_python()  # the Trainium sub-job runs in it
    from tests.training.smoke.test_smoke import ready  # the READY line in readiness.sh's format

    fsx = site
    (fsx / "logs" / "provision" / f"{slurm_cluster.node}.status").write_text(ready(slurm_cluster.node, "127.0.0.1"))
    info, text, job_id = submit_smoke(slurm_cluster, fsx, SANA_ARTEFACTS_BUCKET=s3_bucket)
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}\n{slurm_cluster.logs()}"
    print(text)

    # The job ran the installed package through the resolved `current` link.
    assert f"package {(fsx / 'platform' / 'current').resolve()}," in text, text
    rows = dict(re.findall(r"^([\w-]+) +(PASS|FAIL|SKIP) ", text, re.M))
    assert rows == {"slurm-nodes": "PASS", "node-status": "PASS", "fsx": "PASS", "s3": "PASS",
                    "gpu-allreduce": "PASS", "neuron-versions": "PASS", "trn-allreduce": "PASS",
                    "imds": "SKIP"}, text  # the local path provisions no node to check
    assert "SMOKE PASS: 7 passed, 0 failed, 1 skipped" in text
    assert re.search(r"gpu-allreduce +PASS +local path: gloo 2 ranks on 1 node\(s\), busbw [\d.]+ GB/s", text), text
    assert re.search(r"neuron-versions +PASS +Neuron SDK [\d.]+ on 1 node\(s\): torch, torch-xla match", text), text
    log_dir = fsx / "logs" / (slurm_cluster.user or "root") / f"smoke-{job_id}"
    assert (log_dir / "table.txt").read_text().strip() == text[text.index("check "):].strip()
    assert sorted(p.name.split("-")[0] for p in log_dir.glob("*-allreduce-*.out")) == ["gpu", "trn"]
    if slurm_cluster.job_user is not None and os.getuid() == 0:
        assert log_dir.stat().st_uid == slurm_cluster.job_user.uid  # written by the user, not root


def test_the_network_rows_fail_on_one_node_partitions_unless_declared(slurm_cluster: SlurmCluster, tmp_path: Path):
    """The local cluster has one node in each accelerator partition, as the default deployment
    (gpuInstanceCount=1, trnInstanceCount=1) has: real sinfo output, the cluster path (not the
    local one). Both network rows FAIL before submitting anything; declared one-node, each
    would run on its node alone (the NCCL/Neuron job itself needs the accelerator)."""
    from dataclasses import replace

    nodes = checks.slurm_nodes()
    log_dir = tmp_path / "smoke-1"
    log_dir.mkdir()
    cfg = checks.SmokeConfig(package_root=REPO, fsx=tmp_path, log_dir=log_dir, artefacts_bucket="b", cluster="c",
                             gpu_env=tmp_path / "envs/gpu", neuron_env=tmp_path / "envs/neuron")
    gpu = checks.gpu_allreduce(cfg, nodes)
    trn, versions = checks.trn_checks(cfg, nodes)
    for row, key in ((gpu, "gpuInstanceCount"), (trn, "trnInstanceCount")):
        assert row.verdict == FAIL and "has 1 usable node; the cross-node (EFA) check needs 2: scale " \
            f"{key} to 2, or declare" in row.detail, row
    assert versions.verdict == SKIP
    assert list(log_dir.iterdir()) == []  # no job was submitted
    declared = replace(cfg, single_node=frozenset({"gpu", "trn"}))
    assert [checks.network_nodes(declared, nodes, kind) for kind in ("gpu", "trn")] == [1, 1]
