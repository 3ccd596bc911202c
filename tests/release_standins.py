"""Stand-in GitHub releases of the observability agents: what the nodes (tests/lifecycle) and the deploy
host's build step (tests/stacks/test_agent_releases.py) fetch instead of github.com."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tarfile
from pathlib import Path


def publish_agent_releases(dist: Path, versions: dict[str, str] | None = None, *,
                           record: tuple[str, ...] = ("node_exporter", "prometheus"),
                           base_url: str | None = None) -> dict[str, str]:
    """Stand-ins of the release archives the observability step installs, published under ``dist`` as
    the projects publish them on GitHub: ``<owner>/<repo>/releases/download/v<version>/`` holding the
    archive in the project's layout (lifecycle_scripts/agent_releases.py: promu's top directory,
    GoReleaser's flat archive with README.md and LICENSE) and the release's checksum file
    (``<sha256>  <file>`` lines, with another platform's archive listed too). Each binary answers
    ``--version`` in the real programs' format ("<name>, version X.Y.Z (branch: ..., revision: ...)");
    promtool is the real one (Debian's), so the collector's configuration is checked for real.

    Returns the LIFECYCLE_AGENT_RELEASES setting: the pins (the real repositories, layouts and
    checksum files; ``versions`` overrides), served from ``dist`` as file:// (or ``base_url``), with
    the sha256 recorded for the names in ``record`` (the real pins record node_exporter's and
    prometheus's, not slurm_exporter's)."""
    from stacks.agent_releases import RELEASES, Release

    releases = {}
    for name, real in RELEASES.items():
        release = Release(**{**dataclasses.asdict(real), "version": (versions or {}).get(name, real.version),
                             "sha256": None, "sha256_source": ""})
        folder = dist / release.repository / "releases/download" / f"v{release.version}"
        tree = folder / f".{name}-tree"
        for member, binary in zip(release.members, release.binaries, strict=True):
            path = tree / member
            path.parent.mkdir(parents=True, exist_ok=True)
            if binary == "promtool":
                path.write_text('#!/bin/sh\nexec /usr/bin/promtool "$@"\n')
            else:
                path.write_text(f'#!/bin/sh\n# stand-in for {binary} {release.version}\n'
                                f'case "$1" in --version) echo "{binary}, version {release.version} (branch: HEAD, '
                                f'revision: 0000000)"; echo "  build user: stand-in";; *) exit 0;; esac\n')
            path.chmod(0o755)
        if release.layout == "goreleaser":
            (tree / "README.md").write_text(f"# {name} (stand-in)\n")
            (tree / "LICENSE").write_text("stand-in\n")
        with tarfile.open(folder / release.asset, "w:gz") as tar:
            for entry in sorted(tree.iterdir()):
                tar.add(entry, arcname=entry.name)
        shutil.rmtree(tree)
        digest = hashlib.sha256((folder / release.asset).read_bytes()).hexdigest()
        other = release.asset.replace("linux-amd64", "darwin-arm64")
        (folder / release.checksums).write_text(f"{'0' * 64}  {other}\n{digest}  {release.asset}\n")
        releases[name] = {**{k: list(v) if isinstance(v, tuple) else v
                             for k, v in dataclasses.asdict(release).items() if k != "name"},
                          "sha256": digest if name in record else None,
                          "sha256_source": "tests/lifecycle stand-in" if name in record else ""}
    pins = dist / "agent-releases.json"
    pins.write_text(json.dumps({"base_url": base_url or dist.as_uri(), "releases": releases}, indent=2))
    return {"LIFECYCLE_AGENT_RELEASES": str(pins)}
