"""The compute nodes' SSH step (lifecycle_scripts/ssh_access.sh) on a pretend node root.

The step only edits sshd's PAM stack (PAM reads it at every login); here it runs alone against
Ubuntu's /etc/pam.d/sshd (lifecycle_cluster.SSHD_PAM), with pam_slurm_adopt.so present or not
where the AMI would have it, and a `scontrol show config` stand-in reporting Slurm's PrologFlags.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from lifecycle_cluster import GROUP, SSHD_PAM, make_standins

SCRIPTS = Path(__file__).resolve().parents[2] / "lifecycle_scripts"
SCRIPT = SCRIPTS / "ssh_access.sh"
#: the late part, run by slurm_ready.sh once slurmd is up (PrologFlags needs slurmctld)
LATE = SCRIPTS / "ssh_prolog_check.sh"
BLOCK = "# BEGIN sana-platform: compute-node SSH only for users with a job here (lifecycle_scripts/ssh_access.sh)"


@pytest.fixture
def node(tmp_path: Path):
    root = tmp_path / "node"
    (root / "etc/pam.d").mkdir(parents=True)
    (root / "etc/pam.d/sshd").write_text(SSHD_PAM)
    bin_dir = make_standins(tmp_path / "bin")
    return root, bin_dir


def run(root: Path, bin_dir: Path, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess:
    """The step as on_init_complete.sh runs it: its warnings go to STEP_WARN_FILE (they become
    WARN lines in the node's status file and the smoke job's table)."""
    full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PLATFORM_ROOT": str(root), "CFG_CLUSTER_GROUP": GROUP[0],
            "STEP_WARN_FILE": str(root / "step-warnings"), **env}
    return subprocess.run(["bash", str(script)], env=full, capture_output=True, text=True, timeout=60)


def warnings(root: Path) -> str:
    path = root / "step-warnings"
    return path.read_text() if path.exists() else ""


def managed(root: Path) -> list[str]:
    lines = (root / "etc/pam.d/sshd").read_text().splitlines()
    return lines[lines.index(BLOCK):]


def test_with_the_module_members_need_a_job_here_and_others_are_untouched(node):
    root, bin_dir = node
    module = root / "lib/x86_64-linux-gnu/security/pam_slurm_adopt.so"
    module.parent.mkdir(parents=True)
    module.touch()
    done = run(root, bin_dir)
    assert done.returncode == 0, done.stderr
    assert managed(root) == [
        BLOCK, f"account [success=1 default=ignore] pam_succeed_if.so quiet user notingroup {GROUP[0]}",
        "account required /lib/x86_64-linux-gnu/security/pam_slurm_adopt.so action_adopt_failure=deny",
        "# END sana-platform"]
    assert (root / "etc/pam.d/sshd").read_text().startswith(SSHD_PAM)  # Ubuntu's stack kept, ours last
    assert "WARNING" not in done.stdout and warnings(root) == ""
    before = (root / "etc/pam.d/sshd").read_bytes()
    assert run(root, bin_dir).returncode == 0 and (root / "etc/pam.d/sshd").read_bytes() == before


def test_without_the_module_members_are_refused_and_it_is_logged(node):
    root, bin_dir = node
    done = run(root, bin_dir)
    assert done.returncode == 0, done.stderr
    assert managed(root) == [BLOCK, f"account required pam_succeed_if.so quiet user notingroup {GROUP[0]}",
                             "# END sana-platform"]
    assert "pam_slurm_adopt.so is not installed on this node" in done.stdout
    assert warnings(root) == ""  # denying SSH is the secure default, not a degraded part: no WARN row
    late = run(root, bin_dir, LATE, STANDIN_PROLOG_FLAGS="Alloc")  # and nothing to check once Slurm is up
    assert late.returncode == 0 and warnings(root) == "", late.stderr


def test_prolog_flags_are_checked_once_slurm_is_up_and_without_contain_are_a_warn_line(node):
    """The step itself never asks slurmctld (it may still be starting during the lifecycle);
    the late part does, once slurmd is up, and warns when Contain is missing."""
    root, bin_dir = node
    module = root / "opt/slurm/lib/security/pam_slurm_adopt.so"
    module.parent.mkdir(parents=True)
    module.touch()
    done = run(root, bin_dir, STANDIN_PROLOG_FLAGS="Alloc")
    assert done.returncode == 0, done.stderr
    assert "PrologFlags" not in done.stdout and warnings(root) == ""
    late = run(root, bin_dir, LATE, STANDIN_PROLOG_FLAGS="Alloc")
    assert late.returncode == 0, late.stderr
    assert "WARNING: Slurm's PrologFlags (Alloc) lack Contain: pam_slurm_adopt finds no extern step" in late.stdout
    assert warnings(root).startswith("Slurm's PrologFlags (Alloc) lack Contain")
    (root / "step-warnings").unlink()
    assert run(root, bin_dir, LATE, STANDIN_PROLOG_FLAGS="Alloc,Contain").returncode == 0 and warnings(root) == ""


def test_a_node_without_sshds_pam_stack_fails_in_one_line(node):
    root, bin_dir = node
    (root / "etc/pam.d/sshd").unlink()
    done = run(root, bin_dir)
    assert done.returncode == 1
    assert done.stderr.strip() == (f"ERROR: no {root}/etc/pam.d/sshd on this node: sshd's PAM stack is missing, "
                                   "so SSH access cannot be limited")
