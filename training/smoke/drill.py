"""``SANA_DRILL_FAULTS="raise:1:3" torchrun ... -m training.smoke.drill [--trainium] <training args>``

A failure drill: the real training entrypoint (``python -m training.gpu``, or with
``--trainium`` ``python -m training.trainium``) with faults injected into its steps, to see on
real hardware what the tests show on gloo: one rank fails after a checkpoint and every rank
is gone within seconds, the job log naming it. On NCCL and on Neuron a collective whose peer
left does not fail, it waits, so only the failure markers (training/failure/board.py) can end
the healthy ranks there: this is the check that proves it on a GPU or Trainium node.

``SANA_DRILL_FAULTS`` holds space-separated ``<what>:<rank>:<step>`` (torchrun's RANK; the
step is 1-based, applied as that optimizer step starts):

- ``raise``: a RuntimeError out of the step (a bug, an OOM);
- ``block``: the main thread blocks for good, as in a collective whose peer is gone (on gloo,
  which notices a closed peer at once, the faithful stand-in for NCCL and Neuron);
- ``sigterm`` / ``sigusr1``: the process signals itself, as scancel does to every task.

Example on one 8-GPU node (runbooks/checkpoints-and-recovery.md, "When a rank fails")::

    SANA_DRILL_FAULTS="raise:3:5" torchrun --nproc-per-node 8 -m training.smoke.drill \\
        --config training/configs/sana-600m-512.yaml --set data.path=/fsx/data/features/my-set \\
        --set checkpoint.every_steps=2 --max-steps 20 --output-dir /fsx/checkpoints/drill-$USER

Expect ``[rank 3] RuntimeError: injected fault on rank 3 at step 5``, then
``[rank Q] stopping: rank 3 (...) failed: ...`` from the others and torchrun's exit within
a few seconds; ``checkpoints/`` holds complete checkpoints only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

FAULTS_ENV = "SANA_DRILL_FAULTS"
KINDS = ("raise", "block", "sigterm", "sigusr1")


def parse(spec: str, rank: int) -> dict[int, str]:
    """``SANA_DRILL_FAULTS`` -> {step: what} for this rank."""
    faults: dict[int, str] = {}
    for item in spec.split():
        try:
            what, on_rank, step = item.split(":")
            on_rank_i, step_i = int(on_rank), int(step)
        except ValueError:
            raise SystemExit(f"{FAULTS_ENV}: {item!r} is not <what>:<rank>:<step>") from None
        if what not in KINDS:
            raise SystemExit(f"{FAULTS_ENV}: {what!r} is not one of {', '.join(KINDS)}")
        if on_rank_i == rank:
            faults[step_i] = what
    return faults


def install(faults: dict[int, str], rank: int) -> None:
    """Wrap the loop's ``train_step`` so that the faults fire as their steps start."""
    import training.loop

    real = training.loop.train_step
    calls = [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        what = faults.get(calls[0])
        if what == "raise":
            raise RuntimeError(f"injected fault on rank {rank} at step {calls[0]}")
        if what == "block":
            threading.Event().wait()
        if what in ("sigterm", "sigusr1"):
            os.kill(os.getpid(), signal.SIGTERM if what == "sigterm" else signal.SIGUSR1)
        return real(*args, **kwargs)

    training.loop.train_step = train_step


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    trainium = argv[:1] == ["--trainium"]
    rank = int(os.environ.get("RANK", "0"))
    install(parse(os.environ.get(FAULTS_ENV, ""), rank), rank)
    if trainium:
        from training.trainium import main as entry
    else:
        from training.gpu import main as entry
    entry(argv[1:] if trainium else argv)


if __name__ == "__main__":
    main(sys.argv[1:])
