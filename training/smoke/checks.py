"""One function per smoke check, each returning a :class:`~training.smoke.Row`.

The checks that need the cluster's tools take their input as text or paths where they can
(``*_row`` functions), so the verdicts are tested on captured output; the thin wrappers
around them run the real command (sinfo, scontrol, sbatch, S3, flock).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from training.smoke import FAIL, PASS, SKIP, WARN, Row
from training.smoke.allreduce import MARKER as ALLREDUCE_MARKER
from training.smoke.parse import (
    NEURON_ONLY,
    SINFO_FORMAT,
    NodeState,
    nccl_network,
    neuron_pins,
    parse_sinfo,
    read_status_dir,
    version_skew,
)

VERSIONS_MARKER = "SMOKE_VERSIONS"


@dataclass(frozen=True)
class SmokeConfig:
    """Where the smoke job looks and what it submits (defaults: the node profile's values)."""

    package_root: Path
    fsx: Path
    log_dir: Path
    artefacts_bucket: str
    cluster: str
    gpu_env: Path
    neuron_env: Path
    gpu_partition: str = "gpu"
    trn_partition: str = "trn"
    #: sbatch options for the GPU job's GPUs: HyperPod GPU nodes carry Gres=gpu:<n> and
    #: constrain devices, so a step sees only the GPUs its job asked for (the same request as
    #: training/slurm/train-gpu.sbatch, which cites the sources); 8 = p5/p4d
    gpu_sbatch_args: tuple[str, ...] = ("--gres=gpu:8",)
    #: the CPU path used by the tests: gloo all-reduce of 2 processes on 1 node, trn_smoke on
    #: PJRT CPU, no Lustre and no Neuron host packages required
    local: bool = False
    job_timeout_s: float = 1800.0
    #: partitions the operator declared one-node (SANA_SMOKE_SINGLE_NODE): their network row
    #: checks the one node and says that the cross-node path (EFA) was not proven; any other
    #: partition with fewer than 2 usable nodes FAILs its row
    single_node: frozenset[str] = frozenset()


def _run(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- Slurm

def slurm_nodes() -> list[NodeState]:
    proc = _run(["sinfo", "--Node", "--noheader", f"--format={SINFO_FORMAT}"])
    if proc.returncode != 0:
        raise RuntimeError(f"sinfo failed ({proc.returncode}): {proc.stderr.strip()}")
    return parse_sinfo(proc.stdout)


def slurm_row(nodes: list[NodeState]) -> Row:
    """Partitions and node states: any down/drained/failed/not-responding node is a FAIL."""
    if not nodes:
        return Row("slurm-nodes", FAIL, "sinfo lists no nodes: HyperPod has not registered any compute "
                   "node with slurmctld; see each node's status file and runbooks/node-boot.md")
    bad = [n for n in nodes if not n.usable]
    parts: dict[str, list[NodeState]] = {}
    for n in nodes:
        parts.setdefault(n.partition, []).append(n)
    summary = ", ".join(f"{p}: {len(ns)} node(s)" for p, ns in sorted(parts.items()))
    if bad:
        names = "; ".join(f"{n.node} ({n.partition}) {n.state}" + (f" reason '{n.reason}'" if n.reason else "")
                          for n in bad)
        return Row("slurm-nodes", FAIL, f"unusable node(s): {names}; fix or replace them "
                   "(runbooks/deploy.md, 'slurm-nodes FAIL')")
    return Row("slurm-nodes", PASS, f"{summary}; all usable")


def node_addresses() -> dict[str, set[str]]:
    """Slurm node name -> the names and address a status file may carry (scontrol show node)."""
    proc = _run(["scontrol", "show", "node", "--oneliner"])
    if proc.returncode != 0:
        raise RuntimeError(f"scontrol show node failed: {proc.stderr.strip()}")
    nodes = {}
    for line in proc.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" in fields:
            nodes[fields["NodeName"]] = {v for k, v in fields.items()
                                         if k in ("NodeName", "NodeAddr", "NodeHostName") and v}
    return nodes


def node_status_row(status_dir: Path, nodes: dict[str, set[str]]) -> Row:
    """Every node's lifecycle status: a FAILED file (any node, controller and login too) is a
    FAIL quoting its step and cause, so is a node still PENDING (its late check never saw
    Slurm up); a Slurm node with no READY file is a FAIL."""
    if not status_dir.is_dir():
        return Row("node-status", FAIL, f"{status_dir} does not exist: the lifecycle scripts never ran "
                   "their readiness step on FSx (runbooks/node-boot.md)")
    statuses = read_status_dir(status_dir)
    problems = []
    for s in statuses:
        if s.verdict == "FAILED":
            problems.append(f"{s.node} FAILED at step {s.fields.get('step', '?')}: "
                            f"{s.fields.get('cause', 'no cause recorded')}")
        elif s.verdict == "PENDING":
            problems.append(f"{s.node} PENDING: provisioned, but sana-node-ready.service has not recorded its Slurm "
                            f"daemon up ({s.fields.get('cause') or s.fields.get('slurm', '?')}); "
                            "`systemctl status sana-node-ready` on it")
        elif s.verdict == "INVALID":
            problems.append(f"{s.path} is not a status file: {s.line[:80]!r}")
    ready = {key for s in statuses if s.verdict == "READY"
             for key in (s.fields.get("node"), s.fields.get("ip")) if key}
    missing = sorted(n for n, keys in nodes.items() if not keys & ready)
    if missing:
        problems.append(f"no READY status for Slurm node(s) {', '.join(missing)} in {status_dir}")
    if problems:
        return Row("node-status", FAIL, "; ".join(problems))
    return Row("node-status", PASS, f"{sum(s.verdict == 'READY' for s in statuses)} node(s) READY "
               f"({len(nodes)} Slurm node(s) matched)")


def node_warning_rows(status_dir: Path) -> list[Row]:
    """One WARN row per optional part a node's status file says does not work there (its
    container runtime, the accounting associations): the job passes, the operator sees it."""
    if not status_dir.is_dir():
        return []
    return [Row("node-warning", WARN, f"{s.node} {part}: {cause}")
            for s in read_status_dir(status_dir) for part, cause in s.warnings]


# --------------------------------------------------------------------------- FSx

def _mount_of(path: Path, mounts: str) -> tuple[str, str, str] | None:
    """(mount point, fstype, options) of the longest /proc/mounts entry containing ``path``;
    of several at the same point the last, which is mounted over the others and is what the
    path resolves to (an automount: systemd's autofs line, then the lustre one; AWS's
    mount_fsx.sh mounts FSx with x-systemd.automount)."""
    best = None
    target = str(path.resolve())
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and \
                (best is None or len(point) >= len(best[0])):
            best = (point, fields[2], fields[3])
    return best


_HOLDER = """
import fcntl, sys, time
with open(sys.argv[1], "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.readline()
"""


def flock_contends(lock: Path, timeout_s: float = 30.0) -> str | None:
    """Two processes on one lock file: a holder takes LOCK_EX; this process must then be
    refused (EWOULDBLOCK) and get the lock once the holder lets go. None, or what failed."""
    import fcntl

    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = holder.stdout.readline() if holder.stdout else ""
        if line.strip() != "locked":
            return f"the holder process could not lock {lock}"
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return f"flock on {lock} granted to two processes at once (flock is a no-op here)"
            except BlockingIOError:
                pass
            holder.communicate("release\n", timeout=timeout_s)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return f"flock on {lock} still held {timeout_s:.0f}s after its holder exited"
                    time.sleep(0.1)
            fcntl.flock(f, fcntl.LOCK_UN)
        return None
    except OSError as exc:
        return f"flock on {lock} failed: {exc}"
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=10)


def fsx_row(fsx: Path, log_dir: Path, *, require_lustre: bool = True, mounts: str | None = None) -> Row:
    """FSx for Lustre mounted at ``fsx`` with the `flock` option, and flock really excludes."""
    if mounts is None:
        mounts = Path("/proc/mounts").read_text()
    mount = _mount_of(fsx, mounts)
    where = f"{mount[0]} ({mount[1]}, {mount[2]})" if mount else "no mount"
    if require_lustre:
        if not mount or mount[1] != "lustre" or mount[0] != str(fsx):
            return Row("fsx", FAIL, f"{fsx} is not an FSx for Lustre mount (found {where}); check the "
                       "instance group's FsxLustreConfig and the fsx step of the node's status")
        options = mount[2].split(",")
        # mount.lustre(8): cluster-wide flock needs `flock`; `localflock` locks per node only.
        if "flock" not in options:
            return Row("fsx", FAIL, f"{fsx} is mounted without the flock option ({mount[2]}): "
                       "locks are node-local or refused; remount with -o flock")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return Row("fsx", FAIL, f"cannot create {log_dir} ({exc.strerror}); check the group write "
                   "permission on the FSx log dir (cluster group, mode 2775)")
    problem = flock_contends(log_dir / "smoke.lock")
    if problem:
        return Row("fsx", FAIL, problem)
    return Row("fsx", PASS, f"{where}; flock excludes a second process")


# --------------------------------------------------------------------------- instance metadata

IMDS_HOST = "169.254.169.254"


def imds_row(host: str = IMDS_HOST, port: int = 80, timeout_s: float = 2.0, *, local: bool = False) -> Row:
    """A job's user must not reach the instance metadata service (the node's credentials):
    lifecycle_scripts/imds_block.sh rejects every uid but root and system services, so a
    connection from this job is refused at once. Connected = the block is missing; no answer
    at all = not an EC2 node. The local path (tests) has no provisioned node to check."""
    if local:
        return Row("imds", SKIP, "local path: no node provisioned by the lifecycle here "
                   "(tests/lifecycle/test_imds_block.py checks its rules)")
    uid = os.getuid()
    if uid == 0:
        return Row("imds", SKIP, "this job runs as root, which keeps the instance metadata service; "
                   "submit the smoke job as a cluster user to check the block")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return Row("imds", PASS, f"uid {uid} is refused by the instance metadata service at {host} "
                   "(no node credentials in jobs)")
    except OSError as exc:
        return Row("imds", SKIP, f"no instance metadata service answers at {host} ({exc.strerror or exc}): "
                   "not an EC2 node")
    return Row("imds", FAIL, f"uid {uid} reached the instance metadata service at {host}: the node's imds "
               "step did not run or its rules are gone (`sudo iptables -S SANA-IMDS` on the node; re-run "
               "the lifecycle there)")


# --------------------------------------------------------------------------- S3

def s3_row(bucket: str, key: str) -> Row:
    """Write, read back and delete one probe object with the node's credentials (the
    HyperPod execution role on the cluster, through the instance metadata)."""
    from training import s3
    from training.errors import UserError

    if not bucket:
        return Row("s3", FAIL, "SANA_ARTEFACTS_BUCKET is not set: the node profile "
                   "(/etc/profile.d/sana-platform.sh) lacks it; re-provision or export it")
    url = f"s3://{bucket}/{key}"
    body = f"sana smoke {uuid.uuid4().hex}\n".encode()
    import boto3

    if boto3.session.Session().get_credentials() is None:  # the default chain, IMDS last
        # By design on the cluster: a cluster user's job has no AWS credentials (imds_block.sh);
        # the data reaches jobs through FSx. The node role's S3 path is root's to check.
        return Row("s3", SKIP, "this job has no AWS credentials (by design: jobs read and write S3 through "
                   "FSx); submit the smoke job as root to check S3 with the node role")
    client = s3.client(max_attempts=3)
    try:
        s3.put_bytes(body, url, s3=client)
        back = s3.get_bytes(url, s3=client)
        client.delete_object(Bucket=bucket, Key=key)
    except UserError as exc:
        return Row("s3", FAIL, str(exc))
    except Exception as exc:  # noqa: BLE001 - every S3 error is one line in the table
        return Row("s3", FAIL, f"{url}: {type(exc).__name__}: {exc}")
    if back != body:
        return Row("s3", FAIL, f"{url}: read back {len(back)} bytes that differ from the {len(body)} written")
    return Row("s3", PASS, f"wrote, read back and deleted {url}")


# --------------------------------------------------------------------------- 2-node jobs

def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This job's environment without its own Slurm variables (an sbatch inside a job would
    otherwise hand them on as input options), plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) or k == "SLURM_CONF"}
    env.update(extra)
    return env


def usable_nodes(nodes: list[NodeState], partition: str) -> list[str]:
    return sorted({n.node for n in nodes if n.partition == partition and n.usable})


#: The instance-group count that sizes each accelerator partition (cdk.json).
COUNT_KEY = {"gpu": "gpuInstanceCount", "trn": "trnInstanceCount"}


def network_nodes(cfg: SmokeConfig, nodes: list[NodeState], kind: str) -> int | str:
    """How many nodes the ``kind`` (gpu|trn) network check runs on, or why it does not run:
    ``"SKIP: <detail>"`` for a partition the cluster does not have (its group is not deployed),
    ``"FAIL: <detail>"`` for one with fewer usable nodes than the check needs. A one-node
    partition is a FAIL unless the operator declared it (SANA_SMOKE_SINGLE_NODE): the default
    deployment has one node per accelerator group, and a SKIP would let a cluster whose EFA was
    never exercised pass (runbooks/deploy.md, step 8)."""
    partition = cfg.gpu_partition if kind == "gpu" else cfg.trn_partition
    if not any(n.partition == partition for n in nodes):
        return f"SKIP: no partition {partition} in sinfo (no {kind} group: {COUNT_KEY[kind]}=0)"
    usable = len(usable_nodes(nodes, partition))
    if cfg.local:
        return 1 if usable else f"FAIL: partition {partition} has no usable node; see the slurm-nodes row"
    if usable >= 2:
        return 2
    if usable == 1 and partition in cfg.single_node:
        return 1
    if usable == 1:
        return (f"FAIL: partition {partition} has 1 usable node; the cross-node (EFA) check needs 2: scale "
                f"{COUNT_KEY[kind]} to 2, or declare the one-node partition with SANA_SMOKE_SINGLE_NODE={partition} "
                "(the row then checks that node alone and says EFA was not proven)")
    return f"FAIL: partition {partition} has no usable node; see the slurm-nodes row"


def node_share(nodes: list[NodeState], partition: str) -> tuple[str, ...]:
    """sbatch options for a 2-node job that takes (nearly) whole nodes WITHOUT --exclusive:
    this coordinator holds one CPU (a core) and 2 GiB on one node of some partition, and an
    exclusive job could then never start on a 2-node partition. So: every CPU but one core's
    worth (2 threads) and all memory but 4 GiB of the partition's smallest node; torchrun's
    workers (and NCCL's proxy threads) then get the CPUs they need."""
    part = [n for n in nodes if n.partition == partition and n.usable]
    cpus = min((n.cpus for n in part if n.cpus), default=0)
    memory = min((n.memory_mb for n in part if n.memory_mb), default=0)
    args = []
    if cpus:
        args.append(f"--cpus-per-task={max(1, cpus - 2)}")
    if memory:
        args.append(f"--mem={max(1024, memory - 4096)}M")
    return tuple(args)


def submit_and_wait(cfg: SmokeConfig, name: str, partition: str, n_nodes: int, node_argv: list[str],
                    extra_args: tuple[str, ...] = ()) -> tuple[int | None, str, str]:
    """sbatch --wait one job of ``n_nodes`` running ``node_argv`` once per node; returns
    (exit code or None on timeout, its output text, the output path)."""
    out = cfg.log_dir / f"{name}-%j.out"
    step = " ".join(shlex.quote(a) for a in node_argv)
    # Named after this smoke job (its log dir smoke-<id>), so a timeout cancels exactly it.
    job_name = f"{cfg.log_dir.name}-{name}"
    argv = ["sbatch", "--wait", "--parsable", f"--job-name={job_name}", f"--partition={partition}",
            f"--nodes={n_nodes}", "--ntasks-per-node=1", "--time=30", f"--output={out}", "--open-mode=append",
            *extra_args, f"--wrap=srun --kill-on-bad-exit=1 {step}"]
    env = _clean_env({"PYTHONPATH": str(cfg.package_root)})
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=cfg.job_timeout_s)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={job_name}"], capture_output=True, env=env)
        return None, "", str(out)
    job_id = proc.stdout.strip().split(";")[0]
    path = Path(str(out).replace("%j", job_id)) if job_id else None
    text = path.read_text(errors="replace") if path and path.exists() else proc.stderr
    return proc.returncode, text, str(path or out)


def _python_for(env_dir: Path) -> str:
    return str(env_dir / "bin" / "python")


def gpu_allreduce_row(code: int | None, output: str, where: str, *, local: bool, single_node: bool = False) -> Row:
    """Verdict of the GPU job from its output: the all-reduce result line and, on the
    cluster, NCCL's proof that the EFA/OFI plugin carried it (``single_node``: a declared
    one-node partition, where there is no cross-node path to prove)."""
    name = "gpu-allreduce"
    if code is None:
        return Row(name, FAIL, f"the GPU job did not finish in time (queue busy or hung); see {where}")
    results = [json.loads(line.split(ALLREDUCE_MARKER, 1)[1]) for line in output.splitlines()
               if ALLREDUCE_MARKER + " " in line]
    if code != 0 or not results:
        tail = next((ln.strip() for ln in reversed(output.splitlines()) if ln.strip()), "no output")
        return Row(name, FAIL, f"GPU job exited {code}: {tail[:160]}; see {where}")
    res = results[-1]
    size = f"{res['world_size']} ranks on {len(res['nodes'])} node(s)"
    bw = f"busbw {res['busbw_gbps']:.1f} GB/s (algbw {res['algbw_gbps']:.1f}, {res['bytes'] / 2**20:.0f} MiB)"
    if not res["correct"]:
        return Row(name, FAIL, f"all-reduce returned wrong sums ({size}); see {where}")
    if local:
        return Row(name, PASS, f"local path: {res['backend']} {size}, {bw}; EFA not checked")
    if single_node and len(res["nodes"]) == 1:
        return Row(name, PASS, f"{size} (declared one-node partition), {bw}; cross-node EFA NOT proven")
    if len(res["nodes"]) < 2:
        return Row(name, FAIL, f"the job ran on {len(res['nodes'])} node; the EFA proof needs 2; see {where}")
    net = nccl_network(output)
    if not net.ok:
        return Row(name, FAIL, f"{net.reason}; {bw}; see {where}")
    return Row(name, PASS, f"{size}, {net.reason}, {bw}")


def gpu_allreduce(cfg: SmokeConfig, nodes: list[NodeState]) -> Row:
    want = network_nodes(cfg, nodes, "gpu")
    if isinstance(want, str):
        verdict, _, detail = want.partition(": ")
        return Row("gpu-allreduce", verdict, detail)
    argv = [_python_for(cfg.gpu_env), "-m", "training.smoke", "node", "gpu", *(["--local"] if cfg.local else [])]
    code, text, where = submit_and_wait(cfg, "gpu-allreduce", cfg.gpu_partition, want, argv,
                                        (*node_share(nodes, cfg.gpu_partition), *cfg.gpu_sbatch_args))
    return gpu_allreduce_row(code, text, where, local=cfg.local, single_node=want == 1)


def trn_rows(code: int | None, output: str, where: str, requirements: str, *, local: bool,
             single_node: bool = False) -> list[Row]:
    """Verdicts of the Trainium job: ``training.smoke.trn``'s JSON line and the per-node
    Neuron versions (``SMOKE_VERSIONS <node> {json}``) against requirements-neuron.txt
    (``single_node``: a declared one-node partition, where there is no cross-node path)."""
    rows = []
    pins = neuron_pins(requirements)
    per_node = {}
    for line in output.splitlines():
        if VERSIONS_MARKER + " " in line:
            node, _, blob = line.split(VERSIONS_MARKER + " ", 1)[1].partition(" ")
            per_node[node] = json.loads(blob)
    if not per_node:
        rows.append(Row("neuron-versions", FAIL, f"no node reported its Neuron versions; see {where}"))
    else:
        required = set(pins.packages) - (NEURON_ONLY if local else set())
        problems = [f"{node}: {p}" for node, inst in sorted(per_node.items())
                    for p in version_skew(inst, pins, required=required)]
        if problems:
            rows.append(Row("neuron-versions", FAIL, "; ".join(problems)))
        else:
            checked = sorted(n for n in pins.packages if any(n in v for v in per_node.values()))
            rows.append(Row("neuron-versions", PASS, f"Neuron SDK {pins.sdk} on {len(per_node)} node(s): "
                            f"{', '.join(checked)} match" + (" (local path: no Neuron host)" if local else "")))
    result = None
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"checks"' in line:
            try:
                result = json.loads(line)
            except ValueError:
                continue
    if code is None:
        rows.append(Row("trn-allreduce", FAIL, f"the Trainium job did not finish in time; see {where}"))
    elif result is None:
        tail = next((ln.strip() for ln in reversed(output.splitlines()) if ln.strip()), "no output")
        rows.append(Row("trn-allreduce", FAIL, f"Trainium job exited {code} without a result: {tail[:160]}; see {where}"))
    else:
        failed = sorted(k for k, v in result["checks"].items() if not v)
        neuron = bool(result.get("backend", {}).get("neuron"))
        world = result["world_size"]
        # torchrun's LOCAL_WORLD_SIZE, as the Neuron backend's describe() reports it
        nodes = world // max(1, int(result.get("backend", {}).get("per_node", world)))
        if failed or code != 0:
            rows.append(Row("trn-allreduce", FAIL, f"training.smoke.trn checks failed: {', '.join(failed) or 'exit ' + str(code)} "
                            f"(world {world}); see {where}"))
        elif not local and not neuron:
            rows.append(Row("trn-allreduce", FAIL, "training.smoke.trn ran on PJRT CPU, not NeuronCores: "
                            f"torch-neuronx is not importable in the Neuron env; see {where}"))
        elif not local and single_node and nodes == 1:
            rows.append(Row("trn-allreduce", PASS, f"{world} NeuronCores on 1 node (declared one-node partition); "
                            "all-reduce, identical params across ranks, no recompile after warm-up "
                            f"({result['steps']} steps); cross-node EFA NOT proven"))
        elif not local and nodes < 2:
            rows.append(Row("trn-allreduce", FAIL, f"training.smoke.trn ran {world} ranks on {nodes} node; "
                            f"the cross-node check needs 2; see {where}"))
        else:
            where_ran = "local path: PJRT CPU" if local else f"{world} NeuronCores on {nodes} nodes"
            rows.append(Row("trn-allreduce", PASS, f"{where_ran}; all-reduce, identical params across ranks, "
                            f"no recompile after warm-up ({result['steps']} steps)"))
    return rows


def trn_checks(cfg: SmokeConfig, nodes: list[NodeState]) -> list[Row]:
    want = network_nodes(cfg, nodes, "trn")
    if isinstance(want, str):
        verdict, _, detail = want.partition(": ")
        versions = detail if verdict == SKIP else "not run: no Trainium job (see the trn-allreduce row)"
        return [Row("trn-allreduce", verdict, detail), Row("neuron-versions", SKIP, versions)]
    argv = [_python_for(cfg.neuron_env), "-m", "training.smoke", "node", "trn", *(["--local"] if cfg.local else [])]
    code, text, where = submit_and_wait(cfg, "trn-allreduce", cfg.trn_partition, want, argv,
                                        node_share(nodes, cfg.trn_partition))
    requirements = (cfg.package_root / "training" / "requirements-neuron.txt").read_text()
    return trn_rows(code, text, where, requirements, local=cfg.local, single_node=want == 1)
