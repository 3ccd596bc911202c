"""What every training entrypoint does around the loop, so gpu.py and trainium.py only pick
their backend (STYLE.md rule 1: parse, build, train, close)."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from training.backends.base import Backend
from training.config import TrainConfig
from training.failure import FailureBoard, PeerWatch, finish, leave, peer_failed
from training.loop import train


def run(cfg: TrainConfig, backend: Backend, summary: Callable[[], dict[str, Any]] | None = None, *,
        reset_logging: bool = False) -> None:
    """Init the backend, train, print a one-line JSON summary on rank 0, close.

    In a distributed run (torchrun's WORLD_SIZE > 1) a failure on any rank ends every rank
    within seconds, the failed one first with its traceback (training/failure/): this
    function then never returns.

    Args:
        summary: extra fields for the summary line (e.g. Trainium's compile counts).
        reset_logging: replace the root logger's handlers. torch-xla's init has already given
            it a WARNING handler, which would make basicConfig a no-op and hide the
            step/loss/checkpoint log; elsewhere existing handlers (a caller's) are kept.

    Raises:
        SystemExit: 128 + signal number when SIGTERM/SIGUSR1 stopped the run early.
    """
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    board: FailureBoard | None = None
    watch: PeerWatch | None = None
    try:
        backend.init()
        logging.basicConfig(level=logging.INFO if backend.is_main else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr,
                            force=reset_logging)
        if distributed:
            board = FailureBoard.open(cfg.output_dir, rank=backend.rank, broadcast=backend.broadcast_object)
            watch = PeerWatch(board, lambda failure: peer_failed(failure, rank=backend.rank))
        result = train(cfg, backend)
    except BaseException as exc:
        if not distributed:
            backend.close()
            raise
        # No collective, no teardown that could wait on a peer: report, mark, exit.
        leave(exc, rank=int(os.environ.get("RANK", backend.rank)), board=board)
    if watch is not None:
        watch.stop()
    try:
        if backend.is_main:
            print(json.dumps({"steps": result.steps, "final_loss": result.final_loss,
                              "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                              "output_dir": cfg.output_dir, **(summary() if summary else {})}), flush=True)
    finally:
        backend.close()
    code = 0 if result.stopped_by is None else 128 + result.stopped_by  # Slurm asked us to stop: say so
    if distributed:
        del result  # (the model: its process-group references go with it where torch lets them)
        finish(code)  # no interpreter finalisation beside gloo's threads (training/failure/leave.py)
    if code:
        raise SystemExit(code)
