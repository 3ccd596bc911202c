"""The Slurm commands the pipeline runs: sbatch, squeue, sacct, scontrol, scancel.

Jobs are found by name as well as by id: a stage's job name carries its key, so a job of
that name still queued or running is that stage's, whichever submit queued it (ids of
purged jobs can be reused after a controller reinstall; names with keys cannot collide).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from collections.abc import Iterable, Sequence

from training.errors import UserError

#: squeue states of a job that may still run (squeue(1) JOB STATE CODES)
LIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
               "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


class SlurmError(UserError):
    """A Slurm command failed; the message is its one-line cause."""


@dataclasses.dataclass(frozen=True)
class JobState:
    """What Slurm says of one job."""

    job_id: str
    name: str
    state: str
    #: "exit:signal" as sacct/scontrol print it ("" while running)
    exit_code: str = ""
    #: the pending reason, or why it ended (e.g. DependencyNeverSatisfied)
    reason: str = ""

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES


def _run(argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]}: not found; run this on the cluster's login node (Slurm's commands on PATH)") \
            from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]}: no answer from slurmctld in {timeout:.0f} s; check `scontrol ping`") from None


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def sbatch(script: str, args: Sequence[str], options: Sequence[str], *, env: dict[str, str]) -> str:
    """Submit; returns the job id. The job inherits ``env`` (sbatch's default --export=ALL)."""
    proc = _run(["sbatch", "--parsable", *options, script, *args], env={**os.environ, **env})
    if proc.returncode != 0:
        raise SlurmError(f"sbatch {os.path.basename(script)}: {_first_line(proc.stderr)}")
    return proc.stdout.strip().split(";")[0]


def live_jobs(user: str) -> dict[str, JobState]:
    """The user's jobs still in the queue, by job name (the newest id when a name repeats)."""
    proc = _run(["squeue", "-h", "-u", user, "-o", "%i|%j|%T|%r"])
    if proc.returncode != 0:
        raise SlurmError(f"squeue: {_first_line(proc.stderr)}")
    found: dict[str, JobState] = {}
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            job = JobState(job_id=parts[0], name=parts[1], state=parts[2], reason=parts[3])
            if job.name not in found or int(job.job_id) > int(found[job.name].job_id):
                found[job.name] = job
    return found


def finished_jobs(job_ids: Iterable[str]) -> dict[str, JobState]:
    """Ended jobs from accounting (sacct), then from the controller's memory (scontrol, for
    about MinJobAge after the end) for any sacct does not know; absent when neither does."""
    ids = [i for i in job_ids if i]
    found: dict[str, JobState] = {}
    if not ids:
        return found
    try:
        # Accounting off ("Slurm accounting storage is disabled") or slurmdbd down: scontrol below.
        proc = _run(["sacct", "-X", "-n", "-P", "-j", ",".join(ids), "-o", "JobID,JobName,State,ExitCode,Reason"],
                    timeout=30)
    except SlurmError:
        proc = subprocess.CompletedProcess([], 1, "", "")
    if proc.returncode == 0:
        for line in proc.stdout.splitlines():
            parts = line.split("|")
            if len(parts) == 5 and parts[0] in ids:
                # "CANCELLED by 1001" -> CANCELLED
                found[parts[0]] = JobState(parts[0], parts[1], parts[2].split()[0], parts[3], parts[4])
    for job_id in ids:
        if job_id in found:
            continue
        proc = _run(["scontrol", "show", "job", "-o", job_id])
        if proc.returncode == 0:
            fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
            found[job_id] = JobState(job_id, fields.get("JobName", ""), fields.get("JobState", ""),
                                     fields.get("ExitCode", ""), fields.get("Reason", ""))
    return found


def scancel(job_ids: Sequence[str]) -> None:
    if not job_ids:
        return
    proc = _run(["scancel", *job_ids])
    if proc.returncode != 0:
        raise SlurmError(f"scancel {' '.join(job_ids)}: {_first_line(proc.stderr)}")
