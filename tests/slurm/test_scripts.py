"""Static and no-daemon checks of the job scripts: shellcheck, headers, refusing to run bare."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import skip_or_fail

REPO = Path(__file__).resolve().parents[2]
ME = pwd.getpwuid(os.getuid()).pw_name  # launch.sh keeps a job's logs in <log root>/<user>/
SLURM_DIR = REPO / "training" / "slurm"
SCRIPTS = sorted([*SLURM_DIR.glob("*.sbatch"), *SLURM_DIR.glob("*.sh")])
PARTITIONS = {"train-gpu.sbatch": "gpu", "train-trainium.sbatch": "trn", "precompute.sbatch": "gpu",
              "bench.sbatch": "gpu", "precompile-trainium.sbatch": "trn"}


def shellcheck() -> str:
    venv = REPO / ".venv" / "bin" / "shellcheck"
    found = str(venv) if venv.exists() else shutil.which("shellcheck")
    if found is None:
        skip_or_fail("shellcheck not installed; run `make setup`", required_by="SANA_REQUIRE_ALL")
    return found


def test_the_four_job_scripts_and_the_launcher_exist():
    assert {*PARTITIONS, "launch.sh"} <= {p.name for p in SCRIPTS}


def header(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", path.read_text(), re.M))


@pytest.mark.parametrize("path", sorted(SLURM_DIR.glob("*.sbatch")), ids=lambda p: p.name)
def test_every_job_script_appends_slurms_output_under_fsx_logs(path):
    """Contract: absolute, in the submitting user's own /fsx/logs/<user>/ (%u; never the package
    tree, the cwd or a directory another user can write, where a planted link would redirect
    the output of root's rollout job), appended so a requeue (HyperPod auto-resume) keeps the
    earlier output."""
    assert header(path)["output"] == "/fsx/logs/%u/%x-%j.out"
    assert header(path)["open-mode"] == "append"


@pytest.mark.parametrize("name", ["train-gpu.sbatch", "precompute.sbatch", "bench.sbatch"])
def test_gpu_job_scripts_request_the_gpus_as_gres(name):
    """--exclusive alone gives srun steps no GPUs (srun(1) --gres); the scripts ask explicitly."""
    assert header(SLURM_DIR / name)["gres"] == "gpu:8"
    assert "gres" not in header(SLURM_DIR / "train-trainium.sbatch")


def test_scripts_are_shellcheck_clean():
    proc = subprocess.run([shellcheck(), "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(PARTITIONS))
def test_sbatch_header_asks_for_whole_nodes_one_task_each_on_its_partition(name):
    fields = header(SLURM_DIR / name)
    assert fields["partition"] == PARTITIONS[name]
    assert fields["ntasks-per-node"] == "1"
    assert "exclusive" in fields
    assert fields["nodes"].isdigit()


def test_launcher_refuses_to_run_outside_a_slurm_job(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SANA_"))}
    proc = subprocess.run(["bash", str(SLURM_DIR / "launch.sh"), "job", "gpu"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert "not inside a Slurm job; submit with sbatch" in proc.stderr


def test_launcher_names_an_unknown_kind(tmp_path):
    proc = subprocess.run(["bash", str(SLURM_DIR / "launch.sh"), "job", "cuda"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 1
    assert "unknown job kind 'cuda'; use gpu, trainium, precompile, precompute, bench, export or report" in proc.stderr


@pytest.mark.parametrize("name", ["export.sbatch", "report.sbatch"])
def test_single_process_job_scripts_share_a_node_and_ask_for_no_accelerator(name):
    """export and report run one process that needs no GPU: no --exclusive, no --gres, so a
    pipeline's export does not hold a whole p5 (the pipeline passes its partition)."""
    fields = header(SLURM_DIR / name)
    assert (fields["partition"], fields["nodes"], fields["ntasks-per-node"]) == ("gpu", "1", "1")
    assert "exclusive" not in fields and "gres" not in fields


def test_an_export_step_runs_one_process_on_its_own_rendezvous_port(tmp_path):
    """launch.sh node export: ONE worker whatever SANA_NPROC_PER_NODE says (a second rank would
    write the same model), and torchrun --standalone (a free port: the node may be running a
    training job on $SANA_RDZV_PORT). The env's python is a stand-in printing its argv."""
    env_dir = tmp_path / "env"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    (env_dir / "bin" / "python").chmod(0o755)
    if shutil.which("scontrol") is None:
        skip_or_fail("scontrol not installed; run `make setup`", required_by="SANA_REQUIRE_SLURM")
    # `scontrol show hostnames` expands the node list locally; it only needs some slurm.conf.
    (tmp_path / "slurm.conf").write_text("ClusterName=x\nSlurmctldHost=localhost\n")
    env = launcher_env(tmp_path, SANA_ENV_PATH=str(env_dir), SANA_NPROC_PER_NODE="8", SLURM_JOB_NUM_NODES="2",
                       SLURM_JOB_NODELIST="n[1-2]", SLURM_CONF=str(tmp_path / "slurm.conf"), SANA_RDZV_PORT="29500",
                       SANA_JOB_LOG_DIR=str(tmp_path / "logs"), ARGV_OUT=str(tmp_path / "argv"))
    proc = subprocess.run(["bash", str(SLURM_DIR / "launch.sh"), "node", "export", "/runs/x", "--out", "/m"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:5] == ["-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1", "--standalone"]
    assert argv[argv.index("-m", 1):] == ["-m", "training.export", "/runs/x", "--out", "/m"]


def launcher_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A batch step's environment without daemons: job id/name set, no profile, FSx in tmp."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SANA_"))}
    env.update(SLURM_JOB_ID="7", SLURM_JOB_NAME="pin", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="n1",
               SANA_PROFILE=str(tmp_path / "no-profile"), SANA_FSX=str(tmp_path / "fsx"),
               SANA_HYPERPOD_DIR=str(tmp_path / "no-hyperpod"))
    env.update(extra)
    return env


def test_first_start_pins_the_resolved_package_and_env_with_their_hashes(tmp_path):
    envs = tmp_path / "fsx" / "envs"
    (envs / "gpu-abcdef012345").mkdir(parents=True)
    (envs / "gpu-abcdef012345" / ".sana-env-ready").write_text("key=abcdef012345 built_by=n1 at=x requirements=r\n")
    (envs / "gpu").symlink_to("gpu-abcdef012345")
    # srun is where this test stops: a stand-in that records what the step would inherit.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\nenv > {tmp_path}/step.env\n")
    (bin_dir / "srun").chmod(0o755)
    # A first start (no SLURM_RESTART_COUNT) pins afresh over a stale file (an earlier
    # cluster's job with the same name and id).
    stale = tmp_path / "fsx" / "logs" / ME / "pin-7" / "pinned-env"
    stale.parent.mkdir(parents=True)
    stale.write_text("SANA_PACKAGE_ROOT=/nowhere\nSANA_ENV_PATH=/nowhere\n")
    env = launcher_env(tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(SLURM_DIR / "launch.sh"), "job", "gpu"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    pinned = dict(line.split("=", 1) for line in
                  (tmp_path / "fsx" / "logs" / ME / "pin-7" / "pinned-env").read_text().splitlines())
    assert pinned == {"SANA_PACKAGE_ROOT": str(REPO), "SANA_PACKAGE_HASH": pinned["SANA_PACKAGE_HASH"],
                      "SANA_ENV_PATH": str(envs / "gpu-abcdef012345"), "SANA_ENV_HASH": "abcdef012345"}
    assert re.fullmatch(r"tree-[0-9a-f]{12}", pinned["SANA_PACKAGE_HASH"])  # a checkout, not /fsx/platform/<hash>
    step = (tmp_path / "step.env").read_text()
    assert f"SANA_ENV_PATH={envs / 'gpu-abcdef012345'}\n" in step and "SANA_ENV_HASH=abcdef012345\n" in step


def test_a_rerun_whose_pinned_package_is_gone_fails_in_one_line(tmp_path):
    logs = tmp_path / "fsx" / "logs" / ME / "pin-7"
    logs.mkdir(parents=True)
    gone = tmp_path / "fsx" / "platform" / "0123456789ab"
    (logs / "pinned-env").write_text(f"SANA_PACKAGE_ROOT={gone}\nSANA_PACKAGE_HASH=0123456789ab\n"
                                     f"SANA_ENV_PATH={tmp_path}/env\nSANA_ENV_HASH=\n")
    proc = subprocess.run(["bash", str(SLURM_DIR / "launch.sh"), "job", "gpu"], capture_output=True, text=True,
                          env=launcher_env(tmp_path, SLURM_RESTART_COUNT="1"), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"launch.sh: the package job 7 was pinned to ({gone}, in {logs / 'pinned-env'}) is gone; "
        "resubmit the job to run the current package")


# ---- privateNetwork: images only from this account's ECR --------------------------------------
OWN_REGISTRY = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"


def installed_package(tmp_path: Path, *, private: bool) -> Path:
    """The launcher as the lifecycle installs it: <fsx>/platform/<hash>/training/slurm/launch.sh with
    the package's platform settings in <hash>/lifecycle/ (lifecycle_scripts/install_package.sh)."""
    package = tmp_path / "fsx" / "platform" / "0123456789abcdef"
    (package / "training" / "slurm").mkdir(parents=True)
    shutil.copy(SLURM_DIR / "launch.sh", package / "training" / "slurm" / "launch.sh")
    (package / "lifecycle").mkdir()
    (package / "lifecycle" / "platform-settings.json").write_text(
        f'{{"private_network": {str(private).lower()}, "image_registry": "{OWN_REGISTRY}"}}')
    return package / "training" / "slurm" / "launch.sh"


def container_job(tmp_path: Path, launcher: Path, image: str) -> subprocess.CompletedProcess:
    (tmp_path / "fsx" / "images").mkdir(exist_ok=True)
    return subprocess.run(["bash", str(launcher), "job", "gpu"], capture_output=True, text=True, cwd=tmp_path,
                          env=launcher_env(tmp_path, SANA_CONTAINER_IMAGE=image))


@pytest.mark.parametrize("image", ["docker.io/library/ubuntu:24.04", "nvcr.io/nvidia/pytorch:25.01-py3",
                                   "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.6.0-gpu"])
def test_a_private_cluster_refuses_an_image_from_another_registry_in_one_line(tmp_path, image):
    proc = container_job(tmp_path, installed_package(tmp_path, private=True), image)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"launch.sh: SANA_CONTAINER_IMAGE={image}: registry {image.split('/')[0]} is not this cluster's; a private "
        f"cluster runs images from its own ECR only ({OWN_REGISTRY}): push the image there (make push-image), have "
        "it imported and name it by its URI (runbooks/containers.md)"]


def test_a_private_cluster_refuses_a_squashfs_file_that_was_not_imported_from_ecr(tmp_path):
    own = tmp_path / "mine.sqsh"
    own.write_bytes(b"hsqs")
    proc = container_job(tmp_path, installed_package(tmp_path, private=True), str(own))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"launch.sh: SANA_CONTAINER_IMAGE={own}: not an image imported from ECR into {tmp_path}/fsx/images; "
        "a private cluster runs images from its own ECR only")


def test_a_private_cluster_takes_its_own_registry_and_online_clusters_any(tmp_path):
    """The registry check passes; what follows is the usual store lookup (nothing imported here)."""
    own = f"{OWN_REGISTRY}/sana/sana-gpu:0123456789abcdef-89abcdef"
    proc = container_job(tmp_path / "private", installed_package(tmp_path / "private", private=True), own)
    assert proc.returncode == 1 and f"SANA_CONTAINER_IMAGE={own}: not imported on this cluster" in proc.stderr
    other = "nvcr.io/nvidia/pytorch:25.01-py3"
    proc = container_job(tmp_path / "online", installed_package(tmp_path / "online", private=False), other)
    assert proc.returncode == 1 and f"SANA_CONTAINER_IMAGE={other}: not imported on this cluster" in proc.stderr
