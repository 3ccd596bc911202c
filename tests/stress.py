"""CPU contention for tests: busy processes beside the test, as another job on the node would be.

A resume that is exact only on an idle machine, or a shutdown that aborts when threads are
scheduled late, is a bug the quiet test machine hides. ``CpuStress`` starts ``workers``
processes (default: one per core) that alternate a memory-bound copy of a 16 MiB array
(cache and memory-bandwidth pressure, as a data loader or another trainer would put on the
node) with pure-Python spinning (run-queue pressure), at the test's own priority, and stops
them afterwards. ``busy_seconds()`` reads the CPU time they got from /proc, so a test can show
the contention was real and not merely requested.

Use the ``cpu_stress`` marker (tests/conftest.py) on a test, or the ``cpu_stress`` fixture.
``SANA_STRESS_WORKERS`` overrides the number of processes (0 turns the stress off).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: what each busy process runs until it is terminated
BUSY_LOOP = """
import time
import numpy as np
src = np.ones(2 * 1024 * 1024)  # 16 MiB of float64
dst = np.empty_like(src)
while True:
    np.copyto(dst, src)
    end = time.perf_counter() + 0.002
    while time.perf_counter() < end:
        pass
"""


def default_workers() -> int:
    value = os.environ.get("SANA_STRESS_WORKERS")
    if value is not None:
        return int(value)
    return os.cpu_count() or 2


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat (fields 14 and 15, in clock ticks)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuStress:
    """Context manager: busy processes for the duration of the block."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = default_workers() if workers is None else workers
        self._procs: list[subprocess.Popen] = []
        self._used: float = 0.0

    def __enter__(self) -> CpuStress:
        for _ in range(self.workers):
            self._procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def busy_seconds(self) -> float:
        """CPU seconds the busy processes have used so far."""
        return self._used + sum(_cpu_seconds(p.pid) for p in self._procs)

    def __exit__(self, *exc: object) -> None:
        self._used = self.busy_seconds()
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
