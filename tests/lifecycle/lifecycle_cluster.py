"""Helpers for tests/lifecycle (named uniquely: several test dirs have a conftest.py).

A pretend HyperPod cluster on this machine for running lifecycle_scripts/on_create.sh for real.

Each node gets its own root filesystem (a temp dir passed as PLATFORM_ROOT) whose `fsx`
is a symlink to one shared directory, the way every node sees the same FSx for Lustre.
What HyperPod puts on a node is rebuilt here: the downloaded lifecycle prefix (a copy of
lifecycle_scripts/ + platform-settings.json + a small training/ package) and
/opt/ml/config/resource_config.json.

Commands that only work on a real node are replaced by stand-ins first on PATH (see
STANDINS); everything else (bash, python3 -m venv, pip, flock, cp, mv) is the real thing.
The training package's requirements name local stand-in wheels called `torch` and
`torch_xla`, so the env build runs real venv + pip offline (PIP_NO_INDEX) in seconds and the
readiness check's production `import torch` / `import torch, torch_xla` imports them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "lifecycle_scripts"

# What each stand-in stands for; each records its call in $STANDIN_LOG.
STANDINS = {
    # `hostname -I` on a node: its IP addresses. Here: the address the test gives the node.
    "hostname": 'if [ "$1" = "-I" ]; then echo "$STANDIN_NODE_IPS"; else echo standin-host; fi',
    # `findmnt --mountpoint DIR` on a node: FSx for Lustre mounted at DIR (with flock).
    # Here: "mounted" when DIR exists (the test creates the node's fsx link or not).
    "findmnt": 'for a; do dir=$a; done\n[ -d "$dir" ] || exit 1\necho "lustre     rw,relatime,flock,lazystatfs"',
    # nvidia-smi on a p5: the driver answers with one line per GPU.
    "nvidia-smi": 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-standin-0)"',
    # neuron-ls on a trn1: the Neuron driver answers with its device table.
    "neuron-ls": 'echo "instance-type: trn1.32xlarge (standin)"',
    # apt-get on a node whose repositories lack the package: `update` works, `install` fails
    # (tests never install anything on this machine).
    "apt-get": 'case " $* " in *" install "*) echo "E: Unable to locate package (stand-in)" >&2; exit 100;; esac',
}

ROLES = {"controller": "controller", "login": "login", "gpu": "gpu", "trn": "trn"}
NODES = {  # instance name -> (group, CustomerIpAddress)
    "controller-1": ("controller", "10.1.0.10"),
    "login-1": ("login", "10.1.0.20"),
    "gpu-1": ("gpu", "10.1.1.1"),
    "gpu-2": ("gpu", "10.1.1.2"),
    "trn-1": ("trn", "10.1.2.1"),
    "trn-2": ("trn", "10.1.2.2"),
}
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) \[([\w-]+)\] (.*)$")


def settings(package_hash: str) -> dict:
    """platform-settings.json as the cluster stack writes it (CONTRACT.md)."""
    return {
        "project": "sana", "cluster_name": "sana-test", "region": "eu-west-1",
        "fsx_mount": "/fsx",
        "groups": dict(ROLES),
        "data_bucket": "sana-data-test", "artefacts_bucket": "sana-artefacts-test",
        "lifecycle_bucket": "sagemaker-sana-lifecycle-test",
        "package_hash": package_hash,
        "neuron_pip_index": "https://pip.repos.neuron.amazonaws.com",
        "rendezvous_port": 29500,
        "envs": {"gpu": "/fsx/envs/gpu", "neuron": "/fsx/envs/neuron"},
    }


def resource_config() -> dict:
    """HyperPod's /opt/ml/config/resource_config.json for the six nodes."""
    groups: dict[str, list] = {}
    for i, (name, (group, ip)) in enumerate(NODES.items()):
        groups.setdefault(group, []).append({
            "InstanceName": name, "CustomerIpAddress": ip,
            "AgentIpAddress": f"172.16.0.{i + 1}", "InstanceId": f"i-0standin{i:08d}"})
    return {"ClusterConfig": {"ClusterName": "sana-test"},
            "InstanceGroups": [{"Name": g, "InstanceType": "ml.standin", "Instances": inst}
                               for g, inst in groups.items()]}


def build_wheel(dist: Path, name: str) -> Path:
    """A pure-Python wheel whose module `name` says it is a stand-in (pip installs it offline)."""
    info = f"{name}-0.0.0.dist-info"
    wheel = dist / f"{name}-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}/__init__.py", f'"""Stand-in for {name} in lifecycle tests."""\nSTANDIN = "{name}"\n')
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: sana-tests\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return wheel


def make_bundle(dest: Path, wheels: dict[str, Path], *, package_hash: str,
                gpu_requirements: str | None = None) -> Path:
    """What HyperPod downloads from s3://<bucket>/lifecycle/<hash>/ onto every node."""
    shutil.copytree(SCRIPTS, dest)
    (dest / "platform-settings.json").write_text(json.dumps(settings(package_hash), indent=2))
    package = dest / "training"
    package.mkdir()
    (package / "__init__.py").write_text(f'"""Stand-in training package {package_hash}."""\nVERSION = "{package_hash}"\n')
    (package / "requirements-gpu.txt").write_text(
        gpu_requirements if gpu_requirements is not None else f"# gpu env (test)\n{wheels['torch']}\n")
    (package / "requirements-neuron.txt").write_text(f"{wheels['torch']}\n{wheels['torch_xla']}\n")
    return dest


@dataclass
class Cluster:
    """Nodes sharing one FSx directory; each node has its own PLATFORM_ROOT."""

    base: Path
    bundle: Path
    standins: Path

    @property
    def fsx(self) -> Path:
        return self.base / "fsx"

    def root(self, node: str) -> Path:
        return self.base / "nodes" / node

    def prepare(self, node: str, *, fsx: bool = True) -> Path:
        """The node's root filesystem: FSx (if mounted) and HyperPod's resource config."""
        root = self.root(node)
        (root / "opt/ml/config").mkdir(parents=True, exist_ok=True)
        (root / "opt/ml/config/resource_config.json").write_text(json.dumps(resource_config()))
        self.fsx.mkdir(exist_ok=True)
        if fsx and not (root / "fsx").exists():
            (root / "fsx").symlink_to(self.fsx)
        return root

    def env(self, node: str, **overrides: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PIP_", "SANA_", "LIFECYCLE_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env.update(
            PATH=f"{self.standins}:{env['PATH']}",
            PLATFORM_ROOT=str(self.root(node)),
            STANDIN_NODE_IPS=f"{NODES.get(node, ('', '10.9.9.9'))[1]} 172.17.0.1",
            STANDIN_LOG=str(self.root(node) / "standin-calls.log"),
            # pip offline with no user/global pip config: the stand-in wheels are local files.
            PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1",
            LIFECYCLE_FSX_WAIT_S="60", LIFECYCLE_FSX_POLL_S="1", LIFECYCLE_ENV_LOCK_TIMEOUT_S="180",
        )
        env.update(overrides)
        return env

    def start(self, node: str, *, fsx: bool = True, **overrides: str) -> subprocess.Popen:
        self.prepare(node, fsx=fsx)
        return subprocess.Popen(["bash", str(self.bundle / "on_create.sh")], env=self.env(node, **overrides),
                                cwd=self.bundle, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, node: str, *, fsx: bool = True, **overrides: str) -> subprocess.CompletedProcess:
        proc = self.start(node, fsx=fsx, **overrides)
        out, err = proc.communicate(timeout=240)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def log(self, node: str) -> str:
        return (self.root(node) / "var/log/provision/provisioning.log").read_text()

    def builds(self) -> list[str]:
        """Every 'building env' line in every node's log (one per env build started)."""
        return [line for node in NODES if (self.root(node) / "var/log/provision/provisioning.log").exists()
                for line in self.log(node).splitlines() if "building env" in line]
