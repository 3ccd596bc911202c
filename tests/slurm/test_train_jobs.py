"""The job scripts, submitted with sbatch to real Slurm daemons on localhost.

Each job runs the real entrypoint under torchrun through training/slurm/launch.sh, with the
tiny preset on CPU: 2 ranks over gloo for the GPU script, PJRT CPU in .venv-xla for the
Trainium one. The node profiles are the ones lifecycle_scripts/node_profile.sh writes (run
for real, one per partition's role) with a temp "FSx", so the paths asserted here are the
ones runbooks/train-slurm.md documents: checkpoints in
$SANA_CHECKPOINT_ROOT/<job name>/checkpoints/step-XXXXXXXX/, logs in
$SANA_LOG_ROOT/<job name>-<job id>/.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from safetensors.torch import load_file

from tests.slurm.conftest import skip_unless_required

if TYPE_CHECKING:  # conftest modules are not importable by name (several share it)
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "training" / "slurm"
TINY = REPO / "training" / "configs" / "tiny-cpu.yaml"
MAX_STEPS = 80
EVERY = 10
#: generous: 2 CPU cores are shared with the rest of the suite
JOB_TIMEOUT = 420


@dataclass
class Site:
    """A temp stand-in for the cluster: FSx root, node profiles per role, features, submit dir."""

    fsx: Path
    profiles: dict[str, Path]
    features: Path
    submit_dir: Path

    def env(self, role: str = "gpu", **extra: str) -> dict[str, str]:
        """What `sbatch` inherits from a login shell, with the node profile of ``role``'s
        partition (one localhost node plays both, so each job names its profile)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANA_")}
        env.update(SANA_PROFILE=str(self.profiles[role]), SANA_HYPERPOD_DIR=str(self.fsx / "no-hyperpod-here"))
        env.update(extra)
        return env

    def run_dir(self, job_name: str) -> Path:
        return self.fsx / "checkpoints" / job_name

    def log_dir(self, job_name: str, job_id: int) -> Path:
        return self.fsx / "logs" / f"{job_name}-{job_id}"


def write_node_profile(node_root: Path, *, role: str, fsx: Path, rdzv_port: int) -> Path:
    """The node profile exactly as provisioning writes it: lifecycle_scripts/node_profile.sh
    run for real (PLATFORM_ROOT keeps it in a temp dir), with FSx and the envs pointed here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANA_")}
    env.update(PLATFORM_ROOT=str(node_root), NODE_ROLE=role, NODE_GROUP=role, FSX=str(fsx),
               ENV_GPU_DIR=str(REPO / ".venv"), ENV_NEURON_DIR=str(REPO / ".venv-xla"),
               CFG_RDZV_PORT=str(rdzv_port), CFG_REGION="us-east-1", CFG_PROJECT="sana-test",
               CFG_CLUSTER_NAME="localhost", CFG_ARTEFACTS_BUCKET="artefacts", CFG_DATA_BUCKET="data")
    proc = subprocess.run(["bash", str(REPO / "lifecycle_scripts" / "node_profile.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"lifecycle_scripts/node_profile.sh failed: {proc.stderr}"
    return node_root / "etc" / "profile.d" / "sana-platform.sh"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Site:
    from training.data import write_synthetic_features

    root = tmp_path_factory.mktemp("site")
    fsx = root / "fsx"
    features = fsx / "data" / "tiny-features"
    write_synthetic_features(features, num_samples=64, latent_shape=(4, 32, 32), text_dim=8,
                             max_text_tokens=16, seed=0)
    port = free_port()
    profiles = {role: write_node_profile(root / f"node-{role}", role=role, fsx=fsx, rdzv_port=port)
                for role in ("gpu", "trn")}
    submit_dir = root / "home"
    submit_dir.mkdir()
    return Site(fsx=fsx, profiles=profiles, features=features, submit_dir=submit_dir)


def train_args(site: Site) -> tuple[str, ...]:
    return (str(TINY), "--set", f"data.path={site.features}", "--set", f"checkpoint.every_steps={EVERY}",
            "--set", "checkpoint.keep_last=0", "--max-steps", str(MAX_STEPS))


def submit_gpu(cluster: SlurmCluster, site: Site, job_name: str) -> int:
    return cluster.sbatch(SLURM_DIR / "train-gpu.sbatch", *train_args(site), options=(f"--job-name={job_name}",),
                          env=site.env(SANA_NPROC_PER_NODE="2"), cwd=site.submit_dir)


def complete_checkpoints(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def job_failure(cluster: SlurmCluster, site: Site, info: dict[str, str], job_name: str, job_id: int) -> str:
    log = site.log_dir(job_name, job_id) / "job.log"
    text = log.read_text()[-4000:] if log.exists() else f"(no {log})"
    return f"job {job_id} {info.get('JobState')} exit {info.get('ExitCode')}\n{text}\n{cluster.logs()}"


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster: SlurmCluster, site: Site) -> tuple[str, int]:
    """One full run to MAX_STEPS, the reference the interrupted run must equal."""
    job_name = "tiny-straight"
    job_id = submit_gpu(slurm_cluster, site, job_name)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)
    return job_name, job_id


def test_train_gpu_sbatch_completes_with_checkpoints_and_logs_where_the_runbook_says(
        slurm_cluster: SlurmCluster, site: Site, uninterrupted: tuple[str, int]) -> None:
    job_name, job_id = uninterrupted
    run_dir, log_dir = site.run_dir(job_name), site.log_dir(job_name, job_id)

    assert complete_checkpoints(run_dir) == list(range(EVERY, MAX_STEPS + 1, EVERY))
    final = run_dir / "checkpoints" / f"step-{MAX_STEPS:08d}"
    assert json.loads((final / "train_state.json").read_text())["step"] == MAX_STEPS
    assert logged_steps(run_dir)[-1] == MAX_STEPS

    job_log = (log_dir / "job.log").read_text()
    assert "nproc_per_node=2" in job_log
    assert f"rdzv_id={job_id}" in job_log
    assert "'world_size': 2" in job_log, job_log[-2000:]
    # srun without --auto-resume: the HyperPod marker directory does not exist here.
    assert "--auto-resume" not in job_log
    # Per-rank logs from torchrun, one directory per local rank of this node.
    rank_logs = sorted(log_dir.glob(f"ranks/*/{job_id}_*/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in rank_logs] == ["0", "1"], list(log_dir.rglob("*"))
    # sbatch's own output file stays in the submit directory, as with any Slurm job.
    assert (site.submit_dir / f"slurm-{job_name}-{job_id}.out").exists()


def test_scancel_then_resubmit_continues_from_last_checkpoint_to_identical_weights(
        slurm_cluster: SlurmCluster, site: Site, uninterrupted: tuple[str, int]) -> None:
    job_name = "tiny-interrupted"
    run_dir = site.run_dir(job_name)
    first = submit_gpu(slurm_cluster, site, job_name)

    deadline = time.monotonic() + JOB_TIMEOUT
    while not [s for s in complete_checkpoints(run_dir) if s >= 2 * EVERY]:
        info = slurm_cluster.job(first)
        assert info["JobState"] in {"PENDING", "RUNNING"}, job_failure(slurm_cluster, site, info, job_name, first)
        assert time.monotonic() < deadline, "no checkpoint before the timeout"
        time.sleep(0.2)
    assert slurm_cluster.squeue_state(first) == "RUNNING"
    slurm_cluster.run("scancel", str(first))
    info = slurm_cluster.wait(first, timeout=120)
    assert info["JobState"] == "CANCELLED", info
    resumed_from = complete_checkpoints(run_dir)[-1]
    assert 2 * EVERY <= resumed_from < MAX_STEPS, "the run finished before scancel hit it; raise MAX_STEPS"

    slurm_cluster.wait_node_idle(timeout=120)
    second = submit_gpu(slurm_cluster, site, job_name)
    info = slurm_cluster.wait(second, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, second)

    # The second job resumed: it started at the last checkpoint and counted on from there.
    second_log = (site.log_dir(job_name, second) / "job.log").read_text()
    assert re.search(rf"from step {resumed_from} to {MAX_STEPS}\b", second_log), second_log[-3000:]
    assert f"step-{resumed_from:08d}" in second_log
    second_steps = [int(s) for s in re.findall(r"\bstep (\d+) loss=", second_log)]
    assert second_steps and second_steps[0] == resumed_from + EVERY, second_steps
    assert second_steps[-1] == MAX_STEPS
    assert complete_checkpoints(run_dir)[-1] == MAX_STEPS

    # ... and ended exactly where the uninterrupted run did.
    straight = load_file(site.run_dir(uninterrupted[0]) / "checkpoints" / f"step-{MAX_STEPS:08d}" / "model.safetensors")
    resumed = load_file(run_dir / "checkpoints" / f"step-{MAX_STEPS:08d}" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    different = [name for name in straight if not straight[name].equal(resumed[name])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"


def test_resubmit_on_fewer_ranks_with_more_steps_trains_on_from_the_finished_run(
        slurm_cluster: SlurmCluster, site: Site, uninterrupted: tuple[str, int]) -> None:
    """runbooks/train-slurm.md "Change the node count" and "Train longer": same job name,
    other worker count, higher --max-steps -> the run goes on from its last checkpoint."""
    job_name, _ = uninterrupted
    run_dir = site.run_dir(job_name)
    job_id = slurm_cluster.sbatch(
        SLURM_DIR / "train-gpu.sbatch", *train_args(site), "--max-steps", str(MAX_STEPS + EVERY),
        options=(f"--job-name={job_name}",), env=site.env(SANA_NPROC_PER_NODE="1"), cwd=site.submit_dir)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)

    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert re.search(rf"from step {MAX_STEPS} to {MAX_STEPS + EVERY}, global batch 4\b", job_log), job_log[-3000:]
    state = json.loads((run_dir / "checkpoints" / f"step-{MAX_STEPS + EVERY:08d}" / "train_state.json").read_text())
    assert state["world_size"] == 1
    # 80 steps of 2 ranks x 4, then 10 steps of 1 rank x 4: the sample count carries over.
    assert state["samples_seen"] == MAX_STEPS * 8 + EVERY * 4


def test_a_config_error_fails_the_job_with_the_one_line_error_in_job_log(
        slurm_cluster: SlurmCluster, site: Site, tmp_path: Path) -> None:
    job_name = "tiny-bad-data"
    missing = tmp_path / "no-features-here"
    job_id = slurm_cluster.sbatch(SLURM_DIR / "train-gpu.sbatch", str(TINY), "--set", f"data.path={missing}",
                                  options=(f"--job-name={job_name}",), env=site.env(SANA_NPROC_PER_NODE="1"),
                                  cwd=site.submit_dir)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "FAILED", info
    assert info["ExitCode"] != "0:0"
    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert re.search(rf"error: .*{re.escape(str(missing))}", job_log), job_log[-3000:]
    assert "step finished with exit code" in job_log
    assert not complete_checkpoints(site.run_dir(job_name))


def test_precompute_sbatch_writes_features(slurm_cluster: SlurmCluster, site: Site,
                                                          tmp_path: Path) -> None:
    from training.tiny_components import TINY_RESOLUTION, build_tiny_components, write_image_caption_folder

    models = build_tiny_components(tmp_path / "models")
    raw = tmp_path / "raw"
    write_image_caption_folder(raw, num=6, seed=1)
    out = site.fsx / "data" / "precomputed"
    job_name = "tiny-precompute"
    job_id = slurm_cluster.sbatch(
        SLURM_DIR / "precompute.sbatch", "--input", str(raw), "--out", str(out), "--vae", str(models["vae"]),
        "--text-encoder", str(models["text_encoder"]), "--tokenizer", str(models["tokenizer"]),
        "--resolution", str(TINY_RESOLUTION), "--max-text-tokens", "16", "--samples-per-shard", "3",
        options=(f"--job-name={job_name}",), env=site.env(SANA_NPROC_PER_NODE="1"), cwd=site.submit_dir)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)

    # One rank keeps this cheap; the rank split itself is tests/training/test_precompute.py's.
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 6 and len(index["shards"]) == 2
    assert "rank 0/1" in (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert not site.run_dir(job_name).exists()  # no checkpoint directory for a precompute job


def test_bench_sbatch_on_hyperpod_gets_auto_resume_and_writes_its_result_where_the_submitter_said(
        slurm_cluster: SlurmCluster, site: Site, tmp_path: Path) -> None:
    """Three launcher rules in one cheap job: bench.sbatch's result lands in the job's log
    dir; on HyperPod (marker dir present) srun gets --auto-resume=1 and accepts it; and a
    SANA_* variable exported at submit time (SANA_LOG_ROOT) wins over the node profile."""
    stub = slurm_cluster.auto_resume_record is not None  # srun knows --auto-resume only with it
    marker = tmp_path / "opt-sagemaker_cluster"  # stands for /opt/sagemaker_cluster
    if stub:
        marker.mkdir()
    own_logs = tmp_path / "my-logs"  # a researcher's `SANA_LOG_ROOT=... sbatch`
    job_name = "tiny-bench"
    env = site.env(SANA_NPROC_PER_NODE="1", SANA_HYPERPOD_DIR=str(marker), SANA_LOG_ROOT=str(own_logs))
    job_id = slurm_cluster.sbatch(SLURM_DIR / "bench.sbatch", str(TINY), "--synthetic", "--steps", "3",
                                  "--warmup", "1", "--work-dir", str(tmp_path / "scratch"),
                                  options=(f"--job-name={job_name}",), env=env, cwd=site.submit_dir)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    log_dir = own_logs / f"{job_name}-{job_id}"
    assert info["JobState"] == "COMPLETED", (info, (log_dir / "job.log").read_text()[-3000:])

    result = json.loads((log_dir / "bench.json").read_text())
    assert result["backend"] == "gpu"  # partition gpu -> the GPU backend and env
    assert result["world_size"] == 1
    assert result["instance_type"] == "local"
    assert not site.log_dir(job_name, job_id).exists()

    if not stub:
        skip_unless_required("bench checked; the auto-resume part needs a C compiler for "
                             "tests/slurm/auto_resume_stub.c (make setup installs gcc)")
    assert "srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 --label --auto-resume=1" in (
        log_dir / "job.log").read_text()
    records = slurm_cluster.auto_resume_record.read_text().splitlines()
    assert f"{job_id} auto-resume=1" in records  # srun accepted the option and passed it to the step


def test_train_trainium_sbatch_runs_tiny_on_pjrt_cpu_on_partition_trn(slurm_cluster: SlurmCluster,
                                                                       site: Site) -> None:
    if not (REPO / ".venv-xla" / "bin" / "python").exists():
        skip_unless_required(".venv-xla missing; run `make setup-xla` (make test builds it before these tests)")
    job_name = "tiny-trn"
    # One rank: XLA collectives across processes on PJRT CPU return wrong values (DESIGN.md);
    # cross-rank behaviour is the GPU test's.
    job_id = slurm_cluster.sbatch(SLURM_DIR / "train-trainium.sbatch", str(TINY), "--set", f"data.path={site.features}",
                                  "--set", "checkpoint.every_steps=2", "--max-steps", "4",
                                  options=(f"--job-name={job_name}",),
                                  env=site.env("trn", SANA_NPROC_PER_NODE="1", PJRT_DEVICE="CPU"), cwd=site.submit_dir)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)
    assert info["Partition"] == "trn"

    run_dir = site.run_dir(job_name)
    assert complete_checkpoints(run_dir) == [2, 4]
    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert f"env {REPO / '.venv-xla'}" in job_log  # SANA_ENV_NEURON from the trn node profile
    summary = json.loads(re.findall(r"^0: \[default0\]:(\{.*\"compiles\".*\})$", job_log, re.M)[-1])
    assert summary["steps"] == 4 and summary["compiles"] >= 1  # the XLA backend ran the steps
    assert "'pjrt_device': 'CPU'" in job_log and "from step 0 to 4" in job_log  # rank 0's training log
    assert (run_dir / "tensorboard").is_dir()  # the config as shipped, TensorBoard included
    assert f"NEURON_RT_ROOT_COMM_ID={slurm_cluster.node}:46820" in job_log


def test_a_job_script_copied_away_from_its_launcher_fails_saying_so(slurm_cluster: SlurmCluster, site: Site,
                                                                    tmp_path: Path) -> None:
    copy = tmp_path / "train-gpu.sbatch"
    copy.write_text((SLURM_DIR / "train-gpu.sbatch").read_text())
    job_id = slurm_cluster.sbatch(copy, options=("--job-name=stray",), env=site.env(), cwd=site.submit_dir)
    info = slurm_cluster.wait(job_id, timeout=120)
    assert info["JobState"] == "FAILED"
    out = (site.submit_dir / f"slurm-stray-{job_id}.out").read_text()
    assert f"train-gpu.sbatch: no launch.sh next to the submitted script (in '{tmp_path}')" in out
