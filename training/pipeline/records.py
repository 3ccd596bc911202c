"""The pipeline's files and what makes a stage finished.

- ``<stage dir>/stage.json``: what the stage was asked to do (written at submit, before its
  job is queued; the job reads it): recipe, key, inputs, promised outputs, job attempts.
- ``<stage dir>/run.json``: what the stage did (written by its job's record step, only after
  the stage succeeded): the stage file plus output digests, package and env, jobs, user, times
  and the chain's lineage. It is the ONLY mark of a finished stage: written to a temp name,
  fsynced and renamed into place, so a stage whose job died half-way (checkpoints, shards or a
  half-exported model on disk) is never taken for finished, and the next submit runs it again.
- ``<checkpoint root>/<user>/pipelines/<name>/submitted.json``: the last submit of a recipe
  (the stages and the job ids it queued), which ``status`` and ``cancel`` read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STAGE_FORMAT = "sana-pipeline-stage/1"
RUN_FORMAT = "sana-pipeline-run/1"
SUBMITTED = "submitted.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, whole or not at all: temp file in the same directory,
    fsync, rename over ``path`` (atomic on POSIX, rename(2)), fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``; None when missing or not a complete JSON object."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def missing_outputs(run: dict[str, Any]) -> list[str]:
    """Output paths a run.json names that are gone (a stage whose output was deleted is not
    finished any more)."""
    return [path for path in (run.get("outputs") or {}).get("paths", {}).values() if not Path(path).exists()]


def finished_run(stage_dir: Path, key: str) -> dict[str, Any] | None:
    """The stage's run.json when the stage finished: complete JSON of this format, for this
    key, with every output it records still present. None otherwise."""
    run = read_json(stage_dir / "run.json")
    if run is None or run.get("format") != RUN_FORMAT or run.get("key") != key:
        return None
    if missing_outputs(run):
        return None
    return run
