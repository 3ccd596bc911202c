"""pyxis registered the configless way, against real Slurm daemons.

HyperPod's compute and login nodes run slurmd configless: it fetches slurm.conf and
plugstack.conf from the controller into <SlurmdSpoolDir>/conf-cache and has no config of its own
(awslabs/awsome-distributed-ai, 1.architectures/5.sagemaker-hyperpod/tools/devops-agent/docs/
hyperpod-mental-model.md). Here a private slurmctld (SlurmctldParameters=enable_configless) and a
slurmd started with --conf-server run on localhost; lifecycle_scripts/container_runtime.sh, in
the controller role, registers a pyxis plugin (tests/lifecycle/standin_pyxis, built for this
Slurm) in the controller's plugstack.conf and runs `scontrol reconfigure`; the node's cached
plugstack.conf must then carry it and the node's srun must offer --container-image. The way
AWS's reference registers pyxis, an include with a path, is shown not to reach the node.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm.conftest import (
    DAEMONS,
    SlurmCluster,
    _free_port,
    _node_hardware,
    _slurmd_version,
    _start,
    _wait_for,
    skip_unless_required,
)

pytestmark = [pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
STEP = REPO / "lifecycle_scripts" / "container_runtime.sh"
STANDINS = REPO / "tests" / "lifecycle"


def _slurm_conf(root: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    host = socket.gethostname().split(".")[0]  # slurmctld only runs on its SlurmctldHost
    # No PlugStackConfig: plugstack.conf next to slurm.conf (slurm.conf(5)), as on HyperPod.
    return f"""\
ClusterName=sanaconfigless
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldParameters=enable_configless
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge-run/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={host} {_node_hardware()} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def _build_pyxis_standin(root: Path) -> Path:
    """tests/lifecycle/standin_pyxis built and installed with its pyxis-like Makefile against
    this machine's Slurm version; returns the install prefix."""
    major, minor, micro = (int(p) for p in re.search(r"(\d+)\.(\d+)\.(\d+)", _slurmd_version()).groups())
    include = root / "include"
    shutil.copytree(STANDINS / "standin_slurm_include", include)
    (include / "slurm/slurm_version.h").write_text(
        f"#define SLURM_VERSION_NUMBER {(major << 16) | (minor << 8) | micro}u\n")
    src = root / "pyxis-src"
    shutil.copytree(STANDINS / "standin_pyxis", src)
    env = dict(os.environ, CPPFLAGS=f"-I {include}")
    prefix = root / "pyxis"
    for target in ([], ["install", f"prefix={prefix}"]):
        subprocess.run(["make", "-C", str(src), *target], env=env, check=True, capture_output=True)
    return prefix


@pytest.fixture
def configless() -> Iterator[tuple[SlurmCluster, Path, Path]]:
    """A controller (slurmctld, configless) and one configless slurmd; (cluster, controller's
    etc dir, the node's conf-cache)."""
    missing = [tool for tool in (*DAEMONS, "scontrol", "srun", "cc", "make", "unshare") if shutil.which(tool) is None]
    if missing:
        skip_unless_required(f"Slurm/munge/cc not installed ({', '.join(missing)} missing); run `make setup`")
    root = Path(tempfile.mkdtemp(prefix="sana-configless-"))
    root.chmod(0o755)
    node = f"cfgless{os.getpid()}"
    etc = root / "etc"
    for sub in ("etc", "state", "spool", "log", "run", "munge-run"):
        (root / sub).mkdir()
    conf = etc / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, _free_port(), _free_port()))
    cluster = SlurmCluster(root=root, conf=conf, node=node)
    try:
        key_dir = root / "munge-key"
        key_dir.mkdir(mode=0o700)
        (key_dir / "munge.key").write_bytes(os.urandom(1024))
        (key_dir / "munge.key").chmod(0o400)
        sock = root / "munge-run/munge.socket"
        _start(cluster, "munged", ["munged", "--foreground", f"--key-file={key_dir}/munge.key", f"--socket={sock}",
                                   f"--pid-file={root}/munge-run/munged.pid", f"--seed-file={key_dir}/munged.seed",
                                   f"--log-file={root}/log/munged.log"])
        _wait_for("munged socket", cluster, sock.exists)
        _start(cluster, "slurmctld", ["slurmctld", "-D", "-f", str(conf)])
        _wait_for("slurmctld", cluster, lambda: "UP" in cluster.run("scontrol", "ping", check=False))
        # configless_slurm.html: "launching slurmd with the --conf-server option". Before it
        # has the config, slurmd authenticates through munge's default socket, and it links
        # /run/slurm/conf to its cache: both in a private /run (its own mount namespace), so
        # nothing of this machine's /run is touched.
        ctld_port = re.search(r"SlurmctldPort=(\d+)", conf.read_text()).group(1)
        inside = (f"mount -t tmpfs tmpfs /run && mkdir /run/munge && ln -s {sock} /run/munge/munge.socket.2 && "
                  f"exec slurmd -D -N {node} --conf-server 127.0.0.1:{ctld_port}")
        _start(cluster, "slurmd", ["unshare", "--mount", "--propagation", "private", "sh", "-c", inside])
        cache = root / "spool/conf-cache"
        _wait_for("slurmd's configless cache", cluster, lambda: (cache / "slurm.conf").exists(), timeout=60)
    except Exception as exc:  # noqa: BLE001 - reported with the daemon logs
        cluster.stop()
        reason = f"configless Slurm did not start: {exc}\n{cluster.logs()}"
        shutil.rmtree(root, ignore_errors=True)
        skip_unless_required(reason)
    try:
        yield cluster, etc, cache
    finally:
        for proc in reversed(list(cluster.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def register(cluster: SlurmCluster, etc: Path, prefix: Path) -> subprocess.CompletedProcess:
    """The containers step in the controller role, with the controller's config in ``etc``."""
    env = cluster.env(SLURM_ETC=str(etc), PLATFORM_ROOT="", FSX=str(cluster.root), CFG_CLUSTER_GID="0", CFG_CLUSTER_USERS="ana:2001",
                      NODE_ROLE="controller", CFG_CONTAINER_RUNTIME="true", LIFECYCLE_PYXIS_PREFIX=str(prefix),
                      STEP_WARN_FILE=str(cluster.root / "warnings"))
    return subprocess.run(["bash", str(STEP)], env=env, capture_output=True, text=True, timeout=120)


def node_srun_help(cluster: SlurmCluster, cache: Path) -> str:
    """srun --help on the node, with the config slurmd cached (its PlugStackConfig default:
    plugstack.conf next to that slurm.conf)."""
    return subprocess.run(["srun", "--help"], env=cluster.env(SLURM_CONF=str(cache / "slurm.conf")),
                          capture_output=True, text=True, timeout=60).stdout


def wait_for_cache(cluster: SlurmCluster, cache: Path, text: str) -> str:
    deadline = time.monotonic() + 60
    while text not in (found := (cache / "plugstack.conf").read_text() if (cache / "plugstack.conf").exists() else ""):
        assert time.monotonic() < deadline, f"the node's conf-cache never got {text!r}:\n{cluster.logs()}"
        time.sleep(0.5)
    return found


def test_pyxis_registered_on_the_controller_reaches_a_configless_node(configless):
    cluster, etc, cache = configless
    prefix = _build_pyxis_standin(cluster.root)
    assert not (cache / "plugstack.conf").exists()
    assert "--container-image" not in node_srun_help(cluster, cache)

    done = register(cluster, etc, prefix)
    assert done.returncode == 0, done.stdout + done.stderr
    line = f"optional {prefix}/lib/slurm/spank_pyxis.so"
    assert (etc / "plugstack.conf").read_text().splitlines()[-1] == line
    assert "scontrol reconfigure: slurmctld sends the new plugstack.conf" in done.stdout
    # slurmctld sent it to the running slurmd (no restart), which cached it ...
    assert wait_for_cache(cluster, cache, line).splitlines()[-1] == line
    # ... and the node's srun loads pyxis from it.
    assert "--container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH" in node_srun_help(cluster, cache)
    # A second boot of the controller changes nothing.
    again = register(cluster, etc, prefix)
    assert again.returncode == 0 and "pyxis is already registered" in again.stdout
    assert (etc / "plugstack.conf").read_text().count("spank_pyxis.so") == 1


def test_an_include_with_a_path_never_reaches_the_configless_node(configless):
    """The reference's `include /opt/slurm/etc/plugstack.conf.d/pyxis.conf` (a path): configless
    ships plugstack.conf but not the included file, so the node's srun has no pyxis; the step
    says so instead of registering twice."""
    cluster, etc, cache = configless
    prefix = _build_pyxis_standin(cluster.root)
    (etc / "plugstack.conf.d").mkdir()
    (etc / "plugstack.conf.d/pyxis.conf").write_text(f"required {prefix}/lib/slurm/spank_pyxis.so\n")
    (etc / "plugstack.conf").write_text(f"include {etc}/plugstack.conf.d/pyxis.conf\n")
    cluster.run("scontrol", "reconfigure")
    wait_for_cache(cluster, cache, "include ")
    assert not (cache / "pyxis.conf").exists() and not (cache / "plugstack.conf.d").exists()
    # A compute node has no /opt/slurm/etc of its own; this host is both, so the controller's
    # copy of the included file is moved away while the "node" runs srun.
    (etc / "plugstack.conf.d").rename(cluster.root / "controller-only")
    assert "--container-image" not in node_srun_help(cluster, cache)
    (cluster.root / "controller-only").rename(etc / "plugstack.conf.d")
    done = register(cluster, etc, prefix)
    assert done.returncode == 0, done.stderr
    assert "which configless nodes never receive" in (cluster.root / "warnings").read_text()
