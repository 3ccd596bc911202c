"""The pretend cluster's private-subnet curl (lifecycle_cluster.py STANDINS "curl") fails as the real curl
fails where the route table has no route out.

In a VPC subnet without a NAT or internet gateway the packets to a public address are dropped: the
node's curl sends SYNs that are never answered and gives up after ``--connect-timeout``, once per
attempt. Here the real curl runs in a network namespace of its own whose OUTPUT chain drops the
packets to the address github.com is made to resolve to (192.0.2.1, TEST-NET-1: RFC 5737), with
short timeouts; the stand-in, given the same arguments, must print the same lines (the elapsed
milliseconds aside) and exit with the same status, without waiting.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

URL = "https://github.com/prometheus/node_exporter/releases/download/v1.9.1/node_exporter-1.9.1.linux-amd64.tar.gz"
ARGS = ["-fsSL", "--retry", "1", "--retry-delay", "1", "--connect-timeout", "1", "-o", "/dev/null", URL]

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace with iptables needs root"),
    pytest.mark.skipif(not all(shutil.which(t) for t in ("unshare", "ip", "iptables", "curl")),
                       reason="needs unshare, ip, iptables and curl"),
]


def normalized(text: str) -> list[str]:
    return [re.sub(r"after \d+ ms", "after N ms", line) for line in text.splitlines() if line.startswith("curl: (")]


def test_the_standin_curl_fails_like_curl_without_a_route(standins, tmp_path):
    script = ("ip link set lo up && ip route add default dev lo && iptables -A OUTPUT -d 192.0.2.1 -j DROP && "
              f"exec /usr/bin/curl --resolve github.com:443:192.0.2.1 {' '.join(ARGS)}")
    real = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    standin = subprocess.run([str(standins / "curl"), *ARGS], capture_output=True, text=True, timeout=10,
                             env={"PATH": os.environ["PATH"], "STANDIN_PRIVATE_SUBNET": "1",
                                  "STANDIN_LOG": str(tmp_path / "calls.log")})
    assert real.returncode == 28, real.stderr
    assert (standin.returncode, normalized(standin.stderr)) == (real.returncode, normalized(real.stderr))
    assert normalized(real.stderr) == ["curl: (28) Failed to connect to github.com port 443 after N ms: "
                                       "Timeout was reached"] * 2
    assert (tmp_path / "calls.log").read_text().count("curl-attempt ") == 2  # one per attempt, as curl makes them
