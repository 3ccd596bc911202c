"""Helpers for tests/lifecycle (named uniquely: several test dirs have a conftest.py).

A pretend HyperPod cluster on this machine for running lifecycle_scripts/on_init_complete.sh
for real.

Each node gets its own root filesystem (a temp dir passed as PLATFORM_ROOT) whose `fsx`
is a symlink to one shared directory, the way every node sees the same FSx for Lustre.
What HyperPod puts on a node is rebuilt here: the downloaded lifecycle prefix (a copy of
lifecycle_scripts/ + platform-settings.json + a small training/ package),
/opt/ml/config/resource_config.json, the AMI's local account files (/etc/passwd, group,
shadow, gshadow; the users step edits them with the real useradd/groupadd --prefix) and the
node's Slurm daemon, started by HyperPod before and while OnInitComplete runs (a marker the
systemctl stand-in reads).

Commands that only work on a real node are replaced by stand-ins first on PATH (see
STANDINS); everything else (bash, python3 -m venv, pip, flock, cp, mv, useradd, groupadd, usermod,
ssh-keygen) is the real thing.
The training package's requirements name local stand-in wheels called `torch` and
`torch_xla` and `torch_neuronx`, so the env build runs real venv + pip offline (PIP_NO_INDEX) in seconds and the
readiness check's production `import torch` / `import torch, torch_xla, torch_neuronx` imports them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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
    # `systemctl is-active UNIT` on a node: prints the unit's state, exit 0 only when it is
    # "active", else 3 for inactive (systemctl(1)). Here: active once the test (standing for
    # HyperPod) created $PLATFORM_ROOT/run/standin-units/UNIT.active. Every other verb fails:
    # the lifecycle must never start, stop or restart the units HyperPod owns.
    "systemctl": ('if [ "$1" = is-active ]; then\n  for unit; do :; done\n'
                  '  if [ -f "$PLATFORM_ROOT/run/standin-units/$unit.active" ]; then echo active; exit 0; fi\n'
                  '  echo inactive; exit 3\nfi\n'
                  'echo "systemctl $1: refused by the stand-in (HyperPod owns the node\'s units)" >&2; exit 1'),
    # `scontrol ping` on a login node: "Slurmctld(primary) at <host> is UP", exit 0, or "... is
    # DOWN" and exit 1 (what Debian's scontrol 22.05 does against a controller that is not
    # there). Here: UP once the test created $PLATFORM_ROOT/run/standin-units/slurmctld-reachable.active.
    # enroot on the HyperPod AMI (installed package): `enroot version` prints its version.
    "enroot": '[ "$1" = version ] && echo 3.5.0',
    # srun with pyxis loaded (HyperPod's plugstack.conf registers it): --help lists pyxis's
    # --container-image option, which is what container_runtime.sh looks for.
    "srun": ('if [ "$1" = --help ]; then echo "Usage: srun [OPTIONS...]"; '
             'echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"; exit 0; fi\n'
             'echo "srun $1: not stood in" >&2; exit 1'),
    # `scontrol show config` on a node: HyperPod's slurm.conf settings; here PrologFlags only.
    "scontrol": ('if [ "$1" = show ] && [ "$2" = config ]; then echo "PrologFlags = ${STANDIN_PROLOG_FLAGS-Alloc,Contain}"; exit 0; fi\n'
                 'if [ "$1" = ping ]; then\n'
                 '  if [ -f "$PLATFORM_ROOT/run/standin-units/slurmctld-reachable.active" ]; then\n'
                 '    echo "Slurmctld(primary) at controller-1 is UP"; exit 0\n  fi\n'
                 '  echo "Slurmctld(primary) at controller-1 is DOWN"; exit 1\nfi\n'
                 'echo "scontrol $1: not stood in" >&2; exit 1'),
}
# iptables / ip6tables on a node: the IMDS step's rules (lifecycle_scripts/imds_block.sh). Here a
# stand-in keeps them per node under $PLATFORM_ROOT/run/standin-netfilter: this machine's own
# firewall is never touched by a pretend node (tests/lifecycle/test_imds_block.py runs the real
# iptables inside a network namespace of its own). `-restore` keeps the chain it is given
# (declaring a chain flushes it, as the real one does), `-C`/`-I` the OUTPUT jump, `-S` lists.
_NETFILTER = ('d="$PLATFORM_ROOT/run/standin-netfilter"; mkdir -p "$d"; me=$(basename "$0"); fam=${me%-restore}\n'
              'case $me in *-restore) cat >"$d/$fam.rules"; exit 0;; esac\n'
              'for a; do case $a in -C) op=check;; -I) op=insert;; -S) op=list;; esac; done\n'
              'case ${op:-} in check) [ -f "$d/$fam.jump" ];; insert) echo jump >>"$d/$fam.jump";;\n'
              '  list) chain=$(for a; do :; done; echo "$a"); echo "-N $chain"; grep "^-A $chain " "$d/$fam.rules";;\n'
              '  *) echo "$me $*: not stood in" >&2; exit 2;; esac')
STANDINS.update({name: _NETFILTER for name in ("iptables", "ip6tables", "iptables-restore", "ip6tables-restore")})

# What HyperPod brings up on each role (Extended mode): the controller's slurmctld, the compute
# nodes' slurmd, and on the login node a Slurm client that reaches slurmctld.
SLURM_DAEMON = {"controller": "slurmctld", "login": "slurmctld-reachable", "gpu": "slurmd", "trn": "slurmd"}
# The AMI's local accounts before the users step (Ubuntu's default user included).
BASE_ACCOUNTS = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
              "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\ndaemon:x:1:\nubuntu:x:1000:\nnogroup:x:65534:\n",
    "shadow": "root:*:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\nubuntu:!:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n",
    "gshadow": "root:*::\ndaemon:*::\nubuntu:!::\nnogroup:*::\n",
}
USERS = {"researcher": 2001, "analyst": 2002}
SSHD_PAM = ("# PAM configuration for the Secure Shell service\n@include common-auth\naccount    required     pam_nologin.so\n"
            "@include common-account\nsession [success=ok ignore=ignore module_unknown=ignore default=bad] pam_selinux.so close\n"
            "@include common-session\n@include common-password\n")
GROUP = ("sana", 2000)

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
    """platform-settings.json as the cluster stack writes it (stacks/config.py PlatformConfig.settings)."""
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
        "cluster_group": {"name": GROUP[0], "gid": GROUP[1]},
        "cluster_users": [{"name": name, "uid": uid} for name, uid in USERS.items()],
        "home_root": "/fsx/home",
        "slurm_accounting": False,
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


def make_standins(bin_dir: Path) -> Path:
    """Write the STANDINS into ``bin_dir`` (put first on PATH), plus this interpreter as the
    node's python3 / python3.11 (directly, not through a version-manager shim: ~50 ms a call)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in STANDINS.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\n[ -n "$STANDIN_LOG" ] && echo "{name} $*" >>"$STANDIN_LOG"\n{body}\n')
        path.chmod(0o755)
    real_python = Path(os.path.realpath(sys.executable))
    for name in ("python3", "python3.11"):
        (bin_dir / name).symlink_to(real_python)
    return bin_dir


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
                gpu_requirements: str | None = None, content_hash: bool = False) -> Path:
    """What HyperPod downloads from s3://<bucket>/lifecycle/<hash>/ onto every node.

    ``package_hash`` is the package's name and VERSION; with ``content_hash`` the settings carry
    the real content hash instead (lifecycle_scripts/package_hash.py, what the cluster stack names
    the prefix with and rollout.sh recomputes): ``bundle_hash(dest)`` reads it back."""
    shutil.copytree(SCRIPTS, dest)
    package = dest / "training"
    package.mkdir()
    (package / "__init__.py").write_text(f'"""Stand-in training package {package_hash}."""\nVERSION = "{package_hash}"\n')
    (package / "requirements-gpu.txt").write_text(
        gpu_requirements if gpu_requirements is not None else f"# gpu env (test)\n{wheels['torch']}\n")
    (package / "requirements-neuron.txt").write_text(
        f"{wheels['torch']}\n{wheels['torch_xla']}\n{wheels['torch_neuronx']}\n")
    name = _hash_module().package_hash(SCRIPTS, package) if content_hash else package_hash
    (dest / "platform-settings.json").write_text(json.dumps(settings(name), indent=2))
    return dest


def bundle_hash(bundle: Path) -> str:
    """The package hash a bundle's settings carry."""
    return json.loads((bundle / "platform-settings.json").read_text())["package_hash"]


def _hash_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sana_package_hash", SCRIPTS / "package_hash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upload_bundle(bundle: Path, endpoint: str, bucket: str, prefix: str) -> None:
    """Put a bundle under s3://bucket/prefix the way the stack's BucketDeployments lay it out
    (lifecycle/<hash>/: the scripts, platform-settings.json, training/)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(bundle.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            s3.upload_file(str(path), bucket, prefix + path.relative_to(bundle).as_posix())


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

    def prepare(self, node: str, *, fsx: bool = True, slurm: bool = True) -> Path:
        """The node's root filesystem: FSx (if mounted), HyperPod's resource config, the AMI's
        account files (kept across re-runs) and, if `slurm`, the role's running Slurm daemon."""
        root = self.root(node)
        (root / "opt/ml/config").mkdir(parents=True, exist_ok=True)
        (root / "opt/ml/config/resource_config.json").write_text(json.dumps(resource_config()))
        (root / "etc").mkdir(exist_ok=True)
        for name, text in BASE_ACCOUNTS.items():
            if not (root / "etc" / name).exists():
                (root / "etc" / name).write_text(text)
        # Ubuntu's sshd PAM stack (openssh-server's /etc/pam.d/sshd, its account part).
        (root / "etc/pam.d").mkdir(parents=True, exist_ok=True)
        if not (root / "etc/pam.d/sshd").exists():
            (root / "etc/pam.d/sshd").write_text(SSHD_PAM)
        # The AMI registers pyxis with Slurm (awsome-distributed-ai base-config
        # utils/install_enroot_pyxis.sh checks for exactly this line), daemon up or not.
        (root / "opt/slurm/etc").mkdir(parents=True, exist_ok=True)
        (root / "opt/slurm/etc/plugstack.conf").write_text("required /opt/slurm/lib/slurm/spank_pyxis.so\n")
        if slurm:
            self.start_daemon(node)
        self.fsx.mkdir(exist_ok=True)
        if fsx and not (root / "fsx").exists():
            (root / "fsx").symlink_to(self.fsx)
        return root

    def start_daemon(self, node: str) -> None:
        """What HyperPod does in Extended mode: the role's Slurm daemon runs (or, on the login
        node, slurmctld answers)."""
        units = self.root(node) / "run/standin-units"
        units.mkdir(parents=True, exist_ok=True)
        (units / f"{SLURM_DAEMON[NODES.get(node, ('gpu', ''))[0]]}.active").touch()

    def accounts(self, node: str, name: str = "passwd") -> list[list[str]]:
        """The node's /etc/passwd (or group) entries, split into fields."""
        return [line.split(":") for line in (self.root(node) / "etc" / name).read_text().splitlines()]

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
            LIFECYCLE_SLURM_WAIT_S="30", LIFECYCLE_SLURM_POLL_S="1",
            # The production wait for CloudWatch after a failure (60 s) has its own test.
            LIFECYCLE_FAILURE_LOG_WAIT_S="0",
        )
        env.update(overrides)
        return env

    def start(self, node: str, *, fsx: bool = True, slurm: bool = True, **overrides: str) -> subprocess.Popen:
        self.prepare(node, fsx=fsx, slurm=slurm)
        return subprocess.Popen(["bash", str(self.bundle / "on_init_complete.sh")], env=self.env(node, **overrides),
                                cwd=self.bundle, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, node: str, *, fsx: bool = True, slurm: bool = True, **overrides: str) -> subprocess.CompletedProcess:
        proc = self.start(node, fsx=fsx, slurm=slurm, **overrides)
        out, err = proc.communicate(timeout=240)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def log(self, node: str) -> str:
        return (self.root(node) / "var/log/provision/provisioning.log").read_text()

    def builds(self) -> list[str]:
        """Every 'building env' line in every node's log (one per env build started)."""
        return [line for node in NODES if (self.root(node) / "var/log/provision/provisioning.log").exists()
                for line in self.log(node).splitlines() if "building env" in line]
