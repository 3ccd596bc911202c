"""``python -m training.gpu`` with one fault injected, for tests/training/test_failures.py and
test_preemption.py. Everything else is the real entrypoint (the same ``main``).

    SANA_TEST_FAULTS="FAULT [FAULT ...]" python tests/training/fault_worker.py <training.gpu arguments>

(an environment variable: torchrun passes the worker's arguments on but eats a ``--``). FAULT is ``<what>:<rank>:<step>``, applied when ``rank`` (torchrun's RANK) starts optimizer
step ``step`` (1-based):

- ``raise``: a RuntimeError out of the step (a bug, an OOM);
- ``block``: the main thread blocks for good before the step, the way a rank waits in an
  NCCL or Neuron collective whose peer is gone (gloo would notice the closed peer at once,
  so on CPU this is the faithful stand-in for a collective that never returns);
- ``sigterm`` / ``sigusr1``: the process sends itself that signal (what scancel delivers).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

FAULTS_ENV = "SANA_TEST_FAULTS"


def install(faults: list[str]) -> None:
    import training.loop

    rank = int(os.environ.get("RANK", "0"))
    mine = {int(step): what for what, r, step in (f.split(":") for f in faults) if int(r) == rank}
    real = training.loop.train_step
    calls = [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        what = mine.get(calls[0])
        if what == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {calls[0]}")
        if what == "block":
            threading.Event().wait()
        if what in ("sigterm", "sigusr1"):
            os.kill(os.getpid(), signal.SIGTERM if what == "sigterm" else signal.SIGUSR1)
        return real(*args, **kwargs)

    training.loop.train_step = train_step


if __name__ == "__main__":
    install(os.environ.get(FAULTS_ENV, "").split())
    from training.gpu import main

    main(sys.argv[1:])
