"""The IMDS step (lifecycle_scripts/imds_block.sh) with the REAL iptables, on a pretend node.

Two network namespaces of the test's own stand for the node's network: the node's, and a
neighbour on a veth link that holds the IMDS addresses (169.254.169.254 and fd00:ec2::254), where
a stand-in metadata service answers the way IMDSv2 hands out the node role's credentials
(imds_standin.py). The controller node boots
inside that namespace with the whole on_init_complete.sh, its iptables/ip6tables being the real
ones (only that namespace's firewall changes). Then root gets the credentials and a cluster user
does not: not as itself, not as "root" in a user namespace (what an enroot container is), not
over IPv6; a system account the step names (slurm) still does. A reboot drops the rules; the
script the boot unit runs puts them back. Needs root, `ip` and iptables (Debian's iptables,
scripts/install-system-packages.sh); a missing one skips here and fails under SANA_REQUIRE_ALL.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from lifecycle_cluster import STANDINS, USERS, Cluster, make_bundle, make_standins

from tests.conftest import skip_or_fail

HERE = Path(__file__).resolve().parent
SERVICE_UID = 64030  # the node's `slurm` account (Debian's slurm-wlm uses 64030)
RESEARCHER = USERS["researcher"]
# The client every caller runs: IMDSv2's token, then the role's credentials; 3 s per call.
CLIENT = r"""
import errno, json, sys, urllib.request
host = sys.argv[1]
base = f"http://{host}/latest"
def call(method, path, headers):
    req = urllib.request.Request(base + path, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=3) as resp:
        return resp.read().decode()
try:
    token = call("PUT", "/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    role = call("GET", "/meta-data/iam/security-credentials/", {"X-aws-ec2-metadata-token": token})
    creds = json.loads(call("GET", f"/meta-data/iam/security-credentials/{role}", {"X-aws-ec2-metadata-token": token}))
    print("CREDENTIALS", creds["AccessKeyId"])
except OSError as err:
    reason = getattr(err, "reason", err)
    print("REFUSED", errno.errorcode.get(getattr(reason, "errno", None) or 0, repr(reason)))
"""


def system_python() -> str:
    """An interpreter every uid may run (root's own may sit in a private pyenv)."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        skip_or_fail("no /usr/bin/python3 for the unprivileged clients", required_by="SANA_REQUIRE_ALL")
    return python


@pytest.fixture(scope="module")
def netns(tmp_path_factory) -> str:
    """The node's network namespace, and beside it an "ec2" one holding the metadata service:
    as on EC2 the service is a link-local neighbour of the node's interface (never one of the
    node's own addresses), so a refused connection is refused at once (REJECT's reply comes back
    to the node's address, which no rule blocks)."""
    if os.geteuid() != 0:
        skip_or_fail("the IMDS test needs root (network namespaces, iptables)", required_by="SANA_REQUIRE_ALL")
    for tool in ("ip", "iptables", "iptables-restore", "ip6tables", "ip6tables-restore", "setpriv", "unshare"):
        if shutil.which(tool, path=f"{os.environ['PATH']}:/usr/sbin:/sbin") is None:
            skip_or_fail(f"{tool} not installed; run `make setup` (scripts/install-system-packages.sh)",
                         required_by="SANA_REQUIRE_ALL")
    tag = os.getpid()
    node_ns, ec2_ns, node_if, ec2_if = f"sana-node-{tag}", f"sana-ec2-{tag}", f"sn{tag}", f"se{tag}"
    setup = [
        ["ip", "netns", "add", node_ns], ["ip", "netns", "add", ec2_ns],
        ["ip", "link", "add", node_if, "type", "veth", "peer", "name", ec2_if],
        ["ip", "link", "set", node_if, "netns", node_ns], ["ip", "link", "set", ec2_if, "netns", ec2_ns],
        ["ip", "netns", "exec", node_ns, "sh", "-c",
         f"ip link set lo up && ip link set {node_if} up && ip addr add 10.1.0.10/24 dev {node_if} && "
         f"ip route add 169.254.169.254/32 dev {node_if} && sysctl -qw net.ipv6.conf.{node_if}.disable_ipv6=0 && "
         f"ip -6 addr add fd00:ec2::10/64 dev {node_if} nodad"],
        ["ip", "netns", "exec", ec2_ns, "sh", "-c",
         f"ip link set lo up && ip link set {ec2_if} up && ip addr add 169.254.169.254/32 dev {ec2_if} && "
         f"ip route add 10.1.0.0/24 dev {ec2_if} && sysctl -qw net.ipv6.conf.{ec2_if}.disable_ipv6=0 && "
         f"ip -6 addr add fd00:ec2::254/64 dev {ec2_if} nodad"],
    ]
    server = None
    try:
        for argv in setup:
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                skip_or_fail(f"cannot build the test network ({' '.join(argv[:4])}): {done.stderr.strip()}",
                             required_by="SANA_REQUIRE_ALL")
        ready = tmp_path_factory.mktemp("imds") / "ready"
        server = subprocess.Popen(["ip", "netns", "exec", ec2_ns, sys.executable, str(HERE / "imds_standin.py"),
                                   str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert server.poll() is None, server.stderr.read().decode()
            assert time.monotonic() < deadline, "the IMDS stand-in did not start"
            time.sleep(0.1)
        yield node_ns
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        for ns in (node_ns, ec2_ns):  # deleting a namespace removes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_ns(ns: str, *argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=60, **kw)


def imds(ns: str, host: str = "169.254.169.254", *, uid: int | None = None, userns: bool = False) -> str:
    """What a process of ``uid`` (None: root) gets from IMDS: "CREDENTIALS <key id>" or "REFUSED <errno>"."""
    argv = [system_python(), "-c", CLIENT, host]
    if userns:  # "root" inside a user namespace, as enroot runs a container for its user
        argv = ["unshare", "--user", "--map-root-user", *argv]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
    started = time.monotonic()
    out = in_ns(ns, *argv)
    assert time.monotonic() - started < 10, "a refused call must fail at once, not time out"
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture(scope="module")
def node(netns, wheels) -> tuple[Cluster, str, str]:
    """The controller node booted inside the namespace with the real iptables (no stand-ins for
    them); and what a cluster user got from IMDS before the boot."""
    base = Path(tempfile.mkdtemp(prefix="sana-imds-node-"))
    bin_dir = make_standins(base / "standin-bin")
    for name in STANDINS:
        if name.startswith(("iptables", "ip6tables")):
            (bin_dir / name).unlink()
    c = Cluster(base, make_bundle(base / "bundle", wheels, package_hash="pkg0001"), bin_dir)
    root = c.prepare("controller-1")
    with open(root / "etc/passwd", "a") as f:  # the Slurm daemons' account on a HyperPod node
        f.write(f"slurm:x:{SERVICE_UID}:{SERVICE_UID}::/nonexistent:/usr/sbin/nologin\n")
    before = imds(netns, uid=RESEARCHER)
    env = c.env("controller-1", PATH=f"{bin_dir}:/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin")
    out = in_ns(netns, "bash", str(c.bundle / "on_init_complete.sh"), env=env, cwd=c.bundle)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    yield c, netns, before
    shutil.rmtree(base, ignore_errors=True)


def rules(ns: str) -> str:
    return "".join(in_ns(ns, tool, "-S").stdout for tool in ("iptables", "ip6tables"))


def test_only_root_and_system_services_reach_imds_after_boot(node):
    c, ns, before = node
    # The hole the step closes: before the boot, any uid took the node role's keys.
    assert before == "CREDENTIALS ASIASTANDINNODEROLE0"
    log = c.log("controller-1")
    assert "[imds] IMDS (iptables ip6tables) reachable only by uid 0 64030; rules in /usr/local/sbin/sana-imds-block" in log
    for host in ("169.254.169.254", "[fd00:ec2::254]"):
        assert imds(ns, host) == "CREDENTIALS ASIASTANDINNODEROLE0", host  # root: HyperPod's agents, SSM
        assert imds(ns, host, uid=SERVICE_UID) == "CREDENTIALS ASIASTANDINNODEROLE0", host
        for uid in USERS.values():
            assert imds(ns, host, uid=uid) == "REFUSED ECONNREFUSED", (host, uid, rules(ns))
        # A container's "root" is the user outside: still refused.
        assert imds(ns, host, uid=RESEARCHER, userns=True) == "REFUSED ECONNREFUSED", host


def test_rerun_converges_and_a_reboot_is_covered_by_the_boot_unit(node):
    c, ns, _ = node
    before = rules(ns)
    assert before.count("-j SANA-IMDS") == 2  # one OUTPUT jump per family
    env = c.env("controller-1", PATH=f"{c.standins}:/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin")
    again = in_ns(ns, "bash", str(c.bundle / "on_init_complete.sh"), env=env, cwd=c.bundle)
    assert again.returncode == 0, again.stdout[-3000:]
    assert rules(ns) == before

    # A reboot: the kernel forgets every rule, and the hole is open again ...
    for tool in ("iptables", "ip6tables"):
        assert in_ns(ns, "sh", "-c", f"{tool} -F OUTPUT && {tool} -F SANA-IMDS && {tool} -X SANA-IMDS").returncode == 0
    assert imds(ns, uid=RESEARCHER) == "CREDENTIALS ASIASTANDINNODEROLE0"
    # ... until the unit HyperPod's boot starts runs its script (the lifecycle does not run again).
    root = c.root("controller-1")
    unit = (root / "etc/systemd/system/sana-imds-block.service").read_text()
    assert "ExecStart=/usr/local/sbin/sana-imds-block\n" in unit and "Before=network-pre.target" in unit
    assert os.readlink(root / "etc/systemd/system/multi-user.target.wants/sana-imds-block.service") == \
        "../sana-imds-block.service"
    apply = root / "usr/local/sbin/sana-imds-block"
    assert apply.stat().st_uid == 0 and apply.stat().st_mode & 0o777 == 0o700
    assert in_ns(ns, "bash", str(apply)).returncode == 0
    assert rules(ns) == before
    assert imds(ns, uid=RESEARCHER) == "REFUSED ECONNREFUSED"
    assert imds(ns) == "CREDENTIALS ASIASTANDINNODEROLE0"


def test_a_node_without_iptables_fails_the_step_in_one_line(tmp_path):
    root = tmp_path / "node"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    bin_dir = tmp_path / "bin"  # the tools the step needs, but no iptables
    bin_dir.mkdir()
    for tool in ("bash", "awk", "date", "dirname", "basename", "mkdir", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    out = subprocess.run(["bash", str(HERE.parents[1] / "lifecycle_scripts/imds_block.sh")], capture_output=True,
                         text=True, env={"PATH": str(bin_dir), "PLATFORM_ROOT": str(root)}, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "ERROR: iptables is not installed on this node; it is part of every Ubuntu server image (the HyperPod "
        "AMI's base): without it any user could take the node's credentials from the instance metadata service"]
    assert not (root / "usr/local/sbin/sana-imds-block").exists()


def test_the_stand_in_answers_like_imdsv2(netns):
    """The stand-in refuses a GET without a session token (IMDSv2 required), as the real service does."""
    probe = ("import urllib.request, urllib.error\n"
             "try: urllib.request.urlopen('http://169.254.169.254/latest/meta-data/iam/security-credentials/', timeout=3)\n"
             "except urllib.error.HTTPError as e: print(e.code)\n")
    assert in_ns(netns, system_python(), "-c", probe).stdout.strip() == "401"
