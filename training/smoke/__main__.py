"""CLI of the deployment smoke test (normally started by training/slurm/smoke.sbatch).

    python -m training.smoke run [--local]         the whole table (inside a Slurm job)
    python -m training.smoke node gpu|trn [--local] one node's part of a 2-node check (srun task)
    python -m training.smoke versions              this host's Neuron versions as JSON

Settings come from the node profile's variables (SANA_FSX, SANA_LOG_ROOT, SANA_ENV_GPU,
SANA_ENV_NEURON, SANA_ARTEFACTS_BUCKET, SANA_CLUSTER) and SANA_SMOKE_* overrides
(runbooks/deploy.md lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError, exits_cleanly
from training.smoke import FAIL, Row, checks, exit_code, render
from training.smoke.parse import NEURON_PIP_PACKAGES, NEURON_SYSTEM_PACKAGES

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
PROFILE = "/etc/profile.d/sana-platform.sh"


def _host() -> str:
    return socket.gethostname().split(".")[0]


# --------------------------------------------------------------------------- installed versions

def _system_version(package: str) -> str | None:
    """A Debian (HyperPod's DLAMI is Ubuntu) or RPM package's installed version."""
    for argv in (["dpkg-query", "-W", "-f=${Version}", package], ["rpm", "-q", "--qf", "%{VERSION}", package]):
        if shutil.which(argv[0]) is None:
            continue
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip()
    return None


def installed_neuron_versions() -> dict[str, str | None]:
    """This host's Neuron stack: the pip packages of the running Python (the Neuron env) and
    the runtime, collectives and driver. For the driver the LOADED kernel module's version
    (/sys/module/neuron/version) wins over the dkms package: that is what jobs talk to."""
    found: dict[str, str | None] = {}
    for name in NEURON_PIP_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    for name in sorted({p for release in NEURON_SYSTEM_PACKAGES.values() for p in release}):
        found[name] = _system_version(name)
    module = Path("/sys/module/neuron/version")
    if module.is_file():
        found["aws-neuronx-dkms"] = module.read_text().strip()
    return {k: v for k, v in found.items() if v is not None}


# --------------------------------------------------------------------------- node step

def _load_profile(only_sana: bool = False) -> None:
    """The node's own profile (NCCL/EFA or Neuron settings), like launch.sh: what the
    submitter exported wins, except the node identity. ``only_sana``: just the platform's
    SANA_* settings (the coordinator: its node's NCCL/Neuron settings must not travel into
    the sub-jobs on the other partition)."""
    profile = os.environ.get("SANA_PROFILE", PROFILE)
    if not os.access(profile, os.R_OK):
        return
    proc = subprocess.run(["bash", "-c", 'set -a; source "$1" >/dev/null; env -0', "_", profile],
                          capture_output=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    for item in proc.stdout.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if not sep or key in ("PWD", "SHLVL", "_") or (only_sana and not key.startswith("SANA_")):
            continue
        if key not in os.environ or key in ("SANA_ROLE", "SANA_GROUP"):
            os.environ[key] = value


def _nproc(kind: str, local: bool) -> int:
    if os.environ.get("SANA_SMOKE_NPROC"):
        return int(os.environ["SANA_SMOKE_NPROC"])
    if local:
        return 2 if kind == "gpu" else 1
    if kind == "gpu":
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
        count = sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out and out.returncode == 0 else 0
    else:
        out = subprocess.run(["neuron-ls", "--json-output"], capture_output=True, text=True) \
            if shutil.which("neuron-ls") else None
        count = sum(int(d.get("nc_count", 0)) for d in json.loads(out.stdout)) if out and out.returncode == 0 else 0
    if count < 1:
        if kind == "gpu":
            raise UserError(f"{_host()}: nvidia-smi -L lists no GPU visible to this job; check the GPU "
                            "request (SANA_SMOKE_GPU_SBATCH, default --gres=gpu:8) or replace the node")
        raise UserError(f"{_host()}: neuron-ls lists no NeuronCore (is the Neuron driver loaded? "
                        "`lsmod | grep neuron`); replace the node or reinstall aws-neuronx-dkms")
    return count


def node_step(kind: str, local: bool) -> None:
    """One srun task of the 2-node job: report versions (trn), then torchrun this node."""
    _load_profile()
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    head, nnodes = hosts[0], int(os.environ.get("SLURM_JOB_NUM_NODES", len(hosts)))
    port = os.environ.get("SANA_SMOKE_RDZV_PORT", os.environ.get("SANA_RDZV_PORT", "29500"))
    env = dict(os.environ)
    if kind == "gpu":
        # NCCL's env-var page: NCCL_DEBUG=INFO prints the network selection the check parses;
        # INIT,NET limits it to init and network lines.
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
        entry = ["-m", "training.smoke.allreduce", "--backend", "gloo" if local else "nccl"]
        if local:
            entry += ["--size-mib", "4"]
    else:
        print(f"{checks.VERSIONS_MARKER} {_host()} {json.dumps(installed_neuron_versions())}", flush=True)
        # Neuron collectives bootstrap from one root address (as launch.sh sets it).
        env.setdefault("NEURON_RT_ROOT_COMM_ID", f"{head}:{os.environ.get('SANA_NEURON_COMM_PORT', '46820')}")
        if local:
            env.setdefault("PJRT_DEVICE", "CPU")
        entry = ["-m", "training.smoke.trn", "--steps", "3" if not local else "2"]
        if local:
            entry += ["--precision", "fp32"]
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={_nproc(kind, local)}", "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{port}",
            f"--rdzv-id={os.environ.get('SLURM_JOB_ID', 'smoke')}", "--max-restarts=0", *entry]
    print(f"smoke node {_host()}: {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    os.execve(sys.executable, argv, env)


# --------------------------------------------------------------------------- run

def config_from_env(local: bool) -> checks.SmokeConfig:
    env = os.environ
    fsx = Path(env.get("SANA_FSX", "/fsx"))
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise UserError("not inside a Slurm job; submit with `sbatch training/slurm/smoke.sbatch`")
    log_root = Path(env.get("SANA_LOG_ROOT", fsx / "logs"))
    # The user's own log directory, as for every job (training/slurm/launch.sh, own_dir).
    user = pwd.getpwuid(os.getuid()).pw_name
    return checks.SmokeConfig(
        package_root=PACKAGE_ROOT, fsx=fsx, log_dir=log_root / user / f"smoke-{job}",
        artefacts_bucket=env.get("SANA_ARTEFACTS_BUCKET", ""), cluster=env.get("SANA_CLUSTER", "sana"),
        gpu_env=Path(env.get("SANA_ENV_GPU", fsx / "envs" / "gpu")),
        neuron_env=Path(env.get("SANA_ENV_NEURON", fsx / "envs" / "neuron")),
        gpu_partition=env.get("SANA_SMOKE_GPU_PARTITION", "gpu"),
        trn_partition=env.get("SANA_SMOKE_TRN_PARTITION", "trn"),
        gpu_sbatch_args=tuple(shlex.split(env.get("SANA_SMOKE_GPU_SBATCH", "--gres=gpu:8"))),
        local=local, job_timeout_s=float(env.get("SANA_SMOKE_JOB_TIMEOUT_S", "1800")),
        single_node=single_node_partitions(env))


def single_node_partitions(env) -> frozenset[str]:
    """SANA_SMOKE_SINGLE_NODE: partitions declared one-node (comma-separated), one of those the job checks."""
    checked = (env.get("SANA_SMOKE_GPU_PARTITION", "gpu"), env.get("SANA_SMOKE_TRN_PARTITION", "trn"))
    declared = frozenset(p.strip() for p in env.get("SANA_SMOKE_SINGLE_NODE", "").split(",") if p.strip())
    unknown = sorted(declared - set(checked))
    if unknown:
        raise UserError(f"SANA_SMOKE_SINGLE_NODE={env['SANA_SMOKE_SINGLE_NODE']}: {', '.join(unknown)} is not a "
                        f"partition this job checks; allowed: {', '.join(checked)} (comma-separated)")
    return declared


def _guard(name: str, fn, *args) -> list[Row]:
    """A check that crashes is a FAIL row naming the crash, never a missing row."""
    try:
        out = fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported as one table line
        return [Row(name, FAIL, f"check crashed: {type(exc).__name__}: {exc}")]
    return out if isinstance(out, list) else [out]


def run(local: bool) -> int:
    _load_profile(only_sana=True)
    cfg = config_from_env(local)
    with contextlib.suppress(OSError):  # the fsx row reports a log dir that cannot be made
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    try:
        nodes = checks.slurm_nodes()
        rows.append(checks.slurm_row(nodes))
    except Exception as exc:  # noqa: BLE001
        nodes = []
        rows.append(Row("slurm-nodes", FAIL, f"cannot list nodes: {exc}"))
    rows += _guard("node-status", lambda: checks.node_status_row(cfg.fsx / "logs" / "provision",
                                                                  checks.node_addresses()))
    rows += _guard("node-warning", checks.node_warning_rows, cfg.fsx / "logs" / "provision")
    rows += _guard("fsx", lambda: checks.fsx_row(cfg.fsx, cfg.log_dir, require_lustre=not local))
    key = f"smoke/{cfg.cluster}/{os.environ['SLURM_JOB_ID']}-{_host()}.probe"
    rows += _guard("imds", lambda: checks.imds_row(local=local))
    rows += _guard("s3", checks.s3_row, cfg.artefacts_bucket, key)
    rows += _guard("gpu-allreduce", checks.gpu_allreduce, cfg, nodes)
    rows += _guard("trn-allreduce", checks.trn_checks, cfg, nodes)
    table = render(rows)
    print(table, flush=True)
    with contextlib.suppress(OSError):
        (cfg.log_dir / "table.txt").write_text(table + "\n")
    return exit_code(rows)


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.smoke", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run every check and print the table")
    r.add_argument("--local", action="store_true", help="CPU/gloo path (tests)")
    n = sub.add_parser("node", help="one node's part of a 2-node check")
    n.add_argument("kind", choices=("gpu", "trn"))
    n.add_argument("--local", action="store_true")
    sub.add_parser("versions", help="print this host's Neuron versions as JSON")
    args = p.parse_args(argv)
    if args.command == "run":
        sys.exit(run(args.local))
    if args.command == "node":
        node_step(args.kind, args.local)
    else:
        print(json.dumps(installed_neuron_versions(), indent=2))


if __name__ == "__main__":
    main()
