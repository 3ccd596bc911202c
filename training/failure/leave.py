"""How a training process leaves when it, or a peer, failed: report first, then exit at once.

Exit codes of a training rank (runbooks/checkpoints-and-recovery.md, "When a rank fails"):

- ``1`` this rank raised (its traceback above, every line prefixed ``[rank R]``);
- ``2`` a ``UserError`` (one line naming the input and the fix);
- ``3`` this rank was healthy and stopped because another rank failed (the line names it);
- ``128 + signal`` stopped by SIGTERM/SIGUSR1 after a checkpoint (training/failure/preemption.py).

A distributed rank leaves with ``os._exit`` after flushing: interpreter teardown would join
threads and destroy process groups whose peers are gone (NCCL's ``destroy_process_group``
and gloo's worker threads can block on them), and CPython's finalisation stops daemon
threads that are inside C++ code with a forced unwind that aborts the process ("terminate
called without an active exception"), which would replace the exit code and the message.
Files are durable before that point: checkpoints are fsynced and atomic (a save in flight
is simply never committed), metrics.jsonl is line-buffered and closed by the loop.

torchrun's own report (its "Root Cause (first observed failure)" table) reads the error file
``TORCHELASTIC_ERROR_FILE`` names; it is written here through torch's own
``ErrorHandler.record_exception`` (torch/distributed/elastic/multiprocessing/errors/
error_handler.py, what ``@record`` calls), so the launcher names the failed rank and its error
even where only local rank 0's console reaches the job log (launch.sh ``--local-ranks-filter=0``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

from training.errors import UserError
from training.failure.board import Failure, FailureBoard

EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_PEER_FAILED = 3
#: a rank stopped by a peer's failure exits this long after it noticed, so the launcher (torchrun
#: polls its workers every 0.1 s) records the failed rank first and names it as the root cause
LAST_OUT_S = 1.0
#: a collective error is usually a peer's exit: wait this long for its marker before calling it ours
PEER_MARKER_WAIT_S = 2.0

_leaving = threading.Lock()


class PeerFailed(RuntimeError):
    """This rank stopped because another rank failed (what torchrun's error file says)."""


def rank_prefix(rank: int | None = None) -> str:
    return f"[rank {os.environ.get('RANK', '0') if rank is None else rank}] "


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _print(lines: list[str], prefix: str) -> None:
    sys.stdout.flush()
    sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
    sys.stderr.flush()


def _record(exc: BaseException) -> None:
    """torchrun's error file (nothing without TORCHELASTIC_ERROR_FILE); call inside ``except``."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception:  # noqa: BLE001 - the report above already went out; never fail leaving
        pass


def finish(code: int = 0) -> NoReturn:
    """The end of a distributed rank that succeeded (or stopped on a signal), after the loop
    and the backend closed everything they own: run the atexit handlers (torch-xla's runtime
    shutdown, logging's flush) while the interpreter is whole, then exit without finalising it.

    Why not a plain return: ``destroy_process_group`` does not stop gloo's worker threads
    while torch still references the group (measured: DDP keeps ten references to it after
    the DDP module is gone, and every DDP and FSDP2 rank of this package still had gloo's three
    threads at atexit time), so interpreter finalisation would run beside them; one that
    releases a tensor Python owns then takes the GIL during finalisation and the process aborts
    with "terminate called without an active exception" (pytorch/pytorch#179291 describes the
    mechanism), a SIGABRT seen on rank 1 of a resharding test under CPU contention."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # what normal interpreter exit runs first (CPython Modules/atexitmodule.c)
    _exit(code)


def _exit(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _claim() -> None:
    """Only one thread reports and exits; any other one waits here for the process to end.

    From here on SIGTERM/SIGUSR1 are ignored (main thread only: Python sets handlers there):
    torchrun sends SIGTERM to the other workers the moment the failed one exits, and the
    default action would end this rank before it said why (it exits within seconds anyway;
    torchrun's SIGKILL follows 30 s later)."""
    _hold_stop_signals()
    if not _leaving.acquire(blocking=False):
        while True:
            time.sleep(3600)


def _hold_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)


def _is_collective_error(exc: BaseException) -> bool:
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except ImportError:
        pass
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo", "NCCL"))


def peer_failed(failure: Failure, *, rank: int, cause: BaseException | None = None) -> NoReturn:
    """This rank is healthy and a peer failed: say which, and exit 3. Runs on the watch thread
    (the main thread may be blocked in a collective that never returns) or in ``leave``."""
    _claim()
    lines = [f"stopping: {failure.describe()}"]
    if cause is not None:
        lines.append(f"(this rank then saw {one_line(cause)})")
    _print(lines, rank_prefix(rank))
    try:
        raise PeerFailed(f"stopped because {failure.describe()}") from cause
    except PeerFailed as exc:
        _record(exc)
    time.sleep(LAST_OUT_S)
    _exit(EXIT_PEER_FAILED)


def leave(exc: BaseException, *, rank: int, board: FailureBoard | None) -> NoReturn:
    """The main thread's exception ended the run on this rank (call inside ``except``).

    A collective error (a peer's exit closes its connections) with a peer's marker on the
    board makes this rank a casualty (``peer_failed``). Anything else is this rank's own
    failure: print the traceback (a UserError as one line), mark the board, write
    torchrun's error file, exit 1 (2)."""
    _hold_stop_signals()
    if board is not None and _is_collective_error(exc):
        deadline = time.monotonic() + PEER_MARKER_WAIT_S
        while not (peers := board.others()) and time.monotonic() < deadline:
            time.sleep(0.1)
        if peers:
            peer_failed(peers[0], rank=rank, cause=exc)
    _claim()
    user = isinstance(exc, UserError)
    lines = [f"error: {exc}"] if user else "".join(traceback.format_exception(exc)).rstrip("\n").splitlines()
    _print(lines, rank_prefix(rank))
    if board is not None:
        try:
            board.mark(one_line(exc))
        except OSError as err:
            _print([f"could not write the failure marker in {board.dir}: {err}"], rank_prefix(rank))
    _record(exc)
    _exit(EXIT_USER_ERROR if user else EXIT_FAILED)
