"""File modes for what the package writes for other people to read.

safetensors' ``save_file`` (and so diffusers' ``save_pretrained`` and ``save_lora_weights``)
creates its file mode 0600 whatever the process umask (measured with the pinned safetensors
0.8.0: 0o600 under umask 022, where ``open()`` gives 0o644; tests/training/checkpoint/test_file_modes.py),
so a colleague in the cluster group cannot read an exported model, a feature directory's
validation prompts or a checkpoint. ``honour_umask`` gives such files the mode ``open()`` would have given them:
0666 & ~umask (0644 under 022, 0640 under 027, 0600 under 077: the user's choice, either way).
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it (``os.umask`` can only be read by setting
    it, and a file another thread creates in between would get the temporary mask)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the set-and-restore fallback
    os.umask(mask)
    return mask


def honour_umask(*paths: str | os.PathLike[str]) -> None:
    """Give each file (and, for a directory, every file under it) mode 0666 & ~umask."""
    mode = 0o666 & ~current_umask()
    for path in map(Path, paths):
        files = [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()] if path.is_dir() else [path]
        for file in files:
            os.chmod(file, mode)
