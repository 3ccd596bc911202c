"""Who a run is: the labels every metric of it carries (job id, user, run name, node)."""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
import socket
from pathlib import Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunIdentity:
    job_id: str
    user: str
    run_name: str
    node: str

    def labels(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def run_identity(output_dir: str, run_name: str = "", environ: dict[str, str] | None = None) -> RunIdentity:
    """The job's identity from Slurm's environment (sbatch(1) OUTPUT ENVIRONMENT VARIABLES:
    SLURM_JOB_ID, SLURM_JOB_USER), else this process's; the node is the short hostname, which
    is the Slurm node name on HyperPod and the ``node`` label the collector gives node-level
    targets (lifecycle_scripts/observability_config.py), so the two join."""
    env = os.environ if environ is None else environ
    name = run_name or re.sub(r"[^A-Za-z0-9._-]", "-", Path(output_dir).resolve().name) or "run"
    try:
        user = env.get("SLURM_JOB_USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (a bare container)
        user = str(os.getuid())
    return RunIdentity(job_id=env.get("SLURM_JOB_ID") or f"local-{os.getpid()}", user=user, run_name=name,
                       node=socket.gethostname().split(".")[0])
