"""The deployment smoke test's checks and parsers (training/smoke/), on this machine.

What needs the cluster is exercised on its CPU path: the all-reduce worker over gloo with 2
real processes (torchrun), flock with two real processes on a tmp dir, S3 against the moto
server, and the parsers on captured text in the formats the real tools print (each sample
line's source is cited where it is defined). The Slurm side (real sinfo output, the
sbatch end to end) is in tests/slurm/test_smoke_job.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from tests.conftest import xla_python
from training.errors import UserError
from training.smoke import FAIL, PASS, SKIP, WARN, Row, checks, exit_code, render
from training.smoke.parse import (
    NodeState,
    nccl_network,
    neuron_pins,
    parse_sinfo,
    parse_status_file,
    parse_status_line,
    version_matches,
    version_skew,
)

REPO = Path(__file__).resolve().parents[3]
REQUIREMENTS = (REPO / "training" / "requirements-neuron.txt").read_text()

# --------------------------------------------------------------------------- captured NCCL logs
# EFA through aws-ofi-nccl, as NCCL 2.23 + aws-ofi-nccl print it on p5en (NVIDIA/nccl#1597):
# "NET/OFI Selected Provider is efa (found 16 nics)", "Using network Libfabric", and channel
# lines "Channel 07/0 : 1[1] -> 0[0] [send] via NET/AWS Libfabric/1/GDRDMA" (older plugin name).
# The bootstrap/socket lines ("Bootstrap : Using", "NET/Socket : Using [0]eth0") appear next
# to the plugin (NVIDIA/nccl#352, #1267 formats) and must not count as a fallback.
EFA_LOG = """\
ip-10-1-0-11:4021:4021 [0] NCCL INFO Bootstrap : Using enp71s0:10.1.0.11<0>
ip-10-1-0-11:4021:4021 [0] NCCL INFO cudaDriverVersion 12040
ip-10-1-0-11:4021:4021 [0] NCCL INFO NCCL version 2.23.4+cuda12.4
ip-10-1-0-11:4021:4070 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.13.2
ip-10-1-0-11:4021:4070 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
ip-10-1-0-11:4021:4070 [0] NCCL INFO NET/OFI NIC group 0 device #0 0000:56:00.0
ip-10-1-0-11:4021:4070 [0] NCCL INFO NET/Socket : Using [0]enp71s0:10.1.0.11<0>
ip-10-1-0-11:4021:4070 [0] NCCL INFO Using network Libfabric
ip-10-1-0-12:3877:3920 [0] NCCL INFO Using network Libfabric
ip-10-1-0-11:4021:4080 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
ip-10-1-0-11:4021:4080 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA
"""
# The same job without the plugin: NCCL's internal TCP transport ("Using network Socket",
# NVIDIA/nccl#1267; "NET/Plugin : No plugin found", NVIDIA/nccl#352), channels over NET/Socket.
# And with the plugin loaded but failing to start, then falling back (aws/aws-ofi-nccl#889).
PLUGIN_FAILED_LOG = """\
ip-10-36-29-253:84:2553 [0] nccl_net_ofi_create_plugin:335 NCCL WARN NET/OFI aws-ofi-nccl initialization failed
ip-10-36-29-253:84:2553 [0] nccl_net_ofi_init:155 NCCL WARN NET/OFI Initializing plugin failed
ip-10-36-29-253:84:2553 [0] NCCL INFO NET/IB : No device found.
ip-10-36-29-253:84:2553 [0] NCCL INFO NET/Socket : Using [0]eth0:10.36.29.253<0>
ip-10-36-29-253:84:2553 [0] NCCL INFO Using non-device net plugin version 0
ip-10-36-29-253:84:2553 [0] NCCL INFO Using network Socket
"""
SOCKET_LOG = """\
ip-10-1-0-11:4021:4021 [0] NCCL INFO Bootstrap : Using enp71s0:10.1.0.11<0>
ip-10-1-0-11:4021:4021 [0] NCCL INFO NET/Plugin : Plugin load (libnccl-net.so) returned 2 : libnccl-net.so: cannot open shared object file: No such file or directory
ip-10-1-0-11:4021:4021 [0] NCCL INFO NET/Plugin : No plugin found, using internal implementation
ip-10-1-0-11:4021:4070 [0] NCCL INFO NET/IB : No device found.
ip-10-1-0-11:4021:4070 [0] NCCL INFO NET/Socket : Using [0]enp71s0:10.1.0.11<0>
ip-10-1-0-11:4021:4070 [0] NCCL INFO Using network Socket
ip-10-1-0-11:4021:4080 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [receive] via NET/Socket/0
"""
# Older NCCL/aws-ofi-nccl naming: "Ring 00 : 7 -> 8 [send] via NET/AWS Libfabric/0"
# (aws/aws-ofi-nccl#24), "NET/OFI Selected Provider is efa" without the NIC count (#22), and
# "Using network AWS Libfabric" behind a launcher's host prefix (NVIDIA/nccl#526, p4d).
OLD_EFA_LOG = """\
[1,7]<stdout>:ip-172-32-38-1:21471:22316 [7] NCCL INFO NET/OFI Selected Provider is efa
[1,7]<stdout>:ip-172-32-38-1:21471:22316 [7] NCCL INFO Ring 00 : 7 -> 8 [send] via NET/AWS Libfabric/0
compute-st-p4d24xlarge-3: compute-st-p4d24xlarge-3:2406:2406 [7] NCCL INFO Using network AWS Libfabric
"""


def allreduce_line(**over) -> str:
    res = {"rank": 0, "world_size": 16, "backend": "nccl", "correct": True, "bytes": 256 * 2**20,
           "time_us": 2900.0, "algbw_gbps": 92.6, "busbw_gbps": 173.6, "nodes": ["ip-10-1-0-11", "ip-10-1-0-12"],
           "nccl": [2, 23, 4]}
    res.update(over)
    return f"SMOKE_ALLREDUCE {json.dumps(res)}\n"


def test_nccl_log_over_efa_passes_and_names_plugin_and_provider():
    net = nccl_network(EFA_LOG)
    assert net.ok, net.reason
    assert net.networks == ("Libfabric",) and net.provider == "efa"
    old = nccl_network(OLD_EFA_LOG)
    assert old.ok and old.networks == ("AWS Libfabric",), old


def test_nccl_socket_fallback_fails_in_one_line_naming_socket():
    net = nccl_network(SOCKET_LOG)
    assert not net.ok
    assert "Socket" in net.reason and "socket fallback" in net.reason
    failed = nccl_network(PLUGIN_FAILED_LOG)
    assert not failed.ok and "initialization failed" in failed.reason
    # One communicator on the plugin and one on sockets is still a fallback.
    assert not nccl_network(EFA_LOG + SOCKET_LOG.splitlines()[-1] + "\n").ok


def test_nccl_log_without_selection_lines_or_with_another_provider_fails():
    assert "NCCL_DEBUG=INFO" in nccl_network("NCCL version 2.23.4+cuda12.4\n").reason
    tcp = EFA_LOG.replace("Selected Provider is efa", "Selected Provider is tcp")
    assert not nccl_network(tcp).ok and "tcp" in nccl_network(tcp).reason


def test_gpu_row_reports_bus_bandwidth_on_efa_and_fails_on_socket_fallback():
    row = checks.gpu_allreduce_row(0, EFA_LOG + allreduce_line(), "/fsx/logs/x.out", local=False)
    assert row.verdict == PASS and "busbw 173.6 GB/s" in row.detail and "Libfabric" in row.detail
    row = checks.gpu_allreduce_row(0, SOCKET_LOG + allreduce_line(busbw_gbps=2.1), "/fsx/logs/x.out", local=False)
    assert row.verdict == FAIL
    assert "socket fallback" in row.detail and "busbw 2.1" in row.detail and "\n" not in row.detail
    one_node = allreduce_line(nodes=["ip-10-1-0-11"])
    assert checks.gpu_allreduce_row(0, EFA_LOG + one_node, "f", local=False).verdict == FAIL
    assert "wrong sums" in checks.gpu_allreduce_row(0, EFA_LOG + allreduce_line(correct=False), "f",
                                                    local=False).detail
    crashed = checks.gpu_allreduce_row(1, "RuntimeError: NCCL error in: ...\n", "f", local=False)
    assert crashed.verdict == FAIL and "exited 1" in crashed.detail
    assert checks.gpu_allreduce_row(None, "", "f", local=False).verdict == FAIL


@pytest.mark.slow
def test_allreduce_worker_over_gloo_with_two_processes():
    """The real worker under torchrun: 2 processes, correct sums, a bandwidth. Its gloo
    output has no NCCL lines, so on the cluster path the same output FAILS."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "training.smoke.allreduce", "--backend", "gloo", "--size-mib", "1",
                           "--warmup", "1", "--iters", "3"],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SMOKE_ALLREDUCE "))
    res = json.loads(line.split(" ", 1)[1])
    assert res["world_size"] == 2 and res["correct"] and res["busbw_gbps"] > 0
    assert res["busbw_gbps"] == pytest.approx(res["algbw_gbps"])  # 2*(n-1)/n == 1 for n == 2
    assert checks.gpu_allreduce_row(0, proc.stdout, "f", local=True).verdict == PASS
    assert checks.gpu_allreduce_row(0, proc.stdout, "f", local=False).verdict == FAIL


# --------------------------------------------------------------------------- node status files

def _status_format(script: str, verdict: str) -> str:
    """The printf format the lifecycle script writes the status line with (read from it, so
    a change there breaks these tests instead of silently changing what is parsed). status.sh
    writes READY and PENDING lines with one format (the verdict is its second %s)."""
    text = (REPO / "lifecycle_scripts" / script).read_text()
    word = "%s" if verdict in ("READY", "PENDING") else verdict
    match = re.search(rf"printf '(%s {word} node=[^']*)\\n'", text)
    assert match, f"no {verdict} status printf in lifecycle_scripts/{script}"
    return match.group(1).replace("%s %s node=", f"%s {verdict} node=", 1)


def status_line(verdict: str, *values: str) -> str:
    script = "on_init_complete.sh" if verdict == "FAILED" else "status.sh"
    fmt = _status_format(script, verdict)
    assert fmt.count("%s") == len(values), fmt
    return fmt.replace("%s", "{}").format(*values) + "\n"


def ready(node: str, ip: str) -> str:
    return status_line("READY", "2026-12-01T07:00:00Z", node, "gpu", "gpu", ip, "3f2a9c",
                       "fsx=ok gpu=ok env=/fsx/envs/gpu slurm=slurmd slurm_wait=0s")


def warn(node: str, part: str, cause: str) -> str:
    return status_line("WARN", "2026-12-01T07:00:00Z", node, part, cause)


def test_status_lines_parse_in_the_lifecycle_format():
    s = parse_status_line(ready("gpu-1", "10.1.0.11"))
    assert s.verdict == "READY" and s.node == "gpu-1" and s.fields["ip"] == "10.1.0.11"
    f = parse_status_line(status_line("FAILED", "2026-12-01T07:00:00Z", "trn-2", "trn", "trn", "10.1.0.21",
                                      "envs", "pip install failed: No matching distribution for neuronx-cc==2.24"))
    assert f.verdict == "FAILED" and f.fields["step"] == "envs"
    assert f.fields["cause"] == "pip install failed: No matching distribution for neuronx-cc==2.24"


def test_node_status_row_fails_on_a_failed_node_quoting_step_and_cause(tmp_path):
    (tmp_path / "gpu-1.status").write_text(ready("gpu-1", "10.1.0.11"))
    (tmp_path / "trn-2.status").write_text(status_line(
        "FAILED", "2026-12-01T07:00:00Z", "trn-2", "trn", "trn", "10.1.0.21", "fsx",
        "/fsx is not mounted after 600s"))
    nodes = {"ip-10-1-0-11": {"ip-10-1-0-11", "10.1.0.11"}}
    row = checks.node_status_row(tmp_path, nodes)
    assert row.verdict == FAIL
    assert row.detail == "trn-2 FAILED at step fsx: /fsx is not mounted after 600s"
    (tmp_path / "trn-2.status").unlink()
    assert checks.node_status_row(tmp_path, nodes).verdict == PASS  # matched by address


def test_warn_lines_become_warn_rows_and_the_job_still_passes(tmp_path):
    """An optional part that does not work on a node (status.sh WARN lines): one WARN row each."""
    (tmp_path / "gpu-1.status").write_text(
        ready("gpu-1", "10.1.0.11")
        + warn("gpu-1", "containers", "cannot download https://github.com/NVIDIA/enroot/releases/x.deb (curl exit 6)"))
    (tmp_path / "controller-1.status").write_text(
        status_line("READY", "2026-12-01T07:00:00Z", "controller-1", "controller", "controller", "10.1.0.10",
                    "3f2a9c", "fsx=ok slurm=slurmctld slurm_wait=0s")
        + warn("controller-1", "accounts", "slurmdbd does not answer sacctmgr after 300s"))
    nodes = {"gpu-1": {"gpu-1", "10.1.0.11"}}
    status = checks.node_status_row(tmp_path, nodes)
    assert status.verdict == PASS and status.detail == "2 node(s) READY (1 Slurm node(s) matched)"
    rows = checks.node_warning_rows(tmp_path)
    assert [(r.check, r.verdict, r.detail) for r in rows] == [
        ("node-warning", WARN, "controller-1 accounts: slurmdbd does not answer sacctmgr after 300s"),
        ("node-warning", WARN, "gpu-1 containers: cannot download https://github.com/NVIDIA/enroot/releases/x.deb "
                               "(curl exit 6)")]
    table = render([status, *rows])
    assert re.search(r"^node-warning +WARN +gpu-1 containers: cannot download", table, re.M), table
    assert table.splitlines()[-1] == "SMOKE PASS: 1 passed, 0 failed, 0 skipped, 2 warnings"
    assert exit_code([status, *rows]) == 0


def test_a_node_still_pending_fails_the_status_row_naming_the_late_check(tmp_path):
    (tmp_path / "gpu-1.status").write_text(status_line(
        "PENDING", "2026-12-01T07:00:00Z", "gpu-1", "gpu", "gpu", "10.1.0.11", "3f2a9c",
        "fsx=ok gpu=ok env=/fsx/envs/gpu slurm=waiting-for-slurmd cause=slurmd is not active on this node 300s after "
        "slurmd.service started (failed)"))
    row = checks.node_status_row(tmp_path, {"gpu-1": {"gpu-1", "10.1.0.11"}})
    assert row.verdict == FAIL
    assert row.detail.startswith("gpu-1 PENDING: provisioned, but sana-node-ready.service has not recorded its Slurm "
                                 "daemon up (slurmd is not active on this node 300s after slurmd.service started "
                                 "(failed)); `systemctl status sana-node-ready` on it; no READY status for Slurm node(s) gpu-1")


def test_the_status_files_the_pretend_cluster_writes_parse():
    """Lines exactly as lifecycle_scripts/status.sh prints them, with its WARN lines."""
    text = ready("trn-1", "10.1.2.1") + warn("trn-1", "containers", "pyxis is not registered in /x (...) after 300s")
    s = parse_status_file(text, "/fsx/logs/provision/trn-1.status")
    assert (s.verdict, s.fields["slurm"], s.fields["slurm_wait"]) == ("READY", "slurmd", "0s")
    assert s.warnings == (("containers", "pyxis is not registered in /x (...) after 300s"),)
    assert parse_status_file(text + "garbage\n").verdict == "INVALID"


def test_node_status_row_fails_when_a_slurm_node_never_reported_ready(tmp_path):
    (tmp_path / "gpu-1.status").write_text(ready("gpu-1", "10.1.0.11"))
    nodes = {"ip-10-1-0-11": {"10.1.0.11"}, "ip-10-1-0-12": {"ip-10-1-0-12", "10.1.0.12"}}
    row = checks.node_status_row(tmp_path, nodes)
    assert row.verdict == FAIL and "no READY status for Slurm node(s) ip-10-1-0-12" in row.detail
    assert checks.node_status_row(tmp_path / "missing", nodes).verdict == FAIL


# --------------------------------------------------------------------------- sinfo

def test_sinfo_states():
    # `sinfo --Node --noheader --format=%P|%N|%T|%E` lines (sinfo(1) state names; "*" = not responding)
    nodes = parse_sinfo("gpu*|ip-10-1-0-11|idle|none|192|2000000\ngpu*|ip-10-1-0-12|mixed|none|192|1990000\n"
                        "trn|ip-10-1-0-21|drained|Kill task failed|128|500000\ntrn|ip-10-1-0-22|idle*|none|128|500000\n"
                        "trn|ip-10-1-0-23|idle+drain|hc|a|b|128|500000\n")
    assert [n.usable for n in nodes] == [True, True, False, False, False]
    assert nodes[0].partition == "gpu" and nodes[2].reason == "Kill task failed"
    assert nodes[4].reason == "hc|a|b" and nodes[4].cpus == 128  # "|" in a free-text reason
    with pytest.raises(ValueError, match="unexpected sinfo line"):
        parse_sinfo("gpu|ip-10-1-0-11|idle\n")
    row = checks.slurm_row(nodes)
    assert row.verdict == FAIL
    assert "ip-10-1-0-21 (trn) drained reason 'Kill task failed'" in row.detail
    assert "ip-10-1-0-22 (trn) idle*" in row.detail
    assert checks.slurm_row(nodes[:2]).verdict == PASS
    assert checks.slurm_row([]).verdict == FAIL


# --------------------------------------------------------------------------- Neuron versions

def neuron_host(**over: str) -> dict[str, str]:
    """A trn node with exactly the pinned release (what `python -m training.smoke versions` reports)."""
    pins = neuron_pins(REQUIREMENTS)
    inst = {name: v.replace(".*", ".35021") for name, v in pins.packages.items()}
    inst["aws-neuronx-runtime-lib"] += "~8c1d2c3a9"  # Debian version suffix as apt installs it
    inst.update(over)
    return inst


def test_pins_come_from_requirements_neuron_and_the_release_table():
    pins = neuron_pins(REQUIREMENTS)
    assert pins.sdk == re.search(r"Neuron SDK release:\s*(\S+)", REQUIREMENTS).group(1)
    assert pins.packages["neuronx-cc"] == re.search(r"^neuronx-cc==(\S+)", REQUIREMENTS, re.M).group(1)
    assert {"aws-neuronx-runtime-lib", "aws-neuronx-dkms", "torch-neuronx", "torch-xla"} <= set(pins.packages)
    with pytest.raises(ValueError, match="Neuron SDK 9.9.9 .* NEURON_RELEASES"):
        neuron_pins(REQUIREMENTS.replace(f"Neuron SDK release: {pins.sdk}", "Neuron SDK release: 9.9.9"))


def test_version_match_rules():
    assert version_matches("2.9.0.2.13.35021", "2.9.0.2.13.*")
    assert not version_matches("2.9.0.2.12.1", "2.9.0.2.13.*")
    assert version_matches("2.31.24.0~8c1d2c3a9", "2.31.24.0")
    assert version_matches("2.31.24.0-1", "2.31.24.0")
    assert not version_matches("2.31.2", "2.31.24.0")


def test_neuron_version_skew_is_one_line_naming_both_versions():
    pins = neuron_pins(REQUIREMENTS)
    assert version_skew(neuron_host(), pins) == []
    problems = version_skew(neuron_host(**{"neuronx-cc": "2.23.6484.0"}), pins)
    assert problems == [f"neuronx-cc 2.23.6484.0 installed, but Neuron SDK {pins.sdk} "
                        f"(training/requirements-neuron.txt) pins {pins.packages['neuronx-cc']}"]
    missing = neuron_host()
    del missing["aws-neuronx-dkms"]
    assert version_skew(missing, pins) == [f"aws-neuronx-dkms is not installed (Neuron SDK {pins.sdk} pins "
                                           f"{pins.packages['aws-neuronx-dkms']})"]


TRN_RESULT = {"ok": True, "checks": {"all_reduce": True, "params_identical_across_ranks": True},
              "rank": 0, "world_size": 64, "steps": 3, "backend": {"neuron": True, "per_node": 32}}


def trn_output(versions: dict[str, dict[str, str]], result: dict | None = TRN_RESULT) -> str:
    lines = [f"SMOKE_VERSIONS {node} {json.dumps(v)}" for node, v in versions.items()]
    if result is not None:
        lines.append(json.dumps(result))
    return "\n".join(lines) + "\n"


def test_trn_rows_pass_and_fail_on_a_skewed_node():
    good = trn_output({"trn-1": neuron_host(), "trn-2": neuron_host()})
    rows = checks.trn_rows(0, good, "f", REQUIREMENTS, local=False)
    assert [(r.check, r.verdict) for r in rows] == [("neuron-versions", PASS), ("trn-allreduce", PASS)]
    skewed = trn_output({"trn-1": neuron_host(), "trn-2": neuron_host(**{"aws-neuronx-dkms": "2.26.5.0"})})
    versions = checks.trn_rows(0, skewed, "f", REQUIREMENTS, local=False)[0]
    assert versions.verdict == FAIL
    assert versions.detail.startswith("trn-2: aws-neuronx-dkms 2.26.5.0 installed, but Neuron SDK")
    assert "64 NeuronCores on 2 nodes" in rows[1].detail
    cpu = trn_output({"trn-1": neuron_host()}, {**TRN_RESULT, "backend": {"neuron": False, "per_node": 32}})
    assert "PJRT CPU, not NeuronCores" in checks.trn_rows(0, cpu, "f", REQUIREMENTS, local=False)[1].detail
    one = trn_output({"trn-1": neuron_host()}, {**TRN_RESULT, "backend": {"neuron": True, "per_node": 64}})
    assert "on 1 node" in checks.trn_rows(0, one, "f", REQUIREMENTS, local=False)[1].detail
    broken = trn_output({"trn-1": neuron_host()}, {**TRN_RESULT, "checks": {"all_reduce": False}})
    row = checks.trn_rows(1, broken, "f", REQUIREMENTS, local=False)[1]
    assert row.verdict == FAIL and "all_reduce" in row.detail


def test_installed_versions_of_the_xla_test_env_match_the_pins():
    """The collector, run for real in .venv-xla (built with requirements-neuron.txt's torch
    and torch-xla pins): on the local path those two are compared, the Neuron-host-only
    components are not required."""
    python = xla_python()
    out = subprocess.run([str(python), "-m", "training.smoke", "versions"], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True).stdout
    installed = json.loads(out)
    assert "torch" in installed and "torch-xla" in installed
    rows = checks.trn_rows(0, trn_output({"vm": installed}, {**TRN_RESULT, "world_size": 1}), "f",
                           REQUIREMENTS, local=True)
    assert rows[0].verdict == PASS, rows[0]
    assert checks.trn_rows(0, trn_output({"vm": installed}), "f", REQUIREMENTS, local=False)[0].verdict == FAIL


# --------------------------------------------------------------------------- FSx and S3

def test_flock_excludes_a_second_process(tmp_path):
    assert checks.flock_contends(tmp_path / "smoke.lock") is None


def test_flock_check_catches_a_lock_that_excludes_nothing(tmp_path, monkeypatch):
    """A stand-in failing the way a no-op flock (Lustre `noflock` answers ENOSYS, a
    `localflock` client on another node grants it) would: the lock is granted twice."""
    import fcntl

    real = fcntl.flock
    monkeypatch.setattr(fcntl, "flock", lambda f, op: None if op & fcntl.LOCK_NB else real(f, op))
    assert "granted to two processes" in checks.flock_contends(tmp_path / "smoke.lock")


def test_fsx_row_requires_lustre_with_flock(tmp_path):
    fsx = tmp_path / "fsx"
    fsx.mkdir()
    mounts = f"/dev/root / ext4 rw 0 0\n10.1.0.5@tcp:/abcd {fsx} lustre rw,flock,lazystatfs 0 0\n"
    assert checks.fsx_row(fsx, fsx / "logs" / "smoke-1", mounts=mounts).verdict == PASS
    local = checks.fsx_row(fsx, fsx / "logs" / "smoke-1", mounts=mounts.replace("flock,", "localflock,"))
    assert local.verdict == FAIL and "remount with -o flock" in local.detail
    # x-systemd.automount: systemd's autofs entry first, the lustre one mounted over it.
    automount = f"/dev/root / ext4 rw 0 0\nsystemd-1 {fsx} autofs rw,relatime,fd=5,direct 0 0\n" + mounts.split("\n", 1)[1]
    assert checks.fsx_row(fsx, fsx / "logs" / "smoke-2", mounts=automount).verdict == PASS
    ext4 = checks.fsx_row(fsx, fsx / "logs" / "smoke-1", mounts="/dev/root / ext4 rw 0 0\n")
    assert ext4.verdict == FAIL and "not an FSx for Lustre mount" in ext4.detail
    assert checks.fsx_row(fsx, fsx / "logs" / "smoke-1", require_lustre=False,
                          mounts="/dev/root / ext4 rw 0 0\n").verdict == PASS


def test_s3_probe_writes_reads_and_deletes(s3_endpoint, s3_bucket):
    row = checks.s3_row(s3_bucket, "smoke/test/1-vm.probe")
    assert row.verdict == PASS, row
    listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=s3_bucket)
    assert listed.get("KeyCount", 0) == 0  # the probe is gone


def test_s3_probe_fails_in_one_line_on_a_missing_bucket(s3_endpoint):
    row = checks.s3_row("no-such-bucket-smoke", "smoke/p")
    assert row.verdict == FAIL and "no-such-bucket-smoke" in row.detail and "\n" not in row.detail
    assert "SANA_ARTEFACTS_BUCKET" in checks.s3_row("", "smoke/p").detail


# --------------------------------------------------------------------------- table

def test_table_and_exit_code():
    rows = [Row("slurm-nodes", PASS, "gpu: 2 node(s)"), Row("trn-allreduce", SKIP, "no trn"),
            Row("s3", FAIL, "s3://b/k: access denied\n(AccessDenied)")]
    table = render(rows)
    assert table.splitlines()[-1] == "SMOKE FAIL: 1 passed, 1 failed, 1 skipped"
    assert re.search(r"^s3 +FAIL +s3://b/k: access denied \(AccessDenied\)$", table, re.M), table
    assert exit_code(rows) == 1 and exit_code(rows[:2]) == 0
    with pytest.raises(ValueError):
        Row("x", "OK", "")


def test_usable_nodes_and_the_share_a_2_node_job_asks_for():
    nodes = [NodeState("gpu", "a", "idle", "", 192, 2_000_000), NodeState("gpu", "b", "mixed", "", 192, 1_990_000),
             NodeState("gpu", "c", "down*", "", 96, 100), NodeState("trn", "d", "idle", "", 128, 500_000)]
    assert checks.usable_nodes(nodes, "gpu") == ["a", "b"]
    # all but one core (2 threads) and 4 GiB of the smallest usable node: fits next to the
    # coordinator's 1 CPU / 2 GiB, unlike --exclusive
    assert checks.node_share(nodes, "gpu") == ("--cpus-per-task=190", f"--mem={1_990_000 - 4096}M")
    assert checks.node_share([NodeState("trn", "d", "idle", "", 2, 0)], "trn") == ("--cpus-per-task=1",)


def test_node_profile_loading_keeps_what_was_submitted(tmp_path, monkeypatch):
    """The profile node_profile.sh really writes: the node step takes its NCCL/EFA settings,
    the coordinator only the SANA_* ones; a value the submitter exported always wins."""
    from training.smoke import __main__ as cli

    env = {k: v for k, v in os.environ.items() if not k.startswith("SANA_")}
    env.update(PLATFORM_ROOT=str(tmp_path), NODE_ROLE="gpu", NODE_GROUP="gpu", FSX="/fsx",
               ENV_GPU_DIR="/fsx/envs/gpu", ENV_NEURON_DIR="/fsx/envs/neuron", CFG_RDZV_PORT="29500",
               CFG_REGION="us-east-1", CFG_PROJECT="sana", CFG_CLUSTER_NAME="c1",
               CFG_ARTEFACTS_BUCKET="art-bucket", CFG_DATA_BUCKET="data-bucket")
    subprocess.run(["bash", str(REPO / "lifecycle_scripts" / "node_profile.sh")], env=env, check=True,
                   capture_output=True, timeout=60)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # whatever the loader sets stays in this test
    monkeypatch.setenv("SANA_PROFILE", str(tmp_path / "etc" / "profile.d" / "sana-platform.sh"))
    for name in ("SANA_ARTEFACTS_BUCKET", "SANA_CLUSTER", "FI_PROVIDER", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SANA_CLUSTER", "submitted")
    cli._load_profile(only_sana=True)
    assert os.environ["SANA_ARTEFACTS_BUCKET"] == "art-bucket"
    assert os.environ["SANA_CLUSTER"] == "submitted"
    assert "FI_PROVIDER" not in os.environ
    cli._load_profile()
    assert os.environ["FI_PROVIDER"] == "efa"


# --------------------------------------------------------------------------- instance metadata

def test_imds_row_passes_when_refused_fails_when_reached_and_skips_off_ec2(monkeypatch):
    """The smoke job's check of lifecycle_scripts/imds_block.sh, on loopback: a refused
    connection is the block (PASS), an answer is the hole (FAIL), silence is no EC2 (SKIP)."""
    import errno
    import socket as socket_module

    from training.smoke import SKIP

    monkeypatch.setattr(checks.os, "getuid", lambda: 2001)
    with socket_module.socket() as closed:  # a port nothing listens on: refused, as REJECT does
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    row = checks.imds_row("127.0.0.1", port)
    assert row.verdict == PASS and "uid 2001 is refused" in row.detail
    with socket_module.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        row = checks.imds_row("127.0.0.1", listening.getsockname()[1])
    assert row.verdict == FAIL and "sudo iptables -S SANA-IMDS" in row.detail
    def unreachable(*_args, **_kwargs):  # what a host without a link-local route answers
        raise OSError(errno.ENETUNREACH, "Network is unreachable")

    with monkeypatch.context() as m:
        m.setattr(checks.socket, "create_connection", unreachable)
        row = checks.imds_row()
    assert row.verdict == SKIP and "not an EC2 node" in row.detail
    assert checks.imds_row("127.0.0.1", port, local=True).verdict == SKIP  # tests: no provisioned node
    monkeypatch.setattr(checks.os, "getuid", lambda: 0)
    assert checks.imds_row("127.0.0.1", port).verdict == SKIP


# --------------------------------------------------------------------------- one-node partitions

def smoke_cfg(**over) -> checks.SmokeConfig:
    return checks.SmokeConfig(package_root=REPO, fsx=Path("/fsx"), log_dir=Path("/fsx/logs/u/smoke-1"),
                              artefacts_bucket="b", cluster="c", gpu_env=Path("/fsx/envs/gpu"),
                              neuron_env=Path("/fsx/envs/neuron"), **over)


# The default deployment (cdk.json: gpuInstanceCount=1, trnInstanceCount=1), as sinfo lists it.
ONE_EACH = parse_sinfo("gpu*|gpu-1|idle|none|192|2000000\ntrn|trn-1|idle|none|128|500000\n")


@pytest.mark.parametrize("kind", ["gpu", "trn"])
def test_a_one_node_partition_fails_its_network_row_unless_declared(kind):
    """A SKIP would let a cluster whose EFA never carried a byte pass the smoke job."""
    partition = kind
    plan = checks.network_nodes(smoke_cfg(), ONE_EACH, kind)
    count_key = {"gpu": "gpuInstanceCount", "trn": "trnInstanceCount"}[kind]
    assert plan == (f"FAIL: partition {partition} has 1 usable node; the cross-node (EFA) check needs 2: scale "
                    f"{count_key} to 2, or declare the one-node partition with SANA_SMOKE_SINGLE_NODE={partition} "
                    "(the row then checks that node alone and says EFA was not proven)")
    assert checks.network_nodes(smoke_cfg(single_node=frozenset({partition})), ONE_EACH, kind) == 1
    two = parse_sinfo(f"{partition}|a|idle|none|8|1000\n{partition}|b|mixed|none|8|1000\n")
    assert checks.network_nodes(smoke_cfg(), two, kind) == 2
    assert checks.network_nodes(smoke_cfg(single_node=frozenset({partition})), two, kind) == 2
    down = parse_sinfo(f"{partition}|a|idle|none|8|1000\n{partition}|b|down*|none|8|1000\n")
    assert checks.network_nodes(smoke_cfg(), down, kind).startswith(f"FAIL: partition {partition} has 1 usable")


def test_a_partition_the_cluster_does_not_have_is_skipped_not_failed():
    gpu_only = parse_sinfo("gpu|gpu-1|idle|none|192|2000000\ngpu|gpu-2|idle|none|192|2000000\n")
    assert checks.network_nodes(smoke_cfg(), gpu_only, "trn") == \
        "SKIP: no partition trn in sinfo (no trn group: trnInstanceCount=0)"
    rows = checks.trn_checks(smoke_cfg(), gpu_only)
    assert [(r.check, r.verdict) for r in rows] == [("trn-allreduce", SKIP), ("neuron-versions", SKIP)]


def test_the_rows_fail_without_submitting_anything_on_an_undeclared_one_node_partition():
    """No sbatch is run (none exists here): the verdict comes before any job."""
    (gpu,) = [checks.gpu_allreduce(smoke_cfg(), ONE_EACH)]
    assert (gpu.check, gpu.verdict) == ("gpu-allreduce", FAIL)
    trn, versions = checks.trn_checks(smoke_cfg(), ONE_EACH)
    assert (trn.verdict, versions.verdict) == (FAIL, SKIP)
    assert versions.detail == "not run: no Trainium job (see the trn-allreduce row)"
    assert exit_code([gpu, trn, versions]) == 1


def test_a_declared_one_node_partition_passes_saying_efa_was_not_proven():
    line = allreduce_line(nodes=["gpu-1"], world_size=8)
    row = checks.gpu_allreduce_row(0, line, "f", local=False, single_node=True)
    assert row.verdict == PASS and row.detail.startswith("8 ranks on 1 node(s) (declared one-node partition), busbw")
    assert row.detail.endswith("cross-node EFA NOT proven")
    assert checks.gpu_allreduce_row(0, line, "f", local=False).verdict == FAIL  # undeclared: 2 nodes needed
    one = trn_output({"trn-1": neuron_host()}, {**TRN_RESULT, "world_size": 32, "backend": {"neuron": True, "per_node": 32}})
    versions, trn = checks.trn_rows(0, one, "f", REQUIREMENTS, local=False, single_node=True)
    assert versions.verdict == PASS and trn.verdict == PASS
    assert trn.detail.startswith("32 NeuronCores on 1 node (declared one-node partition)")
    assert trn.detail.endswith("cross-node EFA NOT proven")


def test_the_declaration_names_partitions_the_job_checks():
    from training.smoke.__main__ import single_node_partitions

    assert single_node_partitions({"SANA_SMOKE_SINGLE_NODE": "gpu, trn"}) == {"gpu", "trn"}
    assert single_node_partitions({}) == frozenset()
    with pytest.raises(UserError, match=r"^SANA_SMOKE_SINGLE_NODE=p5: p5 is not a partition this job checks; "
                                        r"allowed: gpu, trn \(comma-separated\)$"):
        single_node_partitions({"SANA_SMOKE_SINGLE_NODE": "p5"})
