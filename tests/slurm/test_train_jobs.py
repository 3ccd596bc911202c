"""The job scripts, submitted with sbatch to real Slurm daemons on localhost.

Each job runs the real entrypoint under torchrun through training/slurm/launch.sh, with the
tiny preset on CPU: 2 ranks over gloo for the GPU script, PJRT CPU in .venv-xla for the
Trainium one. The site is laid out as on the cluster: the package installed root-owned and
read-only at <fsx>/platform/<hash>/training with `current` pointing at it (the scripts are
submitted from there), envs at <fsx>/envs/<kind>-<key> behind <fsx>/envs/<kind> with
python_env.sh's ready marker, /fsx/{data,checkpoints,logs} root:<group> 2775, and the jobs
submitted as the fixture's unprivileged user from its home (one test keeps a root job). FSx's
directories are made by the real lifecycle_scripts/shared_dirs.sh (shared and per-user trees)
and the node profiles are the ones lifecycle_scripts/node_profile.sh writes (run for real, one
per partition's role), so the paths asserted here are the ones runbooks/train-slurm.md
documents: checkpoints in $SANA_CHECKPOINT_ROOT/<user>/<job name>/checkpoints/step-XXXXXXXX/,
logs in $SANA_LOG_ROOT/<user>/<job name>-<job id>/, Slurm's own output in $SANA_LOG_ROOT/<user>/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.slurm.conftest import install_package, point_current, skip_unless_required
from tests.slurm.job_site import free_port, lay_out_fsx, make_env, write_node_profile
from training.checkpoint.consolidate import load_full

if TYPE_CHECKING:  # conftest modules are not importable by name (several share it)
    from tests.slurm.conftest import JobUser, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 80
EVERY = 10
#: generous: 2 CPU cores are shared with the rest of the suite
JOB_TIMEOUT = 420


@dataclass
class Site:
    """A temp stand-in for the cluster: FSx root with the installed package, envs, node
    profiles per role, features, and the job user's home to submit from."""

    root: Path
    fsx: Path
    profiles: dict[str, Path]
    features: Path
    submit_dir: Path
    #: <fsx>/platform/<hash>: the installed package (resolved; `current` points at it)
    package: Path
    #: resolved env dirs per kind (gpu, neuron) and their requirements keys
    envs: dict[str, Path]
    env_keys: dict[str, str]
    user: JobUser | None
    #: a second cluster user (same group), for the isolation tests; None when not running as root
    other: JobUser | None = None

    @property
    def slurm_dir(self) -> Path:
        """Where a researcher sbatches from: through the `current` link, as the runbook says."""
        return self.fsx / "platform" / "current" / "training" / "slurm"

    @property
    def tiny(self) -> Path:
        return self.package / "training" / "configs" / "tiny-cpu.yaml"

    def env(self, role: str = "gpu", **extra: str) -> dict[str, str]:
        """What `sbatch` inherits from a login shell, with the node profile of ``role``'s
        partition (one localhost node plays both, so each job names its profile)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANA_")}
        env.update(SANA_PROFILE=str(self.profiles[role]), SANA_HYPERPOD_DIR=str(self.fsx / "no-hyperpod-here"))
        env.update(extra)
        return env

    @property
    def user_name(self) -> str:
        return self.user.name if self.user else "root"

    def run_dir(self, job_name: str, user: str | None = None) -> Path:
        """$SANA_CHECKPOINT_ROOT/<user>/<job name> (the job user's unless ``user``)."""
        return self.fsx / "artefacts" / "checkpoints" / (user or self.user_name) / job_name

    def log_dir(self, job_name: str, job_id: int, user: str | None = None) -> Path:
        return self.fsx / "logs" / (user or self.user_name) / f"{job_name}-{job_id}"

    def slurm_out(self, job_name: str, job_id: int, user: str | None = None) -> Path:
        """Slurm's own output file: the scripts' #SBATCH --output=/fsx/logs/%u/%x-%j.out,
        with /fsx -> this site (overridden on the sbatch command line, as the contract says)."""
        return self.fsx / "logs" / (user or self.user_name) / f"{job_name}-{job_id}.out"

    def scratch(self, name: str) -> Path:
        """A directory the job user owns (inputs/outputs of one test)."""
        path = self.root / "scratch" / name
        path.mkdir(parents=True)
        if self.user is not None and os.getuid() == 0:
            shutil.chown(path, user=self.user.uid, group=self.user.gid)
        return path


def submit(cluster: SlurmCluster, site: Site, script: str | Path, *args: str, job_name: str,
           env: dict[str, str], as_root: bool = False, user: JobUser | None = None) -> int:
    """sbatch ``script`` (a name in the installed package's training/slurm/, or a path) as the
    job user (or ``user``) from its home; Slurm's output goes to the site's logs/<user>/ like the
    header says."""
    path = site.slurm_dir / script if isinstance(script, str) else script
    who = None if as_root else (user.name if user else cluster.user)
    cwd = site.fsx / "home" / user.name if user else site.submit_dir
    return cluster.sbatch(path, *args, options=(f"--job-name={job_name}",
                                                f"--output={site.fsx}/logs/%u/%x-%j.out"),
                          env=env, cwd=cwd, user=who)


def shared_dir(path: Path, user: JobUser | None) -> None:
    """root:<cluster group> 2775, as the lifecycle makes /fsx/{data,checkpoints,logs}."""
    path.mkdir(parents=True, exist_ok=True)
    if user is not None and os.getuid() == 0:
        os.chown(path, 0, user.gid)
    path.chmod(0o2775)


@pytest.fixture(scope="module")
def site(slurm_cluster: SlurmCluster) -> Iterator[Site]:
    from training.data.shards import write_synthetic_features

    # Not tmp_path_factory: pytest's base dir is 0700, the job user could not reach it.
    root = Path(tempfile.mkdtemp(prefix="sana-site-"))
    root.chmod(0o755)
    user = slurm_cluster.job_user
    other = slurm_cluster.other_user
    fsx = root / "fsx"
    fsx.mkdir()
    fsx.chmod(0o755)
    if user is not None and os.getuid() == 0:
        # Shared and per-user directories as provisioning makes them (the real shared_dirs.sh).
        lay_out_fsx(fsx, [u for u in (user, other) if u is not None], user.gid)
    else:  # not root: one user, who owns the tree
        for sub in ("data", "artefacts/checkpoints", "logs", "cache"):
            shared_dir(fsx / sub, user)
    package = install_package(fsx / "platform")
    point_current(fsx / "platform", package.name)
    envs_dir = fsx / "envs"
    keys = {"gpu": "a1b2c3d4e5f6", "neuron": "0f1e2d3c4b5a"}
    envs = {"gpu": make_env(envs_dir, "gpu", REPO / ".venv", key=keys["gpu"])}
    if (REPO / ".venv-xla" / "pyvenv.cfg").exists():  # else the Trainium test skips
        envs["neuron"] = make_env(envs_dir, "neuron", REPO / ".venv-xla", key=keys["neuron"])
    for kind, target in envs.items():
        (envs_dir / kind).symlink_to(target.name)
    features = fsx / "data" / "tiny-features"
    write_synthetic_features(features, num_samples=64, latent_shape=(4, 32, 32), text_dim=8,
                             max_text_tokens=16, seed=0)
    port = free_port()
    profiles = {role: write_node_profile(root / f"node-{role}", role=role, fsx=fsx, rdzv_port=port)
                for role in ("gpu", "trn")}
    for who in (user, other):
        home = fsx / "home" / (who.name if who else "root")
        home.mkdir(parents=True, exist_ok=True)
        if who is not None and os.getuid() == 0:
            shutil.chown(home, user=who.uid, group=who.gid)
            home.chmod(0o700)
    submit_dir = fsx / "home" / (user.name if user else "root")
    yield Site(root=root, fsx=fsx, profiles=profiles, features=features, submit_dir=submit_dir,
               package=package, envs=envs, env_keys=keys, user=user, other=other)
    shutil.rmtree(root, ignore_errors=True)


def train_args(site: Site) -> tuple[str, ...]:
    return (str(site.tiny), "--set", f"data.path={site.features}", "--set", f"checkpoint.every_steps={EVERY}",
            "--set", "checkpoint.keep_last=0", "--max-steps", str(MAX_STEPS))


def submit_gpu(cluster: SlurmCluster, site: Site, job_name: str) -> int:
    return submit(cluster, site, "train-gpu.sbatch", *train_args(site), job_name=job_name,
                  env=site.env(SANA_NPROC_PER_NODE="2"))


def wait_for_checkpoint(cluster: SlurmCluster, site: Site, job_name: str, job_id: int, at_least: int) -> None:
    """Until the running job has a complete checkpoint at step >= ``at_least``."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while not [s for s in complete_checkpoints(site.run_dir(job_name)) if s >= at_least]:
        info = cluster.job(job_id)
        assert info["JobState"] in {"PENDING", "RUNNING"}, job_failure(cluster, site, info, job_name, job_id)
        assert time.monotonic() < deadline, "no checkpoint before the timeout"
        time.sleep(0.2)


def complete_checkpoints(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").exists())


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


def job_failure(cluster: SlurmCluster, site: Site, info: dict[str, str], job_name: str, job_id: int) -> str:
    texts = []
    for log in (site.slurm_out(job_name, job_id), site.log_dir(job_name, job_id) / "job.log"):
        texts.append(log.read_text()[-4000:] if log.exists() else f"(no {log})")
    return f"job {job_id} {info.get('JobState')} exit {info.get('ExitCode')}\n" + "\n".join(texts) + cluster.logs()


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
    state = json.loads((final / "train_state.json").read_text())
    assert state["step"] == MAX_STEPS
    assert logged_steps(run_dir)[-1] == MAX_STEPS
    # The checkpoint names the exact package and env the job ran (pinned by launch.sh).
    assert state["provenance"]["job"] == {
        "package_root": str(site.package), "package_hash": site.package.name,
        "env_path": str(site.envs["gpu"]), "env_requirements_hash": site.env_keys["gpu"]}

    job_log = (log_dir / "job.log").read_text()
    assert f"package {site.package} hash={site.package.name} (pinned at first start" in job_log
    assert f"env {site.envs['gpu']} requirements_hash={site.env_keys['gpu']}" in job_log
    assert "nproc_per_node=2" in job_log
    assert f"--rdzv-id={job_id}" in job_log  # the torchrun line launch.sh prints
    assert "'world_size': 2" in job_log, job_log[-2000:]
    # srun without --auto-resume: the HyperPod marker directory does not exist here.
    assert "--auto-resume" not in job_log
    # Per-rank logs from torchrun, one directory per local rank of this node.
    rank_logs = sorted(log_dir.glob(f"ranks/*/{job_id}_*/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in rank_logs] == ["0", "1"], list(log_dir.rglob("*"))
    # Slurm's own output went to the shared log dir, not the submit dir or the package tree.
    assert f"launch.sh: job {job_id} ({job_name})" in site.slurm_out(job_name, job_id).read_text()
    assert not list(site.submit_dir.glob("slurm-*.out"))


def test_jobs_run_as_the_submitting_user_with_the_gpus_requested_as_gres(
        slurm_cluster: SlurmCluster, site: Site, uninterrupted: tuple[str, int]) -> None:
    """Jobs as non-root: the user's own job, writing as that user into the user's own dirs;
    the GPU script's request reaches slurmctld as GRES (so its steps get the GPUs)."""
    user = slurm_cluster.job_user
    if user is None or user.uid == 0:
        skip_unless_required("no unprivileged user to submit as (useradd missing)")
    job_name, job_id = uninterrupted
    info = slurm_cluster.job(job_id)
    assert info["UserId"].startswith(f"{user.name}(")
    assert info["TresPerNode"] == f"gres:gpu:{slurm_cluster.gpus_per_node}"
    assert f"user={user.name}" in (site.log_dir(job_name, job_id) / "job.log").read_text()
    for written in (site.log_dir(job_name, job_id), site.run_dir(job_name) / "checkpoints", site.slurm_out(job_name, job_id)):
        assert written.stat().st_uid == user.uid, written
    # The package tree is root's and read-only to the user: nothing there could be written.
    assert site.package.stat().st_uid == 0 and not site.package.stat().st_mode & 0o022


def test_scancel_then_resubmit_continues_from_last_checkpoint_to_identical_weights(
        slurm_cluster: SlurmCluster, site: Site, uninterrupted: tuple[str, int]) -> None:
    job_name = "tiny-interrupted"
    run_dir = site.run_dir(job_name)
    first = submit_gpu(slurm_cluster, site, job_name)
    wait_for_checkpoint(slurm_cluster, site, job_name, first, 2 * EVERY)
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
    # SIGTERM's save lands one or two steps after the signal, not on a logging step
    # (training/failure/preemption.py): the resumed run logs from the next multiple of log_every on.
    assert second_steps and second_steps[0] == (resumed_from // EVERY + 1) * EVERY, second_steps
    assert second_steps[-1] == MAX_STEPS
    assert complete_checkpoints(run_dir)[-1] == MAX_STEPS

    # ... and ended exactly where the uninterrupted run did.
    straight = load_full(site.run_dir(uninterrupted[0]) / "checkpoints" / f"step-{MAX_STEPS:08d}")["model"]
    resumed = load_full(run_dir / "checkpoints" / f"step-{MAX_STEPS:08d}")["model"]
    assert straight.keys() == resumed.keys()
    different = [name for name in straight if not straight[name].equal(resumed[name])]
    assert not different, f"{len(different)} tensors differ after resume, e.g. {different[:3]}"


def test_resubmit_on_fewer_ranks_with_more_steps_trains_on_from_the_finished_run(
        slurm_cluster: SlurmCluster, site: Site, uninterrupted: tuple[str, int]) -> None:
    """runbooks/train-slurm.md "Change the node count" and "Train longer": same job name,
    other worker count, higher --max-steps -> the run goes on from its last checkpoint."""
    job_name, _ = uninterrupted
    run_dir = site.run_dir(job_name)
    job_id = submit(slurm_cluster, site, "train-gpu.sbatch", *train_args(site), "--max-steps", str(MAX_STEPS + EVERY),
                    job_name=job_name, env=site.env(SANA_NPROC_PER_NODE="1"))
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)

    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert re.search(rf"from step {MAX_STEPS} to {MAX_STEPS + EVERY}, global batch 4\b", job_log), job_log[-3000:]
    state = json.loads((run_dir / "checkpoints" / f"step-{MAX_STEPS + EVERY:08d}" / "train_state.json").read_text())
    assert state["world_size"] == 1
    # 80 steps of 2 ranks x 4, then 10 steps of 1 rank x 4: the sample count carries over.
    assert state["samples_seen"] == MAX_STEPS * 8 + EVERY * 4


def test_a_config_error_fails_the_job_with_the_one_line_error_in_job_log(
        slurm_cluster: SlurmCluster, site: Site) -> None:
    job_name = "tiny-bad-data"
    missing = site.root / "no-features-here"
    job_id = submit(slurm_cluster, site, "train-gpu.sbatch", str(site.tiny), "--set", f"data.path={missing}",
                    job_name=job_name, env=site.env(SANA_NPROC_PER_NODE="1"))
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "FAILED", info
    assert info["ExitCode"] != "0:0"
    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert re.search(rf"error: .*{re.escape(str(missing))}", job_log), job_log[-3000:]
    assert "step finished with exit code" in job_log
    assert not complete_checkpoints(site.run_dir(job_name))


def test_precompute_sbatch_as_root_writes_features(slurm_cluster: SlurmCluster, site: Site,
                                                  tmp_path: Path) -> None:
    """The one root job: root (the platform team) can still run the job scripts."""
    from training.model.tiny import TINY_RESOLUTION, build_tiny_components, write_image_caption_folder

    models = build_tiny_components(tmp_path / "models")
    raw = tmp_path / "raw"
    write_image_caption_folder(raw, num=6, seed=1)
    out = site.fsx / "data" / "precomputed"
    job_name = "tiny-precompute"
    job_id = submit(
        slurm_cluster, site, "precompute.sbatch", "--input", str(raw), "--out", str(out), "--vae", str(models["vae"]),
        "--text-encoder", str(models["text_encoder"]), "--tokenizer", str(models["tokenizer"]),
        "--resolution", str(TINY_RESOLUTION), "--max-text-tokens", "16", "--samples-per-shard", "3",
        job_name=job_name, env=site.env(SANA_NPROC_PER_NODE="1"), as_root=True)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)

    # One rank keeps this cheap; the rank split itself is tests/training/data/test_precompute.py's.
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 6 and len(index["shards"]) == 2
    job_log = (site.log_dir(job_name, job_id, user="root") / "job.log").read_text()
    assert "rank 0/1" in job_log and "user=root" in job_log
    assert slurm_cluster.job(job_id)["UserId"].startswith("root(")
    assert not site.run_dir(job_name, user="root").exists()  # no checkpoint directory for a precompute job


def test_bench_sbatch_on_hyperpod_gets_auto_resume_and_writes_its_result_where_the_submitter_said(
        slurm_cluster: SlurmCluster, site: Site) -> None:
    """Three launcher rules in one cheap job: bench.sbatch's result lands in the job's log
    dir; on HyperPod (marker dir present) srun gets --auto-resume=1 and accepts it; and a
    SANA_* variable exported at submit time (SANA_LOG_ROOT) wins over the node profile."""
    stub = slurm_cluster.auto_resume_record is not None  # srun knows --auto-resume only with it
    scratch = site.scratch("bench")
    marker = scratch / "opt-sagemaker_cluster"  # stands for /opt/sagemaker_cluster
    if stub:
        marker.mkdir()
    own_logs = scratch / "my-logs"  # a researcher's `SANA_LOG_ROOT=... sbatch`
    job_name = "tiny-bench"
    env = site.env(SANA_NPROC_PER_NODE="1", SANA_HYPERPOD_DIR=str(marker), SANA_LOG_ROOT=str(own_logs))
    # No --work-dir: launch.sh's per-user default must work for a user (bench's own is shared).
    job_id = submit(slurm_cluster, site, "bench.sbatch", str(site.tiny), "--synthetic", "--steps", "3",
                    "--warmup", "1", job_name=job_name, env=env)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    log_dir = own_logs / site.user_name / f"{job_name}-{job_id}"  # <SANA_LOG_ROOT>/<user>/
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
    # One rank: XLA collectives across processes on PJRT CPU return wrong values (tests/xla/graph_hash_worker.py);
    # cross-rank behaviour is the GPU test's.
    job_id = submit(slurm_cluster, site, "train-trainium.sbatch", str(site.tiny), "--set", f"data.path={site.features}",
                    "--set", "checkpoint.every_steps=2", "--max-steps", "4", job_name=job_name,
                    env=site.env("trn", SANA_NPROC_PER_NODE="1", PJRT_DEVICE="CPU"))
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)
    assert info["Partition"] == "trn"

    run_dir = site.run_dir(job_name)
    assert complete_checkpoints(run_dir) == [2, 4]
    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert f"env {site.envs['neuron']} requirements_hash={site.env_keys['neuron']}" in job_log  # trn profile's env
    assert "gpu" not in slurm_cluster.job(job_id).get("TresPerNode", "")  # the trn script asks for no GPUs
    summary = json.loads(re.findall(r"^0: \[default0\]:(\{.*\"compiles\".*\})$", job_log, re.M)[-1])
    assert summary["steps"] == 4 and summary["compiles"] >= 1  # the XLA backend ran the steps
    assert "'pjrt_device': 'CPU'" in job_log and "from step 0 to 4" in job_log  # rank 0's training log
    assert (run_dir / "tensorboard").is_dir()  # the config as shipped, TensorBoard included
    assert f"NEURON_RT_ROOT_COMM_ID={slurm_cluster.node}:46820" in job_log


def test_a_job_script_copied_away_from_its_launcher_fails_saying_so(slurm_cluster: SlurmCluster,
                                                                    site: Site) -> None:
    away = site.scratch("copied-away")
    copy = away / "train-gpu.sbatch"
    copy.write_text((site.slurm_dir / "train-gpu.sbatch").read_text())
    copy.chmod(0o644)
    job_id = submit(slurm_cluster, site, copy, job_name="stray", env=site.env())
    info = slurm_cluster.wait(job_id, timeout=120)
    assert info["JobState"] == "FAILED"
    out = site.slurm_out("stray", job_id).read_text()
    assert f"train-gpu.sbatch: no launch.sh next to the submitted script (in '{away}')" in out


def point_link(link: Path, target: str) -> None:
    """Swap a symlink atomically, as lifecycle_scripts/common.sh point_link does."""
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    tmp.replace(link)


def requeue_now(cluster: SlurmCluster, job_id: int) -> None:
    """`scontrol requeue` (what HyperPod's auto-resume does on GPU nodes), then let it start
    again at once: Slurm holds a requeued batch job back (BeginTime) for about two minutes."""
    cluster.run("scontrol", "requeue", str(job_id))
    deadline = time.monotonic() + 120
    while cluster.job(job_id).get("JobState") != "PENDING":
        assert time.monotonic() < deadline, f"job {job_id} not PENDING after requeue: {cluster.job(job_id)}"
        time.sleep(0.3)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def test_a_requeued_job_keeps_the_package_and_env_it_started_with_after_current_moves(
        slurm_cluster: SlurmCluster, site: Site) -> None:
    """Pinned job environment: `current` (package) and envs/gpu (env) flip to a new version
    while the job runs; the job is requeued; its second start, launched from the NEW package's
    script (the path it was submitted as), goes on with the old package and env, and the
    checkpoints record them. The new package cannot even be imported and the new env's python
    exits 97, so any step that used either fails the job."""
    platform = site.fsx / "platform"
    new_package = install_package(platform, name="feedfacecafe")
    init = new_package / "training" / "__init__.py"
    init.chmod(0o644)
    init.write_text(init.read_text() + '\nraise RuntimeError("package feedfacecafe: a pinned job imported the new package")\n')
    init.chmod(0o444)
    new_env = make_env(site.fsx / "envs", "gpu", REPO / ".venv", key="ffffffffffff", works=False)
    job_name = "tiny-pinned"
    job_id = submit_gpu(slurm_cluster, site, job_name)
    try:
        wait_for_checkpoint(slurm_cluster, site, job_name, job_id, EVERY)
        point_current(platform, new_package.name)
        point_link(site.fsx / "envs" / "gpu", new_env.name)
        requeue_now(slurm_cluster, job_id)
        info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    finally:
        point_current(platform, site.package.name)
        point_link(site.fsx / "envs" / "gpu", site.envs["gpu"].name)
    assert info["JobState"] == "COMPLETED", job_failure(slurm_cluster, site, info, job_name, job_id)
    assert info["Restarts"] == "1"

    # --open-mode=append: Slurm's output file holds both starts, the second re-executing the
    # pinned launcher from the new package's script.
    out = site.slurm_out(job_name, job_id).read_text()
    assert "restart=0" in out and "restart=1" in out, out[-3000:]
    assert (f"launch.sh: job {job_id} restart 1: {new_package} is not the package it was pinned to; "
            f"re-executing {site.package}/training/slurm/launch.sh") in out
    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    pin = site.log_dir(job_name, job_id) / "pinned-env"
    assert f"package {site.package} hash={site.package.name} (reused from {pin})" in job_log
    resumed = re.findall(r"from step (\d+) to 80\b", job_log)
    assert len(resumed) == 2 and int(resumed[1]) >= EVERY, resumed  # the second start resumed

    expected = {"package_root": str(site.package), "package_hash": site.package.name,
                "env_path": str(site.envs["gpu"]), "env_requirements_hash": site.env_keys["gpu"]}
    final = site.run_dir(job_name) / "checkpoints" / f"step-{MAX_STEPS:08d}" / "train_state.json"
    assert json.loads(final.read_text())["provenance"]["job"] == expected
