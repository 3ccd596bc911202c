"""Where a run resumes from, and what resuming from there means for the checkpoints around it.

- ``resolve_checkpoint``: the complete checkpoint a user-given source names (a step
  directory, a checkpoint root, a run directory, local or ``s3://``): for
  ``checkpoint.resume`` and for export (training/checkpoint/export.py).
- ``choose_resume``: what ``checkpoint.resume`` selects (``auto``: the newest complete local
  checkpoint, else the S3 mirror's).
- ``set_aside_later``: resuming from an older step abandons the later ones of the same root.
- ``warn_on_drift``: a resume that will run on, but not bit-identically (a changed config,
  another CPU thread count), says so in the log.

Apart from the Checkpointer (training/checkpoint/checkpointer.py), which runs these on rank 0
and shares the answer, because export needs the resolution without a training run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.backends.base import Backend
from training.checkpoint.config import CheckpointConfig
from training.checkpoint.layout import MANIFEST, STEP_RE, find_latest, list_complete, log, verify
from training.checkpoint.train_state import jsonable
from training.errors import UserError


def resolve_checkpoint(source: str, cache_dir: str | Path | None = None, *, key: str = "checkpoint") -> Path:
    """The complete checkpoint ``source`` names, for resuming and for export.

    ``source`` is a ``step-XXXXXXXX`` directory, a checkpoint root or a run directory (its
    newest complete checkpoint), local or ``s3://`` (fetched into ``cache_dir``). Anything
    else is a UserError that starts with ``key`` (the config key or argument it came from).
    """
    if source.startswith("s3://"):
        from training.checkpoint.mirror import fetch_checkpoint, fetch_latest

        cache = Path(cache_dir or tempfile.mkdtemp(prefix="sana-checkpoint-"))
        is_step = STEP_RE.match(source.rstrip("/").rsplit("/", 1)[-1]) is not None
        found = fetch_checkpoint(source, cache) if is_step else fetch_latest(source, cache)
        if found is None:
            raise UserError(f"{key}: {source} holds no complete checkpoint (with manifest.json) of its live branch "
                            "(branch.json); check the URL, or give a step-XXXXXXXX URL to resume any one")
        return found
    path = Path(source)
    if (path / MANIFEST).exists():
        if verify(path) is None:
            raise UserError(f"{key}: {path} is incomplete or corrupt (files do not match manifest.json); "
                            "pick another step-* directory")
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir() and (found := find_latest(root)) is not None:
            return found
    raise UserError(f"{key}: {source} holds no complete checkpoint; give a step-XXXXXXXX directory, "
                    "a checkpoint root or a run directory")


def choose_resume(cfg: CheckpointConfig, root: Path) -> Path | None:
    """What ``cfg.resume`` selects under the checkpoint root ``root`` (None: a fresh start).
    Rank 0 only: it may fetch from S3 into ``root``."""
    resume = cfg.resume
    if resume == "none" or not cfg.enabled:
        return None
    if resume == "auto":
        found = find_latest(root)
        if found is None and cfg.s3_mirror:
            from training.checkpoint.mirror import fetch_latest

            found = fetch_latest(cfg.s3_mirror, root)
        return found
    return resolve_checkpoint(resume, root, key="checkpoint.resume")


def set_aside_later(root: Path, resumed: Path) -> None:
    """Resuming from an older checkpoint of ``root`` abandons the later ones: rename them so
    that a crash followed by ``--resume auto`` never jumps back onto that trajectory."""
    match = STEP_RE.match(resumed.name)
    if match is None or resumed.resolve().parent != root.resolve():
        return
    step = int(match.group(1))
    for later, path in list_complete(root):
        if later > step:
            target = path.with_name(f"abandoned-{path.name}")
            n = 1
            while target.exists():
                target, n = path.with_name(f"abandoned-{path.name}.{n}"), n + 1
            log.warning("resuming from step %d: renaming the later %s to %s", step, path.name, target.name)
            os.replace(path, target)


def warn_on_drift(path: Path, meta: Mapping[str, Any], run_config: Mapping[str, Any], backend: Backend) -> None:
    """Log (rank 0) what makes this resume continue without bit-identity: a changed run config
    (legitimate: a longer run, a new LR) or another intra-op CPU thread count."""
    if backend.is_main and (changes := config_changes(meta.get("config") or {}, run_config)):
        # Legitimate (a longer run, a new LR), but then the run is no longer the one saved.
        log.warning("resuming with a changed config: %s", "; ".join(changes[:20]))
    saved_threads = (meta.get("backend") or {}).get("intra_op_threads")
    threads = backend.describe().get("intra_op_threads")
    if backend.is_main and saved_threads is not None and threads is not None and saved_threads != threads:
        # CPU only: the thread count changes the reduction order of every op, so the bits.
        log.warning("%s: saved with %s intra-op CPU threads, resumed with %s: continuing is fine, "
                    "bit-identity is not (set OMP_NUM_THREADS=%s to match)", path, saved_threads, threads,
                    saved_threads)


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for each run-config value that differs (where to resume from aside)."""
    old, new = _flatten(saved), _flatten(jsonable(current))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if key != "checkpoint.resume" and old.get(key) != new.get(key)]


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
