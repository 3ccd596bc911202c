"""A full disk (or quota, or file-size limit) as one line naming the directory and the fix.

The writers (training/data/shards.py ``write_shard`` / ``atomic_write_bytes``) already remove
their own ``.NAME.part-PID`` file when a write fails; this turns the ``OSError`` that reaches
an entrypoint into a ``UserError`` so the user sees where space ran out and what is kept,
not a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from training.errors import UserError

#: no space left on device, disk quota exceeded, file too large (RLIMIT_FSIZE / filesystem limit)
FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
        errno.EFBIG: "file too large for the filesystem or the process's file-size limit (ulimit -f)"}


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent), or None."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


@contextlib.contextmanager
def disk_full_is_one_line(directory: str | os.PathLike[str], *, kept: str) -> Iterator[None]:
    """Inside: an ENOSPC / EDQUOT / EFBIG ``OSError`` becomes ``UserError`` naming ``directory``,
    the file being written, the free space and ``kept`` (what survives for a re-run)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        free = free_bytes(directory)
        where = f" writing {Path(exc.filename).name}" if exc.filename else ""
        room = f", {free / 2**20:.1f} MiB free" if free is not None else ""
        raise UserError(f"{directory}: {FULL[exc.errno]}{where}{room}; free space (or raise the limit) and re-run "
                        f"the same command: {kept}") from None
