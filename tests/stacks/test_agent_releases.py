"""The deploy host's build step for a private cluster's observability agents (stacks/agent_releases.py,
``make wheelhouse`` / ``make agent-releases``), against releases served over HTTP on loopback.

The releases are stand-ins published as the projects publish them on GitHub
(tests/release_standins.py: ``<owner>/<repo>/releases/download/v<version>/``, each project's archive
layout and checksum file), served by a real HTTP server on 127.0.0.1 (the real ones are on
github.com, out of reach here); the build is the real one, with the pins pointed at that server. The
node's side of the same bundle is tests/lifecycle/test_observability_private.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stacks import agent_releases
from stacks.agent_releases import AgentReleaseError
from tests.release_standins import publish_agent_releases


class CountingHandler(SimpleHTTPRequestHandler):
    requests: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        CountingHandler.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def github(tmp_path: Path):
    """(base URL, pins, releases directory): stand-in releases served on 127.0.0.1."""
    dist = tmp_path / "releases"
    setting = publish_agent_releases(dist)
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(CountingHandler, directory=str(dist)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    CountingHandler.requests = []
    _base, pins = agent_releases.pins.load({"LIFECYCLE_AGENT_RELEASES": setting["LIFECYCLE_AGENT_RELEASES"]})
    yield f"http://127.0.0.1:{server.server_address[1]}", pins, dist
    server.shutdown()


def edit_pin(pins: dict, name: str, **changes) -> dict:
    return {**pins, name: dataclasses.replace(pins[name], **changes)}


def test_the_build_fetches_checks_locks_and_is_cached_by_the_pins(tmp_path, github):
    base, pins, dist = github
    bundle, downloaded = agent_releases.build(tmp_path / "root", releases=pins, base_url=base)
    assert downloaded and bundle.path == tmp_path / "root" / f"agents-{agent_releases.key(pins)}"
    assert bundle.prefix == f"wheelhouse/agents-{bundle.key}/"
    assert sorted(p.name for p in bundle.path.iterdir()) == sorted(
        [r.asset for r in pins.values()] + [agent_releases.LOCK, agent_releases.MANIFEST])
    # Each archive with its checksum file, nothing else.
    assert sorted(CountingHandler.requests) == sorted(
        p for r in pins.values() for p in (r.url(""), r.checksums_url("")))
    lock = json.loads((bundle.path / agent_releases.LOCK).read_text())["releases"]
    for name, release in pins.items():
        digest = hashlib.sha256((bundle.path / release.asset).read_bytes()).hexdigest()
        assert lock[name] == {"version": release.version, "asset": release.asset, "sha256": digest}
        # The node's check of the same archive against the same lock passes.
        entries = agent_releases.pins.read_lock(bundle.path / agent_releases.LOCK, bundle.lock_sha256)
        assert agent_releases.pins.verify(release, bundle.path / release.asset, lock=entries).endswith(
            "matches the agents lock")
    # Cached: the same pins download nothing again; a new pin is a new bundle beside the old one.
    CountingHandler.requests = []
    again, downloaded = agent_releases.build(tmp_path / "root", releases=pins, base_url=base)
    assert (again, downloaded) == (bundle, False) and CountingHandler.requests == []
    other = publish_agent_releases(tmp_path / "releases", {"slurm_exporter": "1.8.4"})
    _base, newer = agent_releases.pins.load({"LIFECYCLE_AGENT_RELEASES": other["LIFECYCLE_AGENT_RELEASES"]})
    rebuilt, downloaded = agent_releases.build(tmp_path / "root", releases=newer, base_url=base)
    assert downloaded and rebuilt.key != bundle.key and bundle.path.is_dir()


def test_an_archive_that_differs_from_the_release_checksum_file_stops_the_build_in_one_line(tmp_path, github):
    base, pins, dist = github
    release = pins["slurm_exporter"]
    folder = dist / release.repository / "releases/download" / f"v{release.version}"
    with (folder / release.asset).open("ab") as f:
        f.write(b"\0")
    with pytest.raises(AgentReleaseError) as err:
        agent_releases.build(tmp_path / "root", releases=pins, base_url=base)
    assert re.fullmatch(r"slurm_exporter 1\.8\.3: slurm_exporter-1\.8\.3-linux-amd64\.tar\.gz has sha256 [0-9a-f]{64}, "
                        r"not [0-9a-f]{64} as the release's slurm_exporter_checksums\.txt says", str(err.value))
    assert list((tmp_path / "root").iterdir()) == []  # nothing half-written, no bundle


def test_an_archive_that_differs_from_the_recorded_pin_stops_the_build(tmp_path, github):
    """The release's checksum file and archive agree, but not with the sha256 the pins record (a
    release replaced after the pin was taken)."""
    base, pins, _dist = github
    pins = edit_pin(pins, "node_exporter", sha256="0" * 64)
    with pytest.raises(AgentReleaseError, match=r"^node_exporter 1\.9\.1: node_exporter-1\.9\.1\.linux-amd64\.tar\.gz "
                                                r"has sha256 [0-9a-f]{64}, not 0{64} \(the recorded pin\)$"):
        agent_releases.build(tmp_path / "root", releases=pins, base_url=base)


def test_a_missing_release_or_binary_is_one_line_naming_it(tmp_path, github):
    base, pins, dist = github
    missing = edit_pin(pins, "prometheus", version="9.9.9")
    with pytest.raises(AgentReleaseError, match=r"^cannot download http://127\.0\.0\.1:\d+/prometheus/prometheus/"
                                                r"releases/download/v9\.9\.9/prometheus-9\.9\.9\.linux-amd64\.tar\.gz: "):
        agent_releases.build(tmp_path / "root", releases=missing, base_url=base)
    # A layout the pins get wrong is refused here, not on the node.
    flat = edit_pin(pins, "node_exporter", layout="goreleaser")
    published = pins["node_exporter"]
    folder = dist / published.repository / "releases/download" / f"v{published.version}"
    (folder / flat["node_exporter"].asset).write_bytes((folder / published.asset).read_bytes())
    checksums = (folder / published.checksums).read_text()
    (folder / published.checksums).write_text(checksums + checksums.splitlines()[-1].replace(
        published.asset, flat["node_exporter"].asset) + "\n")
    with pytest.raises(AgentReleaseError, match=r"^node_exporter 1\.9\.1: node_exporter-1\.9\.1-linux-amd64\.tar\.gz "
                                                r"lacks node_exporter \(it holds node_exporter-1\.9\.1\.linux-amd64"):
        agent_releases.build(tmp_path / "root", releases=flat, base_url=base)
    assert not [p for p in (tmp_path / "root").iterdir() if p.name.startswith("agents-")]


def test_the_real_pins_are_what_the_node_step_and_the_mirror_use():
    """One table: the versions the nodes check and the archives' names, as the projects name them."""
    pins = agent_releases.RELEASES
    assert pins["node_exporter"].asset == "node_exporter-1.9.1.linux-amd64.tar.gz"
    assert pins["node_exporter"].members == ("node_exporter-1.9.1.linux-amd64/node_exporter",)
    assert pins["prometheus"].members == ("prometheus-2.53.4.linux-amd64/prometheus",
                                          "prometheus-2.53.4.linux-amd64/promtool")
    assert pins["slurm_exporter"].url() == ("https://github.com/SckyzO/slurm_exporter/releases/download/v1.8.3/"
                                            "slurm_exporter-1.8.3-linux-amd64.tar.gz")
    assert pins["slurm_exporter"].sha256 is None  # no public record: the release's checksum file and the lock
    assert {n for n, r in pins.items() if r.sha256} == {"node_exporter", "prometheus"}
    assert agent_releases.DCGM_EXPORTER.reference("123456789012.dkr.ecr.eu-west-1.amazonaws.com",
                                                  "sana/dcgm-exporter") == (
        "123456789012.dkr.ecr.eu-west-1.amazonaws.com/sana/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04")


def test_a_private_cluster_without_the_bundle_stops_synth_in_one_line(tmp_path):
    from stacks.config import ConfigError
    from stacks.platform import build_app
    from tests.stacks.conftest import stand_in_wheelhouse

    for kind in ("gpu", "neuron"):
        stand_in_wheelhouse(tmp_path / "root", kind)
    with pytest.raises(ConfigError) as err:
        build_app({"privateNetwork": "true"}, outdir=str(tmp_path / "out"), wheelhouse_root=tmp_path / "root")
    assert "\n" not in str(err.value)
    assert re.fullmatch(r"invalid context value privateNetwork=True: the nodes' observability agents cannot come from "
                        r"GitHub: no observability agent releases for the current pins at \S+/agents-[0-9a-f]{16}: run "
                        r"`make wheelhouse` \(it fetches them from GitHub with the wheels; `make agent-releases` alone\); "
                        r"or set observability=false", str(err.value)), str(err.value)
    # Without observability there is nothing to fetch: the same wheelhouses synthesize.
    build_app({"privateNetwork": "true", "observability": "false"}, outdir=str(tmp_path / "out2"),
              wheelhouse_root=tmp_path / "root")
