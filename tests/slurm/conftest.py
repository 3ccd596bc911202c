"""A real Slurm cluster of one node on localhost: munged, slurmctld and slurmd from Debian,
plus Slurm accounting (slurmdbd on a real MariaDB) where those are installed.

The job scripts are proven by submitting them to the same daemons the cluster runs, not by
reading them. Everything lives in a private temp dir (own munge key and socket, own ports,
state, spool, database and logs), so nothing touches a system Slurm, munge or MariaDB. The
container has no cgroups, so the config uses proctrack/linuxproc and task/none.

As on the cluster, jobs run as an unprivileged user: the fixture creates one (own group, home
in the temp dir; removed at the end) and `SlurmCluster.sbatch(..., user=cluster.user)` submits
as it with runuser. The node advertises `Gres=gpu:8` like a HyperPod GPU node, so a job
script's GPU request is checked by slurmctld and slurmd hands the GPUs to the job's steps
(CUDA_VISIBLE_DEVICES); gres.conf's "devices" are plain files, no GPU is behind them.

Binaries missing -> the tests skip and say `make setup`; binaries present but the daemons
do not come up -> skip with the daemon logs. SANA_REQUIRE_SLURM=1 (set by .ci/run) turns
both into failures, so the Slurm tests can never silently stop running in CI. MariaDB or
slurmdbd missing -> the cluster runs without accounting and only the sacct test skips (fails
under SANA_REQUIRE_SLURM).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
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
#: Slurm accounting (optional: without them the cluster runs with accounting_storage/none)
ACCOUNTING = ("mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "sacctmgr", "sacct")
#: GPUs the local node advertises as GRES, as a p5/p4d node does on HyperPod
GPUS_PER_NODE = 8
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
                plugstack: Path | None, dbd_port: int | None) -> str:
    plugstack_line = f"PlugStackConfig={plugstack}" if plugstack else "# no C compiler: no SPANK stub"
    if dbd_port is None:
        accounting = "AccountingStorageType=accounting_storage/none"
    else:
        # slurm.conf(5): AccountingStorageType=accounting_storage/slurmdbd, Host/Port = slurmdbd's.
        # AccountingStoragePass: the munge socket for slurmdbd traffic (default: the system one).
        accounting = (f"AccountingStorageType=accounting_storage/slurmdbd\n"
                      f"AccountingStorageHost=127.0.0.1\nAccountingStoragePort={dbd_port}\n"
                      f"AccountingStoragePass={root}/munge-run/munge.socket")
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
{accounting}
JobCompType=jobcomp/none
# HyperPod GPU nodes carry Gres=gpu:<n> (awslabs/awsome-distributed-ai,
# 1.architectures/5.sagemaker-hyperpod/tools/devops-agent/docs/hyperpod-mental-model.md,
# "Slurm auto-resume requeues ... on GRES nodes"); gres.conf next to this file gives the count.
GresTypes=gpu
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
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} {hardware} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN
PartitionName=gpu Nodes={node} Default=YES MaxTime=INFINITE State=UP
PartitionName=trn Nodes={node} MaxTime=INFINITE State=UP
"""


@dataclass
class JobUser:
    """The unprivileged account jobs run as (the cluster's `researcher`): name, ids, home."""

    name: str
    uid: int
    gid: int
    group: str
    home: Path
    #: created by this fixture (and so removed at the end), not a pre-existing account
    created: bool = False


@dataclass
class SlurmCluster:
    """Handle on the running daemons plus the client calls the tests need."""

    root: Path
    conf: Path
    node: str
    #: where the auto-resume SPANK stub records `srun --auto-resume` (None: stub not built)
    auto_resume_record: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    #: who the tests submit as (`sbatch(..., user=cluster.user)`); None until booted
    job_user: JobUser | None = None
    #: a second cluster user in the same group (the isolation tests' "user B"); None when the
    #: tests do not run as root (then there is only the one user they run as)
    other_user: JobUser | None = None
    #: True when slurmctld stores jobs in slurmdbd/MariaDB (then `sacct` works)
    accounting: bool = False
    #: why there is no accounting (the missing binaries), for the test that needs it
    no_accounting_reason: str = ""
    gpus_per_node: int = GPUS_PER_NODE

    @property
    def user(self) -> str | None:
        """The unprivileged user's name (None: no user could be created)."""
        return self.job_user.name if self.job_user else None

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        env.update(extra)
        return env

    def run(self, *argv: str, check: bool = True) -> str:
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=self.env(), timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def as_user(self, user: str | None, argv: list[str]) -> list[str]:
        """``argv`` run as ``user`` (runuser keeps the environment, as `sudo -E` would not by
        default); unchanged for None or when that is who we already are."""
        if user is None or user == pwd.getpwuid(os.getuid()).pw_name:
            return argv
        return ["runuser", "-u", user, "--", *argv]

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict[str, str],
               cwd: Path, user: str | None = None) -> int:
        """Submit like a researcher on the login node (as ``user``; default: this process's
        user, root in the container); returns the job id."""
        argv = self.as_user(user, ["sbatch", "--parsable", *options, str(script), *args])
        proc = subprocess.run(argv, capture_output=True, text=True, env=self.env(**env), cwd=cwd, timeout=60)
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
        """Until the controller has the node IDLE again with nothing allocated (a cancelled job
        leaves it COMPLETING for a moment).

        NOTE: read from ``scontrol show node`` (slurmctld's own node record: State, CPUAlloc),
        not ``sinfo %T``: under load, sinfo on Slurm 22.05 was seen reporting 'mixed' for
        minutes after a cancelled --gres job while scontrol had State=IDLE CPUAlloc=0 and
        squeue listed no job, and the next job started normally.
        """
        deadline = time.monotonic() + timeout
        record = ""
        while time.monotonic() < deadline:
            record = " ".join(self.run("scontrol", "show", "node", self.node, check=False).split())
            fields = dict(item.split("=", 1) for item in record.split() if "=" in item)
            if fields.get("State") == "IDLE" and fields.get("CPUAlloc") == "0":
                return
            time.sleep(0.5)
        jobs = self.run("squeue", "-h", "-o", "%i %j %u %T %M", check=False).strip()
        raise TimeoutError(f"node {self.node} not IDLE with nothing allocated after {timeout:.0f} s; "
                           f"jobs: {jobs or 'none'}; node: {record}")

    def sacct(self, *job_ids: int) -> dict[int, dict[str, str]]:
        """The accounting database's record of each job (allocations only, `sacct -X`):
        {job id: {"State": ..., "User": ..., "JobName": ..., "ExitCode": ...}}."""
        fields = ("JobID", "JobName", "User", "State", "ExitCode", "Submit")
        out = self.run("sacct", "-X", "-n", "-P", "--starttime=now-1days", "-o", ",".join(fields),
                       "-j", ",".join(map(str, job_ids)))
        rows = [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines() if line]
        # NOTE: slurmdbd keys a job record by (job id, submit time), so one id can have more
        # than one row. Seen twice here under load: besides the job's own row, a root row named
        # 'allocation' under the same id, newer or older than the real one: the name slurmdbd
        # gives a job record that reached it without a name (Slurm's
        # src/plugins/accounting_storage/mysql/as_mysql_job.c, `jname = xstrdup("allocation")`).
        # The job this controller ran is the row that carries a name; among several named rows
        # (an id reused), the newest submission.
        chosen: dict[int, dict[str, str]] = {}
        for row in sorted(rows, key=lambda r: (r["JobName"] != "allocation", r["Submit"])):
            chosen[int(row.pop("JobID"))] = row
            row.pop("Submit")
        return chosen

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
        # Reverse start order: slurmd, slurmctld, slurmdbd, mariadbd, then munged; each by the
        # PID we started.
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


def install_package(platform_dir: Path, *, name: str | None = None, src: Path = REPO / "training",
                    owner_uid: int = 0) -> Path:
    """Install ``src`` (the training package) at <platform_dir>/<name>/training the way
    lifecycle_scripts/install_package.sh does on the cluster: root-owned, u+rwX,go+rX,go-w,
    so a job running as a user cannot write into it. ``name`` defaults to a content hash of
    the tree (the cluster's is stacks/cluster.py package_hash). Returns <platform_dir>/<name>."""
    files = sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if name is None:
        digest = hashlib.sha256()
        for path in files:
            digest.update(str(path.relative_to(src)).encode() + b"\0" + path.read_bytes())
        name = digest.hexdigest()[:12]
    dest = platform_dir / name
    shutil.copytree(src, dest / "training", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [dest, *dest.rglob("*")]:
        mode = path.stat().st_mode
        keep_x = stat.S_IXUSR if path.is_dir() or mode & stat.S_IXUSR else 0
        path.chmod(0o644 | (0o111 if keep_x else 0))
        if os.getuid() == 0:
            os.chown(path, owner_uid, 0, follow_symlinks=False)
    platform_dir.chmod(0o755)
    return dest


def point_current(platform_dir: Path, name: str) -> None:
    """Swap <platform_dir>/current to ``name`` atomically (rename over the old link), as
    lifecycle_scripts/common.sh point_link does."""
    tmp = platform_dir / f".current.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name)
    tmp.replace(platform_dir / "current")


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


def _create_job_user(root: Path) -> JobUser:
    """An unprivileged account for the jobs: created (own group, home under ``root``) when we
    are root; otherwise we already are one, and the jobs run as us."""
    me = pwd.getpwuid(os.getuid())
    if os.getuid() != 0 or shutil.which("useradd") is None:
        return JobUser(name=me.pw_name, uid=me.pw_uid, gid=me.pw_gid, group=str(me.pw_gid), home=Path(me.pw_dir))
    # Per session (pid): two sessions may share the machine, and each removes its own user.
    name = f"sanajob{os.getpid()}"
    home = root / "home" / name
    home.parent.mkdir(mode=0o755)
    subprocess.run(["groupadd", name], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "--gid", name, "--home-dir", str(home), "--create-home",
                        "--shell", "/bin/bash", name], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        subprocess.run(["groupdel", name], capture_output=True)
        raise
    entry = pwd.getpwnam(name)
    return JobUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, group=name, home=home, created=True)


def _create_other_user(first: JobUser) -> JobUser | None:
    """A second account in the first one's group, as two researchers share the cluster group."""
    if not first.created:
        return None
    name = f"{first.name}b"
    home = first.home.parent / name
    subprocess.run(["useradd", "--gid", first.group, "--home-dir", str(home), "--create-home",
                    "--shell", "/bin/bash", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    return JobUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, group=first.group, home=home, created=True)


def _remove_job_user(user: JobUser | None) -> None:
    if user is None or not user.created:
        return
    subprocess.run(["userdel", user.name], capture_output=True)
    subprocess.run(["groupdel", user.group], capture_output=True)  # refused while another member remains


def _prepare_accounting(root: Path) -> tuple[int | None, str]:
    """Ports for slurmdbd (None: accounting off) and, when off, why."""
    missing = [tool for tool in ACCOUNTING if shutil.which(tool) is None]
    if missing:
        return None, (f"Slurm accounting not installed ({', '.join(missing)} missing); "
                      "run `make setup` (scripts/install-system-packages.sh installs mariadb-server and slurmdbd)")
    return _free_port(), ""


def _boot_mariadb(cluster: SlurmCluster, *, port: int) -> None:
    """A private MariaDB on 127.0.0.1:<port> (own datadir and socket), run as the `mysql`
    system account where it exists (mariadbd drops root itself with --user), with the
    database user slurmdbd logs in as."""
    root = cluster.root
    data, run = root / "mariadb" / "data", root / "mariadb" / "run"
    for sub in (data, run):
        sub.mkdir(parents=True)
    (root / "mariadb").chmod(0o755)
    error_log = root / "log" / "mariadbd.log"  # with the other daemons' logs (cluster.logs())
    error_log.touch()
    try:
        account = pwd.getpwnam("mysql").pw_name if os.getuid() == 0 else pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        account = "root"
    for path in (data, run, error_log):
        shutil.chown(path, user=account)
    common = ["--no-defaults", f"--datadir={data}", f"--user={account}"]
    install = subprocess.run(["mariadb-install-db", *common, "--auth-root-authentication-method=socket",
                              "--skip-test-db", "--skip-name-resolve"],
                             capture_output=True, text=True, timeout=120)
    if install.returncode != 0:
        raise RuntimeError(f"mariadb-install-db failed: {install.stdout[-2000:]}{install.stderr[-2000:]}")
    sock = run / "mysqld.sock"
    # Small buffers and no binlog: a test database of a few rows, started once per session.
    _start(cluster, "mariadbd", ["mariadbd", *common, f"--socket={sock}", f"--port={port}",
                                 "--bind-address=127.0.0.1", "--skip-name-resolve", "--skip-log-bin",
                                 f"--pid-file={run}/mariadbd.pid", f"--log-error={error_log}",
                                 "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M"])
    _wait_for("mariadbd socket", cluster, sock.exists, timeout=60)
    password = secrets.token_hex(16)
    # slurmdbd connects over TCP (StorageHost=127.0.0.1); root gets in over the socket as the
    # OS root (unix_socket authentication), so no root password exists anywhere.
    sql = (f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}';"
           "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")
    client = ["mariadb", "--no-defaults", f"--socket={sock}", "-u", "root", "-e", sql]
    grant = subprocess.run(client, capture_output=True, text=True, timeout=60)
    if grant.returncode != 0:
        raise RuntimeError(f"cannot create the slurmdbd database user: {grant.stderr.strip()}")
    (root / "mariadb" / "password").write_text(password)


def _boot_slurmdbd(cluster: SlurmCluster, *, dbd_port: int, db_port: int) -> None:
    root = cluster.root
    conf = root / "slurmdbd.conf"
    # slurmdbd.conf(5): readable by SlurmUser only (it holds StoragePass); slurmdbd refuses
    # a file others can read.
    conf.write_text(f"""\
AuthType=auth/munge
AuthInfo=socket={root}/munge-run/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser={pwd.getpwuid(os.getuid()).pw_name}
LogFile={root}/log/slurmdbd.log
PidFile={root}/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=slurm
StoragePass={(root / "mariadb" / "password").read_text()}
StorageLoc=slurm_acct_db
""")
    conf.chmod(0o600)
    # slurmdbd has no -f: it reads slurmdbd.conf from the directory of $SLURM_CONF.
    _start(cluster, "slurmdbd", ["slurmdbd", "-D", "-vv"])

    def dbd_up() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", dbd_port)) == 0
    _wait_for("slurmdbd", cluster, dbd_up, timeout=90)  # it creates its tables first
    # slurmctld registers with slurmdbd under ClusterName; the cluster must exist there.
    add = subprocess.run(["sacctmgr", "-i", "add", "cluster", "sanatest"], capture_output=True, text=True,
                         env=cluster.env(), timeout=60)
    if add.returncode != 0 and "already exists" not in add.stdout + add.stderr:
        raise RuntimeError(f"sacctmgr add cluster failed: {add.stdout}{add.stderr}")


def _boot(cluster: SlurmCluster, *, dbd_port: int | None) -> None:
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

    if dbd_port is not None:
        db_port = _free_port()
        _boot_mariadb(cluster, port=db_port)
        _boot_slurmdbd(cluster, dbd_port=dbd_port, db_port=db_port)

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
    # and pytest's base dir is 0700 (the job user could not reach it either).
    root = Path(tempfile.mkdtemp(prefix="sana-slurm-"))
    root.chmod(0o755)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    plugstack = _build_auto_resume_stub(root)
    dbd_port, no_accounting = _prepare_accounting(root)
    conf.write_text(_slurm_conf(root, node=node, hardware=_node_hardware(), ctld_port=_free_port(),
                                slurmd_port=_free_port(), plugstack=plugstack, dbd_port=dbd_port))
    # gres.conf(5), next to slurm.conf. slurmd drops a GPU without File ("Removing file-less
    # GPU"), so each GPU is a plain file standing for /dev/nvidiaN: no device behind it, but
    # Slurm allocates them per job and step and sets CUDA_VISIBLE_DEVICES as on a GPU node.
    devices = root / "dev"
    devices.mkdir()
    for index in range(GPUS_PER_NODE):
        (devices / f"nvidia{index}").touch()
    (root / "gres.conf").write_text(f"NodeName={node} Name=gpu File={devices}/nvidia[0-{GPUS_PER_NODE - 1}]\n")
    cluster = SlurmCluster(root=root, conf=conf, node=node,
                           auto_resume_record=root / "auto-resume.record" if plugstack else None,
                           accounting=dbd_port is not None, no_accounting_reason=no_accounting)
    try:
        cluster.job_user = _create_job_user(root)
        cluster.other_user = _create_other_user(cluster.job_user)
        if cluster.auto_resume_record is not None:
            # The stub appends from inside the job's tasks, i.e. as the job's user.
            cluster.auto_resume_record.touch()
            cluster.auto_resume_record.chmod(0o666)
        _boot(cluster, dbd_port=dbd_port)
    except Exception as exc:  # noqa: BLE001 - reported with the daemon logs
        cluster.stop()
        _remove_job_user(cluster.other_user)
        _remove_job_user(cluster.job_user)
        reason = f"Slurm daemons did not start: {exc}\n{cluster.logs()}"
        shutil.rmtree(root, ignore_errors=True)
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
        _remove_job_user(cluster.other_user)
        _remove_job_user(cluster.job_user)
        shutil.rmtree(root, ignore_errors=True)
