"""Stop cleanly when Slurm asks: checkpoint at the next agreed step boundary, then exit.

``scancel``, a job's time limit and HyperPod's job restarts send SIGTERM to every task and
SIGKILL ``KillWait`` seconds later (30 s by Slurm's default). SIGUSR1 is treated the same,
for a caller that signals the training processes directly to get a save-and-stop. Without
this, a stopped run loses everything since its last periodic checkpoint. The handler only records the signal: the loop asks every
``log_every`` steps whether rank 0 got one (a broadcast, so every rank stops at the same
step), saves, and returns. A signal during the save changes nothing: checkpoints are
written atomically, so the previous one stays valid if the save does not finish.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from training.backends.base import Backend

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Context manager: catches STOP_SIGNALS while training, restores the old handlers after."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        # signal.signal only works in the main thread (tests may train in another one).
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum

    def agreed(self, backend: Backend) -> int | None:
        """Rank 0's pending signal on every rank (collective: call on all ranks together)."""
        signum = backend.broadcast_object(self.signum)
        if signum is not None and backend.is_main:
            log.warning("%s received: saving a checkpoint and stopping", signal.Signals(signum).name)
        return signum
