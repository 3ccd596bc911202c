"""Stop cleanly when Slurm asks: checkpoint at the next agreed step boundary, then exit.

``scancel``, a job's time limit and HyperPod's job restarts send SIGTERM to every task and
SIGKILL ``KillWait`` seconds later (30 s by Slurm's default:
https://slurm.schedmd.com/slurm.conf.html#OPT_KillWait). SIGUSR1 is treated the same, for a
caller that signals the training processes directly to get a save-and-stop. Without this, a
stopped run loses everything since its last periodic checkpoint.

The handler only records the signal (a local flag). Every step, after the step is launched,
``poll`` starts a host-side max of that flag over all ranks (``Backend.agree_max_async``: a
gloo all-reduce on the CPU, no device work, nothing in an XLA step graph, nothing the device
queue waits for) and reads the one it started at the previous step, which finished long ago.
So every rank sees the same answer at the same step: a signal that reached any rank during
step k is agreed at the end of step k + 1 (k + 2 if it landed after step k's poll), and that
step is saved and the run returns. At 1-2 s/step on 1.6B that leaves most of Slurm's 30 s for
the save. A signal during the save changes nothing: checkpoints are written atomically, so
the previous one stays valid if the save does not finish.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

from training.backends.base import Backend

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Context manager: catches STOP_SIGNALS while training, restores the old handlers after."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._pending: Callable[[], int] | None = None

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

    def poll(self) -> int | None:
        """Call every step on every rank: the signal some rank had by the previous poll, the
        same on every rank, or None. Not blocking: the exchange it reads finished long ago."""
        agreed = self._pending() if self._pending is not None else 0
        self._pending = None
        if agreed:
            if self.backend.is_main:
                log.warning("%s received: saving a checkpoint and stopping", signal.Signals(agreed).name)
            return agreed
        self._pending = self.backend.agree_max_async(self.signum or 0)
        return None

    def finish(self) -> None:
        """Success path: complete the exchange in flight (every rank started it). On failure
        it is dropped instead: waiting on it would wait on the failed rank."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()
