"""On-disk layout of a checkpoint: names, durable writes, the manifest, and discovery.

Two formats share one rule: a checkpoint is written into ``.tmp-step-XXXXXXXX`` beside its
final name, every file is fsynced, ``manifest.json`` goes in last and the directory is renamed
into place (then the parent is fsynced), so a crash at any instant leaves either a complete
``step-*`` or a temp directory that ``find_latest`` never looks at. ``commit_dir`` never
deletes an older copy of the same step before the new one is in place, and
``recover_temp_dirs`` (every start) finishes the rename of a temp directory whose manifest
is complete and deletes only incomplete ones.

- ``sana-checkpoint/1`` (``checkpoint.format: full``): rank 0 wrote the full state
  (``model.safetensors``, ``optimizer.pt``, ``ema.safetensors``); still read everywhere.
- ``sana-checkpoint/2`` (``checkpoint.format: sharded``, the default): each rank writes its
  rows of every tensor (``shard-rank-XXXXX.safetensors``) and its RNG, hashing the bytes as
  they go out, then ``rank-XXXXX.done.json``; rank 0 merges the done records into the
  manifest (training/checkpoint/sharded.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger("training.checkpoint")

FORMAT = "sana-checkpoint/1"
FORMAT_SHARDED = "sana-checkpoint/2"
FORMATS = (FORMAT, FORMAT_SHARDED)
MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
EMA_FILE = "ema.safetensors"
STATE_FILE = "train_state.json"
RNG_FILE = "rng.pt"
STEP_RE = re.compile(r"^step-(\d{8})$")
TMP_PREFIX = ".tmp-step-"
#: temp dirs that become ``step-XXXXXXXX`` once complete: a save's, or an S3 fetch's (mirror.py)
TMP_RE = re.compile(r"^\.tmp-(?:fetch-)?step-(\d{8})$")
#: where ``commit_dir`` moves the older copy of a step while the new one is renamed in
REPLACED_PREFIX = ".tmp-replaced-"
#: test hook: ``<step>:<point>[:<rank>][:enospc]`` SIGKILLs (or fails with ENOSPC) the process
#: at that point of that step's save, on every rank or only on ``<rank>`` (see fault_point).
FAULT_ENV = "SANA_CHECKPOINT_FAULT"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_file(rank: int) -> str:
    return f"shard-rank-{rank:05d}.safetensors"


def rank_rng_file(rank: int) -> str:
    return f"rng-rank-{rank:05d}.pt"


def done_file(rank: int) -> str:
    return f"rank-{rank:05d}.done.json"


def failed_file(rank: int) -> str:
    return f"rank-{rank:05d}.failed.json"


def sha256_file(path: Path, chunk: int = 8 * 1024**2) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


class HashingWriter:
    """A binary file that hashes what is written through it, so nobody re-reads a shard to
    checksum it; ``close`` fsyncs and returns the manifest entry (size, sha256)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._digest = hashlib.sha256()
        self._size = 0

    def write(self, data: bytes | memoryview) -> int:
        self._digest.update(data)
        self._size += len(data)
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> dict[str, Any]:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return {"size": self._size, "sha256": self._digest.hexdigest()}

    def abort(self) -> None:
        self._fh.close()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    # NOTE: a rename is only durable once the directory holding it is fsynced (POSIX rename(2)).
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> dict[str, Any]:
    """Write + fsync; returns the manifest entry of the file."""
    out = HashingWriter(path)
    out.write(json.dumps(obj, indent=1, sort_keys=True, allow_nan=True).encode())
    return out.close()


def publish_json(path: Path, obj: Any) -> dict[str, Any]:
    """``write_json`` under a temp name, then renamed to ``path``: a reader listing the
    directory (rank 0 waiting for done records, possibly on another node) sees the record
    whole or not at all."""
    part = path.with_name(f".{path.name}.part")
    entry = write_json(part, obj)
    os.replace(part, path)
    return entry


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` into place as ``final``.

    An older ``final`` (an earlier attempt at the same step: another run in this root, a
    fetch over a local copy) is renamed aside to ``.tmp-replaced-<name>`` first and deleted
    only once the new one is in place. rename(2) cannot swap two non-empty directories, so
    for an instant no ``final`` exists; a crash there leaves the complete ``tmp``, which
    ``recover_temp_dirs`` renames into place at the next start (the temp dir always holds
    the newer attempt, so recovery is never ambiguous). Nothing is ever lost to a crash:
    before, ``rmtree(final)`` then ``replace`` lost both copies if the process died between.
    """
    root = final.parent
    if not final.exists():
        os.replace(tmp, final)
        fsync_dir(root)
        return
    old = root / f"{REPLACED_PREFIX}{final.name}"
    if old.exists():
        shutil.rmtree(old)
    os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def recover_temp_dirs(root: Path) -> list[Path]:
    """Every start, before anything reads ``root``: finish what a crash interrupted.

    A ``.tmp-step-X`` (or ``.tmp-fetch-step-X``) whose manifest is complete (every file
    present with its size; the manifest is written only after every rank's files were
    fsynced) and names step X is renamed into place as ``step-X``, as the crashed commit
    would have. Everything else starting ``.tmp-`` (incomplete temp dirs, the older copy
    ``commit_dir`` set aside, failure records) is deleted. Returns the finished checkpoints.
    """
    finished: list[Path] = []
    if not root.is_dir():
        return finished
    for entry in sorted(root.glob(".tmp-*")):
        match = TMP_RE.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():
            manifest = verify(entry, full=False)
            if manifest is not None and manifest.get("step") == int(match.group(1)):
                final = root / step_dir_name(int(match.group(1)))
                commit_dir(entry, final)
                log.warning("finished the commit of %s: %s held a complete manifest", final, entry.name)
                finished.append(final)
                continue
        log.info("removing %s (left incomplete by a run killed mid-write)", entry)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return finished


def fault_point(step: int, point: str, rank: int = 0) -> None:
    """Test hook: ``SANA_CHECKPOINT_FAULT=<step>:<point>[:<rank>][:enospc]`` SIGKILLs this
    process right here (``enospc`` raises "No space left on device" instead), on every rank
    that gets here or only on ``<rank>``.

    SIGKILL (not an exception) so nothing gets to clean up: exactly what a node loss or the
    OOM killer does to a real run in the middle of a checkpoint write.
    """
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    parts = want.split(":")
    if len(parts) < 2 or parts[0] != str(step) or parts[1] != point:
        return
    extra = parts[2:]
    ranks = [int(p) for p in extra if p.isdigit()]
    if ranks and rank not in ranks:
        return
    if "enospc" in extra:  # a full disk instead of a dead process
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    log.warning("checkpoint fault hook: SIGKILL at step %d, %s (rank %d)", step, point, rank)
    os.kill(os.getpid(), signal.SIGKILL)


# ----- manifests and discovery ------------------------------------------------------------
def read_manifest(ckpt_dir: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((Path(ckpt_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS or not isinstance(
            manifest.get("files"), dict):
        return None
    return manifest


def verify(ckpt_dir: str | Path, *, full: bool = True) -> dict[str, Any] | None:
    """The manifest if ``ckpt_dir`` is a complete checkpoint, else None.

    ``full`` also re-hashes every file (catches bit rot and a same-size torn copy); without it
    only presence and sizes are checked, which is cheap enough to scan a whole root.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)
    if manifest is None:
        return None
    for name, meta in manifest["files"].items():
        path = ckpt_dir / name
        try:
            if path.stat().st_size != meta["size"]:
                return None
        except OSError:
            return None
        if full and sha256_file(path) != meta["sha256"]:
            log.warning("checkpoint %s: %s does not match its sha256 in the manifest", ckpt_dir, name)
            return None
    return manifest


def list_complete(root: str | Path) -> list[tuple[int, Path]]:
    """Complete (manifest present, sizes right) checkpoints under ``root``, oldest first."""
    root = Path(root)
    found: list[tuple[int, Path]] = []
    if not root.is_dir():
        return found
    for child in root.iterdir():
        match = STEP_RE.match(child.name)
        if match and child.is_dir() and verify(child, full=False) is not None:
            found.append((int(match.group(1)), child))
    return sorted(found)


def find_latest(root: str | Path, *, full: bool = True) -> Path | None:
    """Newest complete checkpoint under ``root``; partial ones (no manifest, wrong sizes, temp
    dirs, and with ``full`` a sha256 mismatch) are skipped with a warning, never picked."""
    for _, path in reversed(list_complete(root)):
        if not full or verify(path, full=True) is not None:
            return path
        log.warning("skipping checkpoint %s: its files do not match its manifest", path)
    return None
