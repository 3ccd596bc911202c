"""``status RUN`` and ``cancel RUN``: the last submit of a recipe, stage by stage.

A stage's state comes from its own output first (a valid run.json: finished, whatever Slurm
still remembers), then from Slurm: ``squeue`` for jobs still queued or running, ``sacct``
for ended ones (``scontrol show job`` where accounting is off, for the MinJobAge minutes
slurmctld keeps an ended job). A stage that did not succeed gets its cause in one line,
read from the job's own logs (``job.log`` in its log directory, Slurm's ``.out``): the
entrypoint's ``error: ...`` line (training/errors.py), a rank's ``[rank N] ...Error: ...``
(training/failure/), the launcher's last words, or the Slurm state when the job left none.
Stages cancelled because an earlier one failed say which.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.pipeline import slurm
from training.pipeline.records import SUBMITTED, finished_run, read_json
from training.pipeline.site import Site
from training.pipeline.table import render

#: srun --label ("0: "), torchrun --tee ("[default0]:"), and a logging timestamp, in front of a line
_PREFIX = re.compile(r"^(?:\d+:\s*)?(?:\[default\d+\]:)?\s*")
#: an entrypoint's UserError (training/errors.py exits_cleanly; training/failure/leave.py on a rank of many)
_ERROR = re.compile(r"^(?:\[rank \d+\] )?(error: .+)$")
_RANK = re.compile(r"^(\[rank \d+\] (?:\w+\.)*\w*(?:Error|Exception|Interrupt)\b.*)$")
_EXCEPTION = re.compile(r"^((?:\w+\.)*\w*(?:Error|Exception): .+)$")
#: launcher lines that are progress, not a cause
_LAUNCHER_INFO = re.compile(r"^launch\.sh: (job \d+ |package |env |logs |run dir |pipeline stage |compile cache |"
                            r"srun |loaded node profile|no node profile at |container image |recording |"
                            r"NEURON_RT_ROOT_COMM_ID=|[\w.-]+: (\S*neuron_parallel_compile )?torchrun |[\w.-]+: node_rank=)")
_STATE_CAUSE = {"TIMEOUT": "hit its time limit (raise the stage's time in the recipe)",
                "OUT_OF_MEMORY": "ran out of memory", "NODE_FAIL": "a node failed",
                "PREEMPTED": "was preempted", "BOOT_FAIL": "its node did not boot", "DEADLINE": "missed its deadline"}


def cause_from_logs(texts: list[str]) -> str | None:
    """The most telling line of a failed job's logs (``texts``: job.log, then Slurm's .out)."""
    for pattern in (_ERROR, _RANK, _EXCEPTION):
        for text in texts:
            for raw in reversed(text.splitlines()):
                line = _PREFIX.sub("", raw).strip()
                match = pattern.search(line)
                if match:
                    return match.group(1)
    for text in texts:  # the launcher (or the job script) died before the entrypoint ran
        for raw in reversed(text.splitlines()):
            line = raw.strip()
            launcher = line.startswith("launch.sh: ") and not _LAUNCHER_INFO.match(line) \
                and "finished with exit code" not in line
            if launcher or re.match(r"^[\w-]+\.sbatch: ", line):
                return line
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def failure_cause(site: Site, job_name: str, job: slurm.JobState) -> str:
    log_dir, out = site.job_log_dir(job_name, job.job_id), site.slurm_out(job_name, job.job_id)
    found = cause_from_logs([_read(log_dir / "job.log"), _read(out)])
    state = f"{job.state.lower()}" + (f", exit {job.exit_code}" if job.exit_code not in ("", "0:0") else "")
    if job.state in _STATE_CAUSE:
        found = f"{_STATE_CAUSE[job.state]}" + (f"; last error: {found}" if found else "")
    return f"{state}: {found or 'no error line in the logs'} (log {log_dir}/job.log)"


def last_submit(site: Site, run: str) -> dict[str, Any]:
    """submitted.json of RUN (a recipe name, or a recipe file: its name is read from it)."""
    name = run
    if run.endswith((".yaml", ".yml")) and Path(run).is_file():
        import yaml

        name = str((yaml.safe_load(Path(run).read_text()) or {}).get("name", ""))
    state = read_json(site.pipeline_dir(name) / SUBMITTED)
    if state is None:
        raise UserError(f"{run}: no pipeline of that name submitted by {site.user} under {site.user_dir / 'pipelines'}; "
                        "give the recipe's name (or file) as submitted")
    return state


def stage_rows(site: Site, state: dict[str, Any]) -> list[dict[str, str]]:
    """One row per stage: stage, job id, state, output, detail."""
    live = slurm.live_jobs(site.user)
    stages = state["stages"]
    runs = {s["stage"]: finished_run(Path(s["dir"]), s["key"]) for s in stages}
    pending_ids = [s["job_id"] for s in stages if runs[s["stage"]] is None and s["job_name"] not in live]
    ended = slurm.finished_jobs(pending_ids)
    rows: list[dict[str, str]] = []
    root: dict[str, str] = {}  # stage that did not succeed -> the stage whose failure it comes from
    what: dict[str, str] = {}  # that stage -> what happened to it ("failed", "was cancelled")
    for s in stages:
        output = next(iter(s["outputs"].values()))
        run = runs[s["stage"]]
        if run is not None:
            rows.append({"stage": s["stage"], "job": str(run["job"]["id"]), "state": "COMPLETED", "output": output,
                         "detail": f"finished {run['finished_at']} (run.json)"})
            continue
        if s["job_name"] in live:
            job = live[s["job_name"]]
            waiting = f"waiting: {job.reason}" if job.state == "PENDING" and job.reason not in ("", "None") else ""
            rows.append({"stage": s["stage"], "job": job.job_id, "state": job.state, "output": output,
                         "detail": waiting or "running"})
            continue
        upstream = next((root[u] for u in s.get("after", []) if u in root), None)
        root[s["stage"]] = upstream or s["stage"]
        job = ended.get(s["job_id"])
        if job is None:
            detail = (f"not run: {upstream} {what.get(upstream, 'did not finish')}" if upstream else
                      f"job {s['job_id']} is no longer known to Slurm and the stage has no run.json; submit again")
            rows.append({"stage": s["stage"], "job": s["job_id"], "state": "UNKNOWN", "output": output, "detail": detail})
            continue
        if job.state == "CANCELLED" and (upstream or job.reason == "DependencyNeverSatisfied"):
            # sbatch --kill-on-invalid-dep=yes: Slurm cancelled it when its dependency failed
            detail = (f"not run: {upstream + ' ' + what.get(upstream, 'did not finish') if upstream else 'an earlier stage failed'} "
                      "(its afterok dependency can never be satisfied)")
        else:
            root[s["stage"]] = s["stage"]
            what[s["stage"]] = "was cancelled" if job.state == "CANCELLED" else "failed"
            if job.state == "CANCELLED":
                detail = "cancelled (scancel or `python -m training.pipeline cancel`)"
            elif job.state == "COMPLETED":
                detail = "the job ended but wrote no run.json; submit again to redo the stage"
            else:
                detail = failure_cause(site, s["job_name"], job)
        rows.append({"stage": s["stage"], "job": job.job_id, "state": job.state, "output": output, "detail": detail})
    return rows


def render_status(state: dict[str, Any], rows: list[dict[str, str]]) -> str:
    table = render(["stage", "job id", "state", "output", "detail"],
                   [[r["stage"], r["job"] or "-", r["state"], r["output"], r["detail"]] for r in rows])
    done = sum(r["state"] == "COMPLETED" and "run.json" in r["detail"] for r in rows)
    failed = [r["stage"] for r in rows if r["state"] not in ("COMPLETED", "PENDING", "RUNNING", "CONFIGURING",
                                                             "COMPLETING")]
    tail = (f"{done}/{len(rows)} stages finished"
            + (f"; to continue from {failed[0]}: python -m training.pipeline submit {state['recipe']['path']}"
               if failed else ""))
    return f"{state['recipe']['name']} (submitted {state['submitted_at']})\n{table}\n{tail}"


def cancel(site: Site, state: dict[str, Any]) -> list[dict[str, str]]:
    """scancel every stage job of the last submit still queued or running (matched by name)."""
    live = slurm.live_jobs(site.user)
    rows = [{"stage": s["stage"], "job": live[s["job_name"]].job_id, "state": live[s["job_name"]].state}
            for s in state["stages"] if s["job_name"] in live]
    slurm.scancel([r["job"] for r in rows])
    return rows
