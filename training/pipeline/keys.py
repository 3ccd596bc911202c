"""Content hashes: a stage's key, and the digests its run.json records.

A stage's key is the sha256 of what decides its output: its recipe section (resources left
out), the keys of the stages it reads, and the package hash. The key names the stage's
directory and job, so an unchanged recipe finds every stage where it left it, a changed
training override gets new train/export/report directories (precompute's key does not
move), and a failed stage is retried in the same directory (a training run resumes there).
Upstream stages enter by key rather than by a digest of their files: the key is known before
the upstream job has run, which is what lets the whole chain be submitted at once, and the
stage's run.json then records the digests of the files it actually read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

#: bump when the meaning of a key changes (every stage then runs again)
KEY_VERSION = "sana-pipeline-key/1"
#: hex digits of a key in job and directory names
SHORT = 12


def canonical(obj: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, floats as Python prints them."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def stage_key(stage: str, section: dict[str, Any], upstream: dict[str, str], package_hash: str) -> str:
    """The content hash of a stage (64 hex digits)."""
    return hashlib.sha256(canonical({"version": KEY_VERSION, "stage": stage, "section": section,
                                     "upstream": upstream, "package": package_hash})).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str], chunk: int = 8 * 1024**2) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tree_sha256(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path (names in ``skip`` left out)."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in skip}
