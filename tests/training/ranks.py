"""Launch one process per rank without torchrun (``env://`` rendezvous on loopback): how ranks
on different nodes see each other, where no local launcher stops a peer, and where each
rank's exit code and exit time can be read (torchrun reports only the first failure)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Ranks:
    codes: dict[int, int]  # exit code per rank
    ended: dict[int, float]  # time.time() each rank was seen gone (polled every 50 ms)
    outputs: dict[int, str]  # stdout + stderr per rank


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **extra}


def launch_ranks(nproc: int, argv: list[str], *, timeout_s: float = 240, **extra_env: str) -> Ranks:
    """Run ``python *argv`` as ranks 0..nproc-1 and wait for all; a rank still running after
    ``timeout_s`` is killed and reported as a hang (AssertionError with every rank's output)."""
    port = str(free_port())
    procs = {}
    for rank in range(nproc):
        rank_env = env(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **extra_env)
        procs[rank] = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=rank_env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
    codes: dict[int, int] = {}
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(codes) < nproc and time.monotonic() < deadline:
        for rank, proc in procs.items():
            if rank not in codes and proc.poll() is not None:
                codes[rank], ended[rank] = proc.returncode, time.time()
        time.sleep(0.05)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    outputs = {rank: proc.communicate()[0] for rank, proc in procs.items()}
    hung = sorted(set(procs) - set(codes))
    assert not hung, f"ranks {hung} still running after {timeout_s:.0f} s (a hang):\n" + "\n".join(
        f"--- rank {r}\n{o[-2000:]}" for r, o in outputs.items())
    return Ranks(codes, ended, outputs)
