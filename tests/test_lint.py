"""The whole tree stays lint-clean: ruff over Python, shellcheck over every shell script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_ruff_clean():
    proc = subprocess.run([str(BIN / "ruff"), "check", "."], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_clean_everywhere():
    scripts = sorted({*REPO.glob("lifecycle_scripts/*.sh"), *REPO.glob("training/slurm/*.sh"),
                      *REPO.glob("training/slurm/*.sbatch"), *REPO.glob("scripts/*.sh"), *REPO.glob("benchmarks/*.sh"),
                      REPO / ".ci" / "run"})
    assert len(scripts) > 10
    proc = subprocess.run([str(BIN / "shellcheck"), "-x", *map(str, scripts)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
