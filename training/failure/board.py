"""Failure markers on the run directory, and the thread that watches them.

A rank that fails writes ``<output_dir>/.failures/<attempt>/rank-RRRRR.json`` (its host, pid
and the error in one line) before it exits. Every rank polls that directory once a second
(``PeerWatch``): a collective whose peer is gone may never return (NCCL, a Neuron collective,
a gloo op on another node whose socket stays half-open), so the healthy ranks cannot learn of
the failure from the collective they are blocked in, nor from torchrun, whose agent on another
node never sees the failed worker. The run directory is on the shared filesystem every rank
already needs for the checkpoints (FSx for Lustre on the cluster; ``launch.sh`` puts
``--output-dir`` there), so a marker written on one node is seen on every node at the next poll.

Cost: one directory listing per rank per second (512 ranks: ~512 metadata reads a second
against the Lustre MDS, next to the tens of thousands a checkpoint commit used to poll).

``<attempt>`` is a fresh name rank 0 gives every start of the run (one ``broadcast_object``
at start-up), so markers of an earlier attempt (HyperPod's auto-resume reruns the step in the
same job and run directory) never stop the next one; rank 0 logs and removes them at start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BOARD_DIR = ".failures"
#: how often every rank looks for a peer's marker (the detection bound's main term)
POLL_S = 1.0


@dataclass(frozen=True, kw_only=True)
class Failure:
    """What a failed rank left on the board."""

    rank: int
    host: str
    pid: int
    time: float
    error: str  # one line: "<ExceptionType>: <message>"

    def describe(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid}) failed: {self.error}"


def _marker(rank: int) -> str:
    return f"rank-{rank:05d}.json"


class FailureBoard:
    """This attempt's markers: ``mark`` our own failure, ``others`` reads the peers'."""

    def __init__(self, directory: Path, *, rank: int) -> None:
        self.dir = directory
        self.rank = rank

    @classmethod
    def open(cls, output_dir: str | Path, *, rank: int, broadcast: Callable[[Any], Any]) -> FailureBoard:
        """The board of this attempt. Collective (``broadcast`` is ``backend.broadcast_object``):
        rank 0 names the attempt, reports and removes earlier attempts' markers."""
        root = Path(output_dir) / BOARD_DIR
        attempt = broadcast(f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}" if rank == 0 else None)
        if rank == 0:
            for old in sorted(root.glob("*")) if root.is_dir() else []:
                for failure in _read_all(old):
                    log.warning("the previous attempt of this run stopped: %s", failure.describe())
                shutil.rmtree(old, ignore_errors=True)
        board = cls(root / attempt, rank=rank)
        board.dir.mkdir(parents=True, exist_ok=True)
        return board

    def mark(self, error: str) -> None:
        """Record this rank's failure (atomic: a reader sees the whole marker or none)."""
        failure = Failure(rank=self.rank, host=socket.gethostname(), pid=os.getpid(), time=time.time(),
                          error=error)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{_marker(self.rank)}.{os.getpid()}"
        tmp.write_text(json.dumps(asdict(failure)))
        os.replace(tmp, self.dir / _marker(self.rank))

    def others(self) -> list[Failure]:
        """Peers' failures, earliest first."""
        return [f for f in _read_all(self.dir) if f.rank != self.rank]


def _read_all(directory: Path) -> list[Failure]:
    found = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith("rank-") and n.endswith(".json")]
    except OSError:
        return []
    for name in names:
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append(Failure(**json.loads((directory / name).read_text())))
    return sorted(found, key=lambda f: (f.time, f.rank))


class PeerWatch:
    """Daemon thread: calls ``on_failure`` with the first peer failure it sees, then stops."""

    def __init__(self, board: FailureBoard, on_failure: Callable[[Failure], None], *,
                 interval_s: float = POLL_S) -> None:
        self.board, self.on_failure, self.interval_s = board, on_failure, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            failures = self.board.others()
            if failures:
                self.on_failure(failures[0])
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
