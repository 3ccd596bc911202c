"""When one rank fails, every rank ends in seconds, and the job log says which rank and why.

The same on every backend (the entry, training/loop.py ``run``, runs it for training.gpu and
training.trainium alike):

1. The failing rank stops taking part in collectives. The loop abandons a checkpoint save in
   flight without waiting on any other rank (``Checkpointer.abandon``: it is never committed
   half; the previous checkpoint stays the newest complete one) and skips every cleanup that
   is a collective (the commit wait, the final barrier, the stop-signal exchange).
2. It prints its own traceback, each line prefixed ``[rank R]`` and flushed, before anything
   that waits on a peer; writes a failure marker on the run directory (``board.py``) and
   torchrun's error file (``leave.py``), and exits 1 (2 for a UserError, shown as one line).
3. Every other rank sees the marker within ``board.POLL_S`` (1 s), wherever its main thread
   is - a collective that will never complete included - prints ``[rank Q] stopping: rank R
   (<host>, pid <pid>) failed: <error>`` and exits 3 about ``leave.LAST_OUT_S`` (1 s) later.
   A rank whose collective fails first (gloo notices a closed peer at once) takes the same
   path as soon as the marker is there.

Measured bound (tests/training/failure/test_failures.py, 2 and 4 gloo ranks on 2 shared cores): every
process gone within a few seconds of the failure, against 30 minutes of the NCCL watchdog.

Backstops for what leaves no marker (SIGKILL, the OOM killer, a segfault): torchrun stops the
other workers of its node (SIGTERM, SIGKILL 30 s later: torch/distributed/elastic/
multiprocessing/api.py ``_close``), and ``srun --kill-on-bad-exit=1`` (training/slurm/launch.sh)
ends the other nodes' tasks once that torchrun exits non-zero.
"""
