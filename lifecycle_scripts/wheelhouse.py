"""The wheelhouse's lock file: written where the wheelhouse is built, checked on the node before pip runs.

A wheelhouse is one flat directory of wheels plus ``requirements.lock``, one pip hash-checking
line per wheel (https://pip.pypa.io/en/stable/topics/secure-installs/, "Hash-checking mode")::

    numpy==2.4.6 --hash=sha256:<hex>  # numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl

so ``pip install --no-index --find-links DIR --require-hashes -r DIR/requirements.lock`` installs
exactly those files and nothing else. stacks/wheelhouse.py writes it (``make wheelhouse``);
lifecycle_scripts/python_env.sh runs ``check`` first, so a wheel that is missing, altered or not the
one the deployed package names fails the env step in ONE line naming it, instead of pip's
multi-line resolver error.

Standard library only: it runs on the AMI's python3 before any env exists.

    python3 wheelhouse.py check DIR [--lock-sha256 HEX]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

LOCK = "requirements.lock"
MANIFEST = "wheelhouse.json"
# Wheel file names (PEP 427, binary distribution format): {name}-{version}(-{build})?-{python}-{abi}-{platform}.whl
WHEEL = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[A-Za-z0-9_.!+]+)(-\d[A-Za-z0-9_.]*)?"
                   r"-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+-[A-Za-z0-9_.]+\.whl$")
LOCK_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+) --hash=sha256:(?P<sha256>[0-9a-f]{64})"
                       r"\s+#\s+(?P<file>\S+\.whl)$")
CHUNK = 1 << 20


class LockError(ValueError):
    """A wheelhouse or lock that cannot be used; ``str()`` is one line."""


@dataclass(frozen=True)
class Entry:
    name: str
    version: str
    sha256: str
    file: str

    def line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}  # {self.file}"


def canonical(name: str) -> str:
    """PEP 503 normalized project name (``Jinja2`` -> ``jinja2``, ``hf_xet`` -> ``hf-xet``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def entry_for(wheel: Path) -> Entry:
    match = WHEEL.match(wheel.name)
    if not match:
        raise LockError(f"{wheel.name} is not a wheel file name (PEP 427 name-version-python-abi-platform.whl)")
    return Entry(name=canonical(match["name"]), version=match["version"], sha256=sha256_of(wheel), file=wheel.name)


def write_lock(directory: Path, header: str) -> str:
    """``DIR/requirements.lock`` for every wheel in DIR; returns the lock's sha256."""
    entries = sorted((entry_for(w) for w in directory.glob("*.whl")), key=lambda e: e.name)
    if not entries:
        raise LockError(f"{directory} holds no wheels")
    seen: dict[str, str] = {}
    for e in entries:
        if e.name in seen:
            raise LockError(f"{directory} holds two wheels of {e.name}: {seen[e.name]} and {e.file}")
        seen[e.name] = e.file
    text = "".join(f"# {line}\n" for line in header.splitlines()) + "".join(e.line() + "\n" for e in entries)
    (directory / LOCK).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def read_lock(path: Path) -> list[Entry]:
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip() or raw.startswith("#"):
            continue
        match = LOCK_LINE.match(raw)
        if not match:
            raise LockError(f"{path}:{number} is not a lock line (name==version --hash=sha256:HEX  # file.whl)")
        entries.append(Entry(**match.groupdict()))
    return entries


def check(directory: Path, *, lock_sha256: str | None = None) -> list[Entry]:
    """The lock's entries, after checking that every wheel it names is in DIR with its hash.

    Raises LockError (one line) for a missing lock, a lock other than ``lock_sha256``, and missing
    or altered wheels, naming them all.
    """
    lock = directory / LOCK
    if not lock.is_file():
        raise LockError(f"wheelhouse {directory} has no {LOCK}: it was not built by make wheelhouse or its "
                        "upload is incomplete; run make wheelhouse and redeploy the cluster stack")
    if lock_sha256 is not None:
        actual = hashlib.sha256(lock.read_bytes()).hexdigest()
        if actual != lock_sha256:
            raise LockError(f"wheelhouse {directory}: {LOCK} has sha256 {actual[:12]}, the deployed package names "
                            f"{lock_sha256[:12]}; redeploy the cluster stack so the wheelhouse and package match")
    entries = read_lock(lock)
    missing = [e.file for e in entries if not (directory / e.file).is_file()]
    if missing:
        raise LockError(f"wheelhouse {directory} lacks {len(missing)} of {len(entries)} wheels in {LOCK}: "
                        f"{', '.join(missing)}; rebuild it (make wheelhouse) and redeploy the cluster stack")
    altered = [e.file for e in entries if sha256_of(directory / e.file) != e.sha256]
    if altered:
        raise LockError(f"wheelhouse {directory}: {', '.join(altered)} do not match their sha256 in {LOCK}; "
                        "rebuild it (make wheelhouse) and redeploy the cluster stack")
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="every wheel of DIR/requirements.lock is in DIR with its hash")
    p.add_argument("directory", type=Path)
    p.add_argument("--lock-sha256", help="the lock's sha256 the deployed package names")
    args = parser.parse_args(argv)
    try:
        entries = check(args.directory, lock_sha256=args.lock_sha256)
    except LockError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"wheelhouse {args.directory}: {len(entries)} wheels, each present with its sha256")
    return 0


if __name__ == "__main__":
    sys.exit(main())
