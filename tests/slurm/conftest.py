"""A real Slurm cluster of one node on localhost: munged, slurmctld and slurmd from Debian.

The job scripts are proven by submitting them to the same daemons the cluster runs, not by
reading them. Everything lives in a private temp dir (own munge key and socket, own ports,
state, spool and logs), so nothing touches a system Slurm or munge. The container has no
cgroups, so the config uses proctrack/linuxproc and task/none.

Binaries missing -> the tests skip and say `make setup`; binaries present but the daemons
do not come up -> skip with the daemon logs. SANA_REQUIRE_SLURM=1 (set by .ci/run) turns
both into failures, so the Slurm tests can never silently stop running in CI.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "training" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node_hardware() -> str:
    """This machine as slurmd sees it (`slurmd -C`): CPUs, sockets, cores, threads, memory.

    Using slurmd's own numbers keeps the node from being drained for a config/hardware
    mismatch on any machine the tests run on.
    """
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    first = out.splitlines()[0]
    return " ".join(word for word in first.split() if not word.startswith("NodeName="))


def _build_auto_resume_stub(root: Path) -> Path | None:
    """Compile the stand-in for HyperPod's `srun --auto-resume` SPANK plugin; returns the
    plugstack.conf that loads it, or None without a C compiler (that one test then skips)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    major, minor, micro = (int(part) for part in
                           re.search(r"(\d+)\.(\d+)\.(\d+)", _slurmd_version()).groups())
    plugin = root / "spank" / "auto_resume_stub.so"
    plugin.parent.mkdir()
    build = subprocess.run([compiler, "-shared", "-fPIC", "-O2",
                            f"-DSLURM_VERSION_NUMBER={(major << 16) | (minor << 8) | micro}u",
                            "-o", str(plugin), str(Path(__file__).with_name("auto_resume_stub.c"))],
                           capture_output=True, text=True)
    if build.returncode != 0:
        return None
    plugstack = root / "plugstack.conf"
    plugstack.write_text(f"required {plugin} {root / 'auto-resume.record'}\n")
    return plugstack


def _slurmd_version() -> str:
    return subprocess.run(["slurmd", "-V"], capture_output=True, text=True, check=True).stdout


def _slurm_conf(root: Path, *, node: str, hardware: str, ctld_port: int, slurmd_port: int,
                plugstack: Path | None) -> str:
    plugstack_line = f"PlugStackConfig={plugstack}" if plugstack else "# no C compiler: no SPANK stub"
    return f"""\
ClusterName=sanatest
{plugstack_line}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
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
# A container: no cgroups, so track processes through /proc and bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# builtin schedules on submit and on every job end (backfill would add its 30 s cycle).
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=5
InactiveLimit=0
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} {hardware} State=UNKNOWN
PartitionName=gpu Nodes={node} Default=YES MaxTime=INFINITE State=UP
PartitionName=trn Nodes={node} MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """Handle on the running daemons plus the client calls the tests need."""

    root: Path
    conf: Path
    node: str
    #: where the auto-resume SPANK stub records `srun --auto-resume` (None: stub not built)
    auto_resume_record: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.update(extra)
        return env

    def run(self, *argv: str, check: bool = True) -> str:
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=self.env(), timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict[str, str],
               cwd: Path) -> int:
        """Submit like a researcher on the login node; returns the job id."""
        proc = subprocess.run(["sbatch", "--parsable", *options, str(script), *args],
                              capture_output=True, text=True, env=self.env(**env), cwd=cwd, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {script.name} failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, StdOut, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def squeue_state(self, job_id: int) -> str:
        return self.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).strip()

    def wait(self, job_id: int, *, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return info
            if time.monotonic() > deadline:
                self.run("scancel", str(job_id), check=False)
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s")
            time.sleep(0.5)

    def wait_node_idle(self, *, timeout: float) -> None:
        """Until the node is IDLE again (a cancelled job leaves it COMPLETING for a moment)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False).strip()
            if state.startswith("idle"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"node {self.node} is '{state}', not idle, after {timeout:.0f} s")

    def logs(self) -> str:
        parts = []
        for name in sorted((self.root / "log").glob("*")):
            text = name.read_text(errors="replace").splitlines()[-40:]
            parts.append(f"--- {name.name} (last 40 lines)\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        # A job a failed test left running would outlive slurmd (slurmstepd is its own
        # process): cancel everything in this private cluster first and let the node drain.
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                with contextlib.suppress(TimeoutError):
                    self.wait_node_idle(timeout=60)
        # Reverse start order: slurmd, slurmctld, then munged; each by the PID we started.
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


def _start(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    log = open(cluster.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - owned by the process
    cluster.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                           env=cluster.env(), start_new_session=True)
    log.close()


def _wait_for(what: str, cluster: SlurmCluster, ready, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.3)


def _boot(cluster: SlurmCluster) -> None:
    root = cluster.root
    munge_key_dir, munge_run = root / "munge-key", root / "munge-run"
    for sub in ("state", "spool", "log", "run"):
        (root / sub).mkdir()
    # munged refuses a key readable by others and a socket dir others cannot traverse.
    munge_key_dir.mkdir(mode=0o700)
    munge_run.mkdir(mode=0o755)
    key = munge_key_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = munge_run / "munge.socket"
    _start(cluster, "munged", [
        "munged", "--foreground", f"--key-file={key}", f"--socket={socket_path}",
        f"--pid-file={munge_run}/munged.pid", f"--seed-file={munge_key_dir}/munged.seed",
        f"--log-file={root}/log/munged.log"])
    _wait_for("munged socket", cluster, socket_path.exists)

    _start(cluster, "slurmctld", ["slurmctld", "-D", "-vv", "-f", str(cluster.conf)])
    _wait_for("slurmctld", cluster,
              lambda: subprocess.run(["scontrol", "ping"], env=cluster.env(), capture_output=True,
                                     text=True).stdout.count("UP") > 0)
    _start(cluster, "slurmd", ["slurmd", "-D", "-vv", "-f", str(cluster.conf), "-N", cluster.node])
    _wait_for("node idle", cluster,
              lambda: cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%T", check=False)
              .strip() == "idle")


def skip_unless_required(reason: str) -> None:
    """Skip locally; fail where SANA_REQUIRE_SLURM=1 (CI, whose `make test` installs everything)."""
    if os.environ.get("SANA_REQUIRE_SLURM") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]
    if missing:
        reason = f"Slurm/munge not installed ({', '.join(missing)} missing); run `make setup`"
        skip_unless_required(reason)
    # Not pytest's tmp_path: munged needs every directory above its socket to be traversable,
    # and pytest's base dir is 0700.
    root = Path(tempfile.mkdtemp(prefix="sana-slurm-"))
    root.chmod(0o755)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    plugstack = _build_auto_resume_stub(root)
    conf.write_text(_slurm_conf(root, node=node, hardware=_node_hardware(), ctld_port=_free_port(),
                                slurmd_port=_free_port(), plugstack=plugstack))
    cluster = SlurmCluster(root=root, conf=conf, node=node,
                           auto_resume_record=root / "auto-resume.record" if plugstack else None)
    try:
        _boot(cluster)
    except Exception as exc:  # noqa: BLE001 - reported with the daemon logs
        cluster.stop()
        reason = f"Slurm daemons did not start: {exc}\n{cluster.logs()}"
        skip_unless_required(reason)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        yield cluster
    finally:
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
