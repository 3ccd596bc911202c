"""Slurm accounting on the local cluster: slurmctld -> slurmdbd -> MariaDB, read back with sacct.

On the cluster the same records go to Aurora MySQL through HyperPod's
`Orchestrator.Slurm.AccountingDatabase` (runbooks/observability.md); here the fixture runs
slurmdbd on a private MariaDB, so `sacct` is exercised against a real database and the
records carry the user who really submitted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest

from tests.slurm.conftest import skip_unless_required

if TYPE_CHECKING:
    from pathlib import Path

    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm]


def submit_wrap(cluster: SlurmCluster, cwd: Path, *, name: str, command: str, user: str | None) -> int:
    script = cwd / f"{name}.sh"
    script.write_text(f"#!/bin/bash\n{command}\n")
    script.chmod(0o755)
    return cluster.sbatch(script, options=(f"--job-name={name}", f"--output={cwd}/{name}-%j.out"),
                          env={}, cwd=cwd, user=user)


def test_sacct_reads_the_finished_jobs_back_from_the_database_with_state_and_user(
        slurm_cluster: SlurmCluster) -> None:
    if not slurm_cluster.accounting:
        skip_unless_required(slurm_cluster.no_accounting_reason)
    user = slurm_cluster.user
    assert user is not None
    cwd = slurm_cluster.job_user.home
    ok = submit_wrap(slurm_cluster, cwd, name="acct-ok", command="true", user=user)
    failed = submit_wrap(slurm_cluster, cwd, name="acct-fail", command="exit 3", user=user)
    as_root = submit_wrap(slurm_cluster, slurm_cluster.root, name="acct-root", command="true", user=None)
    for job_id in (ok, failed, as_root):
        slurm_cluster.wait(job_id, timeout=120)

    # slurmctld sends the job records to slurmdbd asynchronously: poll until all three land.
    deadline = time.monotonic() + 60
    while len(records := slurm_cluster.sacct(ok, failed, as_root)) < 3 or any(
            row["State"] in {"PENDING", "RUNNING"} for row in records.values()):
        assert time.monotonic() < deadline, f"sacct has not recorded all three jobs: {records}"
        time.sleep(1)

    assert records[ok] == {"JobName": "acct-ok", "User": user, "State": "COMPLETED", "ExitCode": "0:0"}
    assert records[failed] == {"JobName": "acct-fail", "User": user, "State": "FAILED", "ExitCode": "3:0"}
    assert records[as_root]["User"] == "root" and records[as_root]["State"] == "COMPLETED"
