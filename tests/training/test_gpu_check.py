"""benchmarks/gpu-check.sh: the prepared GPU check, run here as its CPU dry run (tiny config)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from training.bench_result import BenchResult

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu-check.sh"
RUNS = ("compare-600m-512-eager", "compare-600m-512-compile", "step-1600m-1024-1gpu")


# shellcheck: tests/test_lint.py covers benchmarks/*.sh with every other script (never skipped).


def test_gpu_check_refuses_a_wrong_command_line(tmp_path) -> None:
    proc = subprocess.run([str(SCRIPT), str(tmp_path), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_writes_valid_results_and_a_summary(tmp_path) -> None:
    """The same three bench commands as on a GPU, on the tiny config (about a minute here)."""
    out = tmp_path / "results"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(SCRIPT), str(out), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {name: BenchResult.load(out / f"{name}.json") for name in RUNS}  # full schema validation
    for name in RUNS[:2]:
        ref = results[name].reference
        assert ref is not None and ref["ratio"] > 0 and ref["weight_update_norm"] > 0
    assert results[RUNS[2]].reference is None and results[RUNS[2]].memory_estimate["mesh"] == "fsdp"
    assert results[RUNS[2]].memory_estimate["activation_checkpointing"] == "full"
    summary = (out / "summary.txt").read_text()
    assert summary == proc.stdout and all(name in summary for name in RUNS) and "FAILED" not in summary
