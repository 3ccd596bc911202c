"""Publishing a finished output directory over the previous one.

Every writer that produces a directory (an export, a serving artefact, a pipeline report)
builds it in a temporary sibling and calls ``replace_dir`` last, so a reader never sees a
half-written tree and a failure before that call leaves the previous output untouched.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(tmp: Path, out: Path) -> Path:
    """Move the finished directory ``tmp`` to ``out``, replacing what is there.

    The old output is first renamed aside (same directory, so both renames are atomic) and
    deleted only once the new one is in place: at any moment ``out`` is the old tree or the
    new one, or, after a crash between the two renames, the old one still lies beside it as
    ``.<name>.replaced-<pid>``. ``tmp`` must be on the same filesystem as ``out``.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    aside = None
    if out.exists() or out.is_symlink():
        aside = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        _remove(aside)
        out.rename(aside)
    tmp.rename(out)
    if aside is not None:
        _remove(aside)
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
