"""The observability agents' release archives for a private cluster, fetched and checked on the deploy host.

A private cluster's nodes have no route to github.com, so the archives the observability step
installs (node exporter, Slurm exporter, Prometheus in agent mode: the pins of
lifecycle_scripts/agent_releases.py) are fetched here, where the internet is reachable, by
``make wheelhouse`` (or ``make agent-releases`` alone):

    python -m stacks.agent_releases build

Each archive is downloaded from its GitHub release with the release's checksum file; it must match
that file's entry AND the sha256 the pins record (where one is recorded), or the build stops in
one line naming it. Its binaries must be where the pins say. The checked archives and
``agents.lock`` (each archive's sha256) go to ``build/wheelhouse/agents-<key>/`` beside the env
wheelhouses; ``<key>`` hashes the pins, so an unchanged set is never downloaded again and a new
pin lands beside the old one.

The cluster stack uploads the bundle to ``s3://<lifecycle bucket>/wheelhouse/agents-<key>/`` (the
wheelhouses' upload, stacks/wheelhouse_upload.py) and names it with the lock's sha256 in
platform-settings.json (``observability.agents``); lifecycle_scripts/observability.sh fetches the
archives it needs from there through the S3 gateway endpoint and checks each against the lock.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from stacks.wheelhouse import ROOT, load_lifecycle_module

REPO = Path(__file__).resolve().parents[1]
MANIFEST = "agents.json"
KIND = "agents"
TIMEOUT_S = 60


pins = load_lifecycle_module("agent_releases.py", "sana_agent_releases")
Release, RELEASES, DCGM_EXPORTER, LOCK = pins.Release, pins.RELEASES, pins.DCGM_EXPORTER, pins.LOCK
AgentReleaseError = pins.AgentReleaseError


@dataclass(kw_only=True, frozen=True)
class AgentBundle:
    """A built bundle: the archives and their lock (uploaded like a wheelhouse)."""

    key: str
    path: Path
    lock_sha256: str
    bytes: int

    @property
    def prefix(self) -> str:
        """Where the cluster stack uploads it in the lifecycle bucket (beside the wheelhouses)."""
        return f"wheelhouse/{KIND}-{self.key}/"

    def settings(self) -> dict[str, str]:
        """Its entry in platform-settings.json ``observability.agents`` (lifecycle_scripts/settings.sh)."""
        return {"prefix": self.prefix, "lock_sha256": self.lock_sha256}

    def upload_parts(self, max_bytes: int = 0) -> list[list[str]]:
        """One part: the archives are tens of MB together (stacks/wheelhouse_upload.py's interface)."""
        return [sorted(p.name for p in self.path.iterdir())]


def key(releases: dict | None = None) -> str:
    """16 hex digits of the pins and the recipe."""
    text = pins.pins_json(releases if releases is not None else RELEASES) + f"\0recipe={pins.RECIPE}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def location(root: Path = ROOT, releases: dict | None = None) -> Path:
    return root / f"{KIND}-{key(releases)}"


def load(root: Path = ROOT, releases: dict | None = None) -> AgentBundle:
    """The built bundle for the current pins; AgentReleaseError (one line) if absent."""
    path = location(root, releases)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise AgentReleaseError(f"no observability agent releases for the current pins at {path}: run `make wheelhouse` "
                                "(it fetches them from GitHub with the wheels; `make agent-releases` alone)")
    data = json.loads(manifest.read_text())
    return AgentBundle(key=data["key"], path=path, lock_sha256=data["lock_sha256"], bytes=data["bytes"])


def _fetch(url: str, dest: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, dest.open("wb") as out:
            shutil.copyfileobj(response, out)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", None) or getattr(err, "code", None) or err
        raise AgentReleaseError(f"cannot download {url}: {reason}") from None


def check_members(release: Release, archive: Path) -> None:
    """The pins' binaries are in the archive, where the pins say (a changed layout stops the build here,
    not on the node)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            names = set(tar.getnames())
    except (tarfile.TarError, OSError) as err:
        raise AgentReleaseError(f"{release.name} {release.version}: {archive.name} is not a gzip tar archive ({err})") from None
    missing = [m for m in release.members if m not in names]
    if missing:
        raise AgentReleaseError(f"{release.name} {release.version}: {archive.name} lacks {', '.join(missing)} "
                                f"(it holds {', '.join(sorted(names)[:6])}); fix the layout in lifecycle_scripts/agent_releases.py")


def build(root: Path = ROOT, *, releases: dict | None = None, base_url: str = pins.GITHUB) -> tuple[AgentBundle, bool]:
    """(the bundle, whether it was downloaded now): cached by the pins' key."""
    releases = releases if releases is not None else RELEASES
    try:
        return load(root, releases), False
    except AgentReleaseError:
        pass
    root.mkdir(parents=True, exist_ok=True)
    incoming = Path(tempfile.mkdtemp(dir=root, prefix=f".incoming-{KIND}-"))
    try:
        sha256s = {}
        for name, release in sorted(releases.items()):
            archive, checksums = incoming / release.asset, incoming / f".{name}-{release.checksums}"
            _fetch(release.url(base_url), archive)
            _fetch(release.checksums_url(base_url), checksums)
            published = pins.checksum_entry(checksums.read_text(errors="replace"), release.asset)
            found = pins.sha256_of(archive)
            if found != published:
                raise AgentReleaseError(f"{release.name} {release.version}: {release.asset} has sha256 {found}, not "
                                        f"{published} as the release's {release.checksums} says")
            if release.sha256 is not None:
                pins.verify(release, archive)  # and the sha256 the pins record
            check_members(release, archive)
            checksums.unlink()
            sha256s[name] = found
        return finish(incoming, releases=releases, sha256s=sha256s, root=root), True
    finally:
        shutil.rmtree(incoming, ignore_errors=True)


def finish(incoming: Path, *, releases: dict, sha256s: dict[str, str], root: Path = ROOT) -> AgentBundle:
    """Lock + manifest for the checked archives in ``incoming``, then rename it into place (complete or absent)."""
    lock_sha256 = pins.write_lock(incoming, releases, sha256s)
    k = key(releases)
    files = sorted(incoming.iterdir())
    manifest = {"key": k, "lock_sha256": lock_sha256, "bytes": sum(f.stat().st_size for f in files),
                "releases": {n: {"version": r.version, "asset": r.asset} for n, r in sorted(releases.items())}}
    (incoming / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    incoming.chmod(0o755)
    os.rename(incoming, root / f"{KIND}-{k}")
    return load(root, releases)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacks.agent_releases", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download and check the pinned agent releases (cached by the pins)")
    b.add_argument("--root", type=Path, default=ROOT, help="where bundles are kept (default build/wheelhouse)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        bundle, downloaded = build(args.root)
    except AgentReleaseError as err:
        print(f"error: make agent-releases: {err}", file=sys.stderr)
        return 1
    how = f"downloaded and checked in {time.monotonic() - started:.0f}s" if downloaded else "cached"
    print(f"agent releases {KIND}-{bundle.key}: {', '.join(f'{r.name} {r.version}' for r in RELEASES.values())}, "
          f"{bundle.bytes / 2**20:.0f} MiB, {how}: {bundle.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
