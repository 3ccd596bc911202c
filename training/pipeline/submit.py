"""``submit``: queue the stages a recipe still needs, chained with ``--dependency=afterok``.

For each stage, in order:

- finished (a valid run.json for its key): nothing to run;
- its job (same name, so same key) already queued or running, from an earlier submit: that
  job is kept and later stages wait on it;
- otherwise: sbatch through the stage's job script, after the unfinished stages it reads.

Every job gets ``--kill-on-invalid-dep=yes``: "If a job has an invalid dependency and it can
never run this parameter tells Slurm to terminate it" (sbatch(1), Slurm 22.05,
https://slurm.schedmd.com/sbatch.html#OPT_kill-on-invalid-dep), so when a stage fails the
stages after it are cancelled at once instead of pending forever with reason
DependencyNeverSatisfied; ``status`` then names the failed stage, and the next ``submit``
queues it again (in the same directory: a train stage resumes from its checkpoints).

Two submits at once (of one recipe, or of two recipes sharing a stage) are serialised by one
flock per user on FSx (cluster-wide with Lustre's ``flock`` mount option, which
lifecycle_scripts/fsx_mount.sh checks): the second sees the first's jobs in the queue and
queues nothing twice. If an sbatch fails half-way the
jobs this submit queued are cancelled, so no orphan chain is left running.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.pipeline import slurm
from training.pipeline.keys import SHORT
from training.pipeline.plan import Plan, Stage
from training.pipeline.records import STAGE_FORMAT, SUBMITTED, finished_run, read_json, write_json_atomic
from training.pipeline.table import render

#: how long a submit waits for another submit of the same recipe
LOCK_WAIT_S = 300.0


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextlib.contextmanager
def submit_lock(path: Path, *, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (released when the process ends, however it ends)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise UserError(f"{path}: cannot lock ({os.strerror(exc.errno)}); FSx must be mounted with "
                                    "the flock option (lifecycle_scripts/fsx_mount.sh)") from None
            if time.monotonic() > deadline:
                raise UserError(f"{path}: another submit has held the lock for {wait_s:.0f} s; "
                                "wait for it (or end it), then submit again")
            if not said:
                print(f"pipeline: another submit is running; waiting for {path}", file=sys.stderr,
                      flush=True)
                said = True
            time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def stage_document(plan: Plan, stage: Stage, attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """stage.json: everything the stage's job (its record step, the report) needs to know."""
    return {
        "format": STAGE_FORMAT, "stage": stage.name, "key": stage.key, "job_name": stage.job_name,
        "dir": str(stage.dir), "outputs": stage.outputs, "section": stage.section,
        "inputs": {name: {"key": plan.stage(name).key, "dir": str(plan.stage(name).dir)} for name in stage.after},
        "recipe": {"name": plan.recipe.name, "path": str(plan.recipe_path), "sha256": plan.recipe_sha256,
                   "content": plan.recipe_tree},
        "package": {"root": str(plan.site.package_root), "hash": plan.site.package_hash},
        "command": {"script": str(stage.script), "args": list(stage.args), "options": list(stage.options)},
        "attempts": attempts,
    }


def _row(stage: Stage, job_id: str, action: str) -> dict[str, str]:
    return {"stage": stage.name, "job": job_id, "action": action, "output": stage.main_output}


def submit(plan: Plan) -> list[dict[str, str]]:
    """Queue what ``plan`` still needs; returns one row per stage (stage, job, action, output)."""
    site = plan.site
    site.check_user_dir()
    state_dir = site.pipeline_dir(plan.recipe.name)
    rows: list[dict[str, str]] = []
    with submit_lock(site.user_dir / "pipelines" / ".submit.lock"):
        live = slurm.live_jobs(site.user)
        job_of: dict[str, str] = {}  # stage -> job id the next stages wait on ("" = finished)
        queued_now: list[str] = []
        try:
            for stage in plan.stages:
                run = finished_run(stage.dir, stage.key)
                if run is not None:
                    job_of[stage.name] = ""
                    rows.append(_row(stage, str(run.get("job", {}).get("id", "")), "done"))
                    continue
                if stage.job_name in live:
                    job = live[stage.job_name]
                    job_of[stage.name] = job.job_id
                    rows.append(_row(stage, job.job_id, f"already {job.state.lower()}"))
                    continue
                after = [job_of[name] for name in stage.after if job_of[name]]
                options = [*stage.options, *([f"--dependency=afterok:{':'.join(after)}"] if after else [])]
                previous = read_json(stage.stage_file) or {}
                attempts = [a for a in previous.get("attempts", []) if previous.get("key") == stage.key]
                stage.dir.mkdir(parents=True, exist_ok=True)
                write_json_atomic(stage.stage_file, stage_document(plan, stage, attempts))
                job_id = slurm.sbatch(str(stage.script), stage.args, options,
                                      env={**stage.env, "SANA_PIPELINE_STAGE": str(stage.stage_file)})
                queued_now.append(job_id)
                attempts.append({"job_id": job_id, "submitted_at": now(), "after": after})
                write_json_atomic(stage.stage_file, stage_document(plan, stage, attempts))
                job_of[stage.name] = job_id
                rows.append(_row(stage, job_id, "submitted" + (f" after {','.join(after)}" if after else "")))
        except (UserError, OSError) as exc:
            cause = str(exc) if isinstance(exc, UserError) else f"{exc.filename}: {exc.strerror}"
            with contextlib.suppress(UserError):
                slurm.scancel(queued_now)
            undone = f"; cancelled the {len(queued_now)} job(s) this submit queued ({', '.join(queued_now)})" \
                if queued_now else ""
            raise UserError(f"submit {plan.recipe.name}: stage {stage.name}: {cause}{undone}") from None
        write_json_atomic(state_dir / SUBMITTED, {
            "recipe": {"name": plan.recipe.name, "path": str(plan.recipe_path), "sha256": plan.recipe_sha256},
            "submitted_at": now(), "user": site.user, "package_hash": site.package_hash,
            "stages": [{"stage": s.name, "key": s.key, "job_name": s.job_name, "dir": str(s.dir),
                        "outputs": s.outputs, "after": list(s.after), "job_id": job_of[s.name] or row["job"]}
                       for s, row in zip(plan.stages, rows, strict=True)],
        })
    return rows


def render_rows(rows: list[dict[str, str]], plan: Plan) -> str:
    table = render(["stage", "job id", "action", "output"],
                   [[r["stage"], r["job"] or "-", r["action"], r["output"]] for r in rows])
    queued = sum(r["action"].startswith("submitted") for r in rows)
    summary = (f"{plan.recipe.name}: {queued} job(s) queued" if queued else
               f"{plan.recipe.name}: nothing to run (every stage is finished or already queued)")
    keys = " ".join(f"{s.name}={s.key[:SHORT]}" for s in plan.stages)
    return (f"{table}\n{summary}; keys {keys}; package {plan.site.package_hash}\n"
            f"watch: python -m training.pipeline status {plan.recipe.name}")
