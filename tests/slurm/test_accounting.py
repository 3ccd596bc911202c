"""Slurm accounting on the local cluster: slurmctld -> slurmdbd -> MariaDB, read back with sacct.

On the cluster the same records go to Aurora MySQL through HyperPod's
`Orchestrator.Slurm.AccountingDatabase` (runbooks/observability.md); here the fixture runs
slurmdbd on a private MariaDB, so `sacct` is exercised against a real database and the
records carry the user who really submitted.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.slurm.conftest import skip_unless_required

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm]

ACCOUNTS_STEP = Path(__file__).resolve().parents[2] / "lifecycle_scripts" / "slurm_accounts.sh"


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


def test_the_accounts_step_adds_the_group_account_and_user_associations_once(slurm_cluster: SlurmCluster,
                                                                             tmp_path: Path) -> None:
    """lifecycle_scripts/slurm_accounts.sh against the real slurmdbd, as HyperPod's default
    accounting (MariaDB on the controller) has it: slurmAccounting is false, the running
    slurmctld says accounting_storage/slurmdbd, so the account and one association per cluster
    user are made (names lower-cased, as Slurm stores them), a re-run adds nothing, and a job
    submitted under the account is recorded with it."""
    if not slurm_cluster.accounting:
        skip_unless_required(slurm_cluster.no_accounting_reason)
    user = slurm_cluster.user
    assert user is not None
    group = f"Sana{os.getpid()}"
    env = slurm_cluster.env(CFG_CLUSTER_GROUP=group, CFG_SLURM_ACCOUNTING="false", PLATFORM_ROOT=str(tmp_path),
                            CFG_CLUSTER_USERS=f"{user}:2001 Researcher{os.getpid()}:2002", LIFECYCLE_SLURM_WAIT_S="30")
    # What the step reads, as this Slurm prints it (the stand-in below prints the same form).
    config = slurm_cluster.run("scontrol", "show", "config")
    assert re.search(r"^AccountingStorageType\s+= accounting_storage/slurmdbd$", config, re.M), config
    first = subprocess.run(["bash", str(ACCOUNTS_STEP)], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "accounting database configured (AccountingStorageType=accounting_storage/slurmdbd" in first.stdout
    account = group.lower()
    assocs = slurm_cluster.run("sacctmgr", "-n", "-P", "show", "assoc", "where", f"account={account}",
                               "format=account,user")
    users = {line.split("|")[1] for line in assocs.splitlines() if line.split("|")[1]}
    assert users == {user, f"researcher{os.getpid()}"}
    again = subprocess.run(["bash", str(ACCOUNTS_STEP)], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "added nobody" in again.stdout and "added Slurm account" not in again.stdout

    cwd = slurm_cluster.job_user.home
    script = cwd / "acct-account.sh"
    script.write_text("#!/bin/bash\ntrue\n")
    script.chmod(0o755)
    job = slurm_cluster.sbatch(script, options=("--job-name=acct-account", f"--account={account}",
                                                f"--output={cwd}/acct-account-%j.out"), env={}, cwd=cwd, user=user)
    slurm_cluster.wait(job, timeout=120)
    deadline = time.monotonic() + 60
    while not (row := slurm_cluster.run("sacct", "-X", "-n", "-P", "-j", str(job), "-o", "Account,State").strip()) \
            or "COMPLETED" not in row:
        assert time.monotonic() < deadline, f"sacct has no completed record of job {job}: {row!r}"
        time.sleep(1)
    assert row.splitlines()[-1] == f"{account}|COMPLETED"


def scontrol_standin(tmp_path: Path, body: str) -> str:
    """A PATH whose scontrol prints ``body`` for `show config` (the real form is pinned above)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "scontrol").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_the_accounts_step_does_nothing_without_accounting(tmp_path: Path) -> None:
    path = scontrol_standin(tmp_path, 'echo "AccountingStorageType   = accounting_storage/none"')
    env = {"PATH": path, "CFG_CLUSTER_GROUP": "sana", "CFG_SLURM_ACCOUNTING": "true",
           "CFG_CLUSTER_USERS": "alice:2001", "PLATFORM_ROOT": str(tmp_path)}
    done = subprocess.run(["bash", str(ACCOUNTS_STEP)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "no accounting database (AccountingStorageType=accounting_storage/none)" in done.stdout


def test_the_accounts_step_says_in_one_line_when_slurmctld_does_not_answer(tmp_path: Path) -> None:
    path = scontrol_standin(tmp_path, 'echo "slurm_load_ctl_conf error: Unable to contact slurm controller" >&2; exit 1')
    error = tmp_path / "error"
    env = {"PATH": path, "CFG_CLUSTER_GROUP": "sana", "PLATFORM_ROOT": str(tmp_path), "STEP_ERROR_FILE": str(error)}
    done = subprocess.run(["bash", str(ACCOUNTS_STEP)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert error.read_text() == ("scontrol show config failed on the controller (slurm_load_ctl_conf error: Unable to "
                                 "contact slurm controller); cannot tell whether accounting is configured\n")
