"""Job-site helpers the Slurm tests share: envs the job user can run, the node profile as
provisioning writes it, a free port. A plain module (not a conftest) so tests import it by name."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from tests.slurm.conftest import skip_unless_required

REPO = Path(__file__).resolve().parents[2]


def others_can_run(path: Path) -> bool:
    """Whether a user other than root can execute ``path`` (o+x on it and every parent)."""
    return all(part.stat().st_mode & 0o001 for part in [path, *path.parents])


def base_python_for(venv: Path) -> Path:
    """An interpreter the job user can run that matches ``venv``'s (same X.Y, so its compiled
    wheels load): the venv's own base when others may run it, else the system's pythonX.Y.
    (Here the repo venvs come from root's pyenv, which only root can reach.)"""
    cfg = dict(line.split(" = ", 1) for line in (venv / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    own = Path(os.path.realpath(venv / "bin" / "python"))
    if others_can_run(own):
        return own
    minor = ".".join(cfg["version"].split(".")[:2])
    system = shutil.which(f"python{minor}", path="/usr/local/bin:/usr/bin:/bin")
    if system is None or not others_can_run(Path(system)):
        skip_unless_required(f"{own} ({venv}'s Python) is not executable by other users and there is "
                             f"no system python{minor}; the job user cannot run the tests' env")
    return Path(system)


def make_env(envs: Path, kind: str, venv: Path, *, key: str, works: bool = True) -> Path:
    """An env as lifecycle_scripts/python_env.sh leaves it: a venv at <envs>/<kind>-<key> with
    the .sana-env-ready marker (<envs>/<kind> is pointed at it by the caller). No pip install
    here: a .pth adds ``venv``'s site-packages (with their own .pth files, via addsitedir).
    ``works=False`` makes one whose python must never be run (it exits 97)."""
    target = envs / f"{kind}-{key}"
    if works:
        subprocess.run([str(base_python_for(venv)), "-m", "venv", "--without-pip", str(target)], check=True,
                       capture_output=True, timeout=120)
        purelib = subprocess.run([str(target / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        packages = next((venv / "lib").glob("python3*/site-packages"))
        Path(purelib, "sana-test-deps.pth").write_text(f"import site; site.addsitedir({str(packages)!r})\n")
    else:
        (target / "bin").mkdir(parents=True)
        (target / "bin" / "python").write_text(
            f'#!/bin/sh\necho "env {target} must not be used by this job" >&2\nexit 97\n')
        (target / "bin" / "python").chmod(0o755)
    (target / ".sana-env-ready").write_text(f"key={key} built_by=test at=now requirements=requirements-{kind}.txt\n")
    return target


def write_node_profile(node_root: Path, *, role: str, fsx: Path, rdzv_port: int) -> Path:
    """The node profile exactly as provisioning writes it: lifecycle_scripts/node_profile.sh
    run for real (PLATFORM_ROOT keeps it in a temp dir), with FSx and the envs pointed here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANA_")}
    env.update(PLATFORM_ROOT=str(node_root), NODE_ROLE=role, NODE_GROUP=role, FSX=str(fsx),
               ENV_GPU_DIR=str(fsx / "envs" / "gpu"), ENV_NEURON_DIR=str(fsx / "envs" / "neuron"),
               CFG_RDZV_PORT=str(rdzv_port), CFG_REGION="us-east-1", CFG_PROJECT="sana-test",
               CFG_CLUSTER_NAME="localhost", CFG_ARTEFACTS_BUCKET="artefacts", CFG_DATA_BUCKET="data")
    proc = subprocess.run(["bash", str(REPO / "lifecycle_scripts" / "node_profile.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"lifecycle_scripts/node_profile.sh failed: {proc.stderr}"
    return node_root / "etc" / "profile.d" / "sana-platform.sh"


def lay_out_fsx(fsx: Path, users: list, gid: int) -> None:
    """FSx's shared and per-user directories exactly as provisioning makes them:
    lifecycle_scripts/shared_dirs.sh run for real (as root) for ``users`` (JobUser objects) and
    the cluster group ``gid``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SANA_", "CFG_"))}
    env.update(FSX=str(fsx), CFG_CLUSTER_GID=str(gid), HOME_ROOT_DIR=str(fsx / "home"),
               CFG_CLUSTER_USERS=" ".join(f"{u.name}:{u.uid}" for u in users))
    proc = subprocess.run(["bash", str(REPO / "lifecycle_scripts" / "shared_dirs.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"lifecycle_scripts/shared_dirs.sh failed: {proc.stdout}{proc.stderr}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
