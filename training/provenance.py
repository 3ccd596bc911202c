"""What produced a run: the job's resolved package and env, and the data's text conditioning.

Written into every checkpoint (``train_state.json["provenance"]``) and the exported
directory, so a model can always be traced back to the exact code, environment and text
features it was trained with. The job fields come from the Slurm launcher
(training/slurm/launch.sh exports them after resolving the package and env symlinks once);
outside a job they are absent.
"""

from __future__ import annotations

import os
from typing import Any

#: environment variable -> provenance key (set by training/slurm/launch.sh)
JOB_VARIABLES = {
    "SANA_PACKAGE_ROOT": "package_root",
    "SANA_PACKAGE_HASH": "package_hash",
    "SANA_ENV_PATH": "env_path",
    "SANA_ENV_HASH": "env_requirements_hash",
}


def job_provenance(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The job's resolved package/env identity, from the launcher's environment."""
    env = os.environ if environ is None else environ
    return {key: env[var] for var, key in JOB_VARIABLES.items() if env.get(var)}


def run_provenance(**extra: Any) -> dict[str, Any]:
    """Provenance of this run: ``job`` plus whatever the caller adds (e.g. ``text_conditioning``)."""
    return {"job": job_provenance(), **extra}
