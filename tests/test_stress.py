"""The CPU-stress helper (tests/stress.py) really takes CPU from the tests it runs beside."""

from __future__ import annotations

import time
from pathlib import Path

from tests.stress import CpuStress


def test_busy_processes_use_cpu_and_are_gone_afterwards():
    with CpuStress(2) as stress:
        pids = [p.pid for p in stress._procs]
        time.sleep(1.5)
        used = stress.busy_seconds()
    assert used > 0.3, used  # two spinning processes on a (shared) 2-core machine
    for pid in pids:  # reaped (no /proc entry) by CpuStress.__exit__
        assert not Path(f"/proc/{pid}").exists(), pid
