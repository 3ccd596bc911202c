#!/usr/bin/env python3
"""The observability agents' pinned releases: version AND sha256, one table for the build host and the nodes.

The observability step (observability.sh) installs three release archives and, on GPU nodes, one
container image. Each is pinned here, and each archive is checked against a sha256 before a binary
from it runs:

- a public cluster downloads the archive from the project's GitHub release, as before, and checks
  it against the sha256 recorded below; where none is recorded, against the project's own
  checksum file of that release (downloaded beside it);
- a private cluster (``privateNetwork``: no route to github.com) never downloads from GitHub:
  ``make wheelhouse`` fetched the archives on the deploy host (stacks/agent_releases.py), checked
  them the same way, and wrote ``agents.lock`` (the sha256 of every archive it fetched); the cluster
  stack uploaded them beside the wheelhouses and names the lock's own sha256 in
  platform-settings.json, so the node checks the lock, then each archive against it.

Checksum files, as the projects publish them: prometheus/promu ``checksum`` writes
``sha256sums.txt`` with ``"%x  %s\\n"`` lines (prometheus/promu cmd/checksum.go) and packs
``<name>-<version>.<os>-<arch>.tar.gz`` holding ``<name>-<version>.<os>-<arch>/<binary>``
(cmd/tarball.go); GoReleaser writes ``"<sha256>  <file>\\n"`` lines into the file its
``checksum.name_template`` names (goreleaser/goreleaser internal/pipe/checksums/checksums.go) and,
without ``wrap_in_directory``, packs the binary at the archive's top.

Standard library only: it runs on the AMI's python3 (3.10 on Ubuntu 22.04) before any env exists.

    python3 agent_releases.py spec NAME           # one line: version url checksums_url asset sha256|- member...
    python3 agent_releases.py verify NAME ARCHIVE [--lock FILE --lock-sha256 HEX] [--checksums FILE]
    python3 agent_releases.py lock FILE --lock-sha256 HEX
    python3 agent_releases.py dcgm-image [--registry REGISTRY --repository REPOSITORY]

``LIFECYCLE_AGENT_RELEASES`` (tests only, like the other ``LIFECYCLE_*`` settings): a JSON file
replacing the table, with ``base_url`` and ``releases`` (name -> the Release fields).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

LOCK = "agents.lock"
#: Bump when the lock's format or the build recipe changes (a new key for every bundle).
RECIPE = 1
GITHUB = "https://github.com"
LAYOUTS = ("promu", "goreleaser")
#: The nodes' architecture: HyperPod's instance types are x86_64 (as the wheelhouse's target).
ARCH = "amd64"
SHA256 = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 20


class AgentReleaseError(ValueError):
    """An archive or lock that cannot be trusted; ``str()`` is one line naming it."""


@dataclass(kw_only=True, frozen=True)
class Release:
    """One pinned release archive of a GitHub project, for linux-amd64."""

    name: str
    version: str
    repository: str
    """GitHub owner/name."""
    layout: str
    """How the project packs its archives: "promu" or "goreleaser" (module docstring)."""
    checksums: str
    """The checksum file of the release, as the project names it."""
    binaries: tuple[str, ...] = ()
    """What is installed from the archive (default: the binary called ``name``)."""
    sha256: str | None = None
    """The archive's sha256 as recorded from a public source, or None when none was found."""
    sha256_source: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z_]+", self.name) or not re.fullmatch(r"\d+\.\d+\.\d+", self.version):
            raise ValueError(f"release {self.name!r} {self.version!r}: expected a lower-case name and X.Y.Z")
        if self.layout not in LAYOUTS:
            raise ValueError(f"release {self.name}: layout {self.layout!r} not one of {LAYOUTS}")
        if self.sha256 is not None and not SHA256.fullmatch(self.sha256):
            raise ValueError(f"release {self.name}: sha256 {self.sha256!r} is not 64 hex digits")
        if self.sha256 is not None and not self.sha256_source:
            raise ValueError(f"release {self.name}: a recorded sha256 needs its sha256_source")
        if not self.binaries:
            object.__setattr__(self, "binaries", (self.name,))

    @property
    def asset(self) -> str:
        separator = "." if self.layout == "promu" else "-"
        return f"{self.name}-{self.version}{separator}linux-{ARCH}.tar.gz"

    @property
    def members(self) -> tuple[str, ...]:
        """The archive paths of ``binaries``."""
        top = f"{self.name}-{self.version}.linux-{ARCH}/" if self.layout == "promu" else ""
        return tuple(top + b for b in self.binaries)

    def url(self, base: str = GITHUB) -> str:
        return f"{base}/{self.repository}/releases/download/v{self.version}/{self.asset}"

    def checksums_url(self, base: str = GITHUB) -> str:
        return f"{base}/{self.repository}/releases/download/v{self.version}/{self.checksums}"


_BOXCUTTER = "boxcutter/oci prometheus/{}/docker-bake.hcl (and other public pins of the same release)"
RELEASES: dict[str, Release] = {r.name: r for r in (
    Release(name="node_exporter", version="1.9.1", repository="prometheus/node_exporter", layout="promu",
            checksums="sha256sums.txt",
            sha256="becb950ee80daa8ae7331d77966d94a611af79ad0d3307380907e0ec08f5b4e8",
            sha256_source=_BOXCUTTER.format("node-exporter")),
    Release(name="prometheus", version="2.53.4", repository="prometheus/prometheus", layout="promu",
            checksums="sha256sums.txt", binaries=("prometheus", "promtool"),
            sha256="b8b497c4610d1b93208252b60c8f20f6b2e78596ae8df43397a2e805aa53d475",
            sha256_source=_BOXCUTTER.format("prometheus")),
    # sckyzo/slurm_exporter has no v1.6.1 (its tags go v1.6.0, v1.7.0 ... v1.8.4); 1.8.3 is the last
    # release its changelog (https://github.com/SckyzO/slurm_exporter/blob/main/CHANGELOG.md) records. No public source records this archive's sha256: the build
    # step and public nodes check it against the release's slurm_exporter_checksums.txt
    # (.goreleaser.yaml checksum.name_template), and the build step's lock records it.
    Release(name="slurm_exporter", version="1.8.3", repository="SckyzO/slurm_exporter", layout="goreleaser",
            checksums="slurm_exporter_checksums.txt"),
)}


@dataclass(kw_only=True, frozen=True)
class Image:
    """A container image pinned by tag, and the repository a private cluster mirrors it into."""

    source: str
    tag: str
    repository: str
    """The repository's name under the platform's prefix in this account's ECR (stacks/images.py)."""

    def reference(self, registry: str = "", repository_path: str = "") -> str:
        """The upstream image, or its mirror ``<registry>/<repository_path>:<tag>`` (repository_path: the
        repository's full name, ``<project prefix>/<repository>``, stacks/images.py)."""
        if not registry:
            return f"{self.source}:{self.tag}"
        return f"{registry}/{repository_path or self.repository}:{self.tag}"


#: NVIDIA's DCGM exporter (NGC), run under docker on GPU nodes.
DCGM_EXPORTER = Image(source="nvcr.io/nvidia/k8s/dcgm-exporter", tag="3.3.9-3.6.1-ubuntu22.04",
                      repository="dcgm-exporter")


def load(environ: dict[str, str] | None = None) -> tuple[str, dict[str, Release]]:
    """(base URL, releases): the table above, or the tests' replacement (LIFECYCLE_AGENT_RELEASES)."""
    path = (environ if environ is not None else os.environ).get("LIFECYCLE_AGENT_RELEASES", "")
    if not path:
        return GITHUB, RELEASES
    data = json.loads(Path(path).read_text())
    releases = {name: Release(name=name, **{k: tuple(v) if k == "binaries" else v for k, v in fields.items()})
                for name, fields in data["releases"].items()}
    return data.get("base_url", GITHUB), releases


def pins_json(releases: dict[str, Release]) -> str:
    """The canonical text of the pins (what a bundle's key hashes)."""
    return json.dumps({n: dataclasses.asdict(r) for n, r in sorted(releases.items())}, sort_keys=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_entry(text: str, asset: str) -> str:
    """The sha256 a checksum file (``<hex>  <file>`` lines, sha256sum's format) gives ``asset``."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == asset and SHA256.fullmatch(parts[0].lower()):
            return parts[0].lower()
    raise AgentReleaseError(f"the release's checksum file lists no sha256 for {asset}")


def write_lock(directory: Path, releases: dict[str, Release], sha256s: dict[str, str]) -> str:
    """``agents.lock`` for the archives in ``directory``; returns the lock's own sha256."""
    entries = {name: {"version": r.version, "asset": r.asset, "sha256": sha256s[name]}
               for name, r in sorted(releases.items())}
    path = directory / LOCK
    path.write_text(json.dumps({"recipe": RECIPE, "releases": entries}, indent=2, sort_keys=True) + "\n")
    return sha256_of(path)


def read_lock(path: Path, lock_sha256: str) -> dict[str, dict[str, str]]:
    """The lock's entries, after checking it is the lock the deployed package names."""
    if not path.is_file():
        raise AgentReleaseError(f"{path} is missing")
    found = sha256_of(path)
    if found != lock_sha256:
        raise AgentReleaseError(f"{path} has sha256 {found}, not {lock_sha256} as platform-settings.json names it")
    return json.loads(path.read_text())["releases"]


def verify(release: Release, archive: Path, *, lock: dict[str, dict[str, str]] | None = None,
           checksums: Path | None = None) -> str:
    """One line saying what ``archive``'s sha256 matched; AgentReleaseError (one line) otherwise."""
    label = f"{release.name} {release.version}"
    found = sha256_of(archive)
    if lock is not None:
        entry = lock.get(release.name)
        if entry is None or entry.get("version") != release.version or entry.get("asset") != release.asset:
            raise AgentReleaseError(f"{label}: the agents lock names {entry!r}, not {release.asset} (a bundle built "
                                    "for other pins)")
        if release.sha256 is not None and entry["sha256"] != release.sha256:
            raise AgentReleaseError(f"{label}: the agents lock records sha256 {entry['sha256']}, not the recorded "
                                    f"{release.sha256}")
        expected, source = entry["sha256"], "the agents lock"
    elif release.sha256 is not None:
        expected, source = release.sha256, "the recorded pin"
    elif checksums is not None:
        expected = checksum_entry(checksums.read_text(errors="replace"), release.asset)
        source = f"the release's {release.checksums}"
    else:
        raise AgentReleaseError(f"{label}: no recorded sha256 and no checksum file to check {archive.name} against")
    if found != expected:
        raise AgentReleaseError(f"{label}: {archive.name} has sha256 {found}, not {expected} ({source})")
    return f"{label}: sha256 {found} matches {source}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent_releases.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("spec", help="the pinned release of NAME as one shell-readable line")
    s.add_argument("name")
    v = sub.add_parser("verify", help="check an archive's sha256 (lock, recorded pin or checksum file)")
    v.add_argument("name")
    v.add_argument("archive", type=Path)
    v.add_argument("--lock", type=Path)
    v.add_argument("--lock-sha256", default="")
    v.add_argument("--checksums", type=Path)
    lk = sub.add_parser("lock", help="check a fetched agents lock against the sha256 the package names")
    lk.add_argument("lock", type=Path)
    lk.add_argument("--lock-sha256", required=True)
    d = sub.add_parser("dcgm-image", help="the DCGM exporter image: upstream, or its mirror in a registry")
    d.add_argument("--registry", default="")
    d.add_argument("--repository", default="")
    args = parser.parse_args(argv)
    if args.command == "dcgm-image":
        print(DCGM_EXPORTER.reference(args.registry, args.repository))
        return 0
    if args.command == "lock":
        try:
            entries = read_lock(args.lock, args.lock_sha256)
        except (AgentReleaseError, OSError, ValueError, KeyError) as err:
            print(str(err) or type(err).__name__, file=sys.stderr)
            return 1
        listed = ", ".join(f"{name} {entry['version']}" for name, entry in sorted(entries.items()))
        print(f"{args.lock.name}: {listed}")
        return 0
    base, releases = load()
    release = releases.get(args.name)
    if release is None:
        print(f"no pinned release called {args.name!r}; the pins are {', '.join(sorted(releases))}", file=sys.stderr)
        return 2
    if args.command == "spec":
        print(release.version, release.url(base), release.checksums_url(base), release.asset, release.sha256 or "-",
              *release.members)
        return 0
    try:
        lock = read_lock(args.lock, args.lock_sha256) if args.lock else None
        print(verify(release, args.archive, lock=lock, checksums=args.checksums))
    except (AgentReleaseError, OSError, ValueError, KeyError) as err:
        print(str(err).splitlines()[0] if str(err) else type(err).__name__, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
