"""Rank 0's wait for the other ranks' done records: filesystem calls and CPU, old vs new.

``python benchmarks/commit_wait_bench.py [--ranks 128] [--spread 2.0] [--reps 3]``

A writer process plays ranks 1..N-1 finishing their shards one after another over
``--spread`` seconds (each publishes its done record the way training/checkpoint/sharded.py
does: written under a temp name, then renamed); rank 0, in this process, waits for all of
them, with each variant in turn (alternating between repetitions):

- old: the previous loop, kept here to measure against: every 5 ms, for every rank still
  missing, ``exists()`` of its failure record and a read of its done record;
- new: ``sharded.wait_for_ranks``: one listing of the directory and one of its parent per
  poll, backing off from 10 ms to 1 s, each record read once.

Counted in the waiting thread only, while it waits: stat calls (``os.stat``, what
``Path.exists`` does), opens (the ``open`` audit event) and directory listings (the
``os.scandir`` / ``os.listdir`` audit events, sys.audit). On FSx for Lustre each of these is
a metadata operation: a stat or an open is a round trip to the metadata server unless
cached, a listing one per few hundred entries. Also: the waiting thread's CPU seconds
(time.thread_time: GIL time taken from training) and how long after the last record the
wait returned.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("old", "new")


def _write_records(tmp: str, ranks: int, spread: float, start_at: float, done_at) -> None:
    """Ranks 1..ranks-1 publish their done records, evenly spread (runs in its own process)."""
    tmp_dir = Path(tmp)
    for rank in range(1, ranks):
        wake = start_at + spread * rank / max(1, ranks - 1)
        time.sleep(max(0.0, wake - time.time()))
        name = f"rank-{rank:05d}.done.json"
        part = tmp_dir / f".{name}.part"
        part.write_text(json.dumps({"rank": rank, "step": 1, "files": {}}))
        os.replace(part, tmp_dir / name)
    done_at.value = time.time()


def _old_wait(tmp: Path, world_size: int, timeout_s: float) -> dict[int, dict]:
    """The previous rank-0 loop (training/checkpoint/sharded.py before this change)."""
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict] = {}
    while len(records) < world_size:
        for rank in range(world_size):
            if rank in records:
                continue
            if (tmp / f"rank-{rank:05d}.failed.json").exists():
                raise OSError(f"rank {rank} failed")
            with contextlib.suppress(OSError, ValueError):  # not written yet: look again
                records[rank] = json.loads((tmp / f"rank-{rank:05d}.done.json").read_text())
        if len(records) < world_size:
            if time.monotonic() > deadline:
                raise OSError("timeout")
            time.sleep(0.005)
    return records


class FsCalls:
    """Counts filesystem calls made by one thread while ``active``."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.active = False
        self.thread = threading.get_ident()
        self._stat = os.stat
        sys.addaudithook(self._audit)
        os.stat = self._counting_stat  # pathlib's exists()/stat() call os.stat at call time

    def _mine(self) -> bool:
        return self.active and threading.get_ident() == self.thread

    def _audit(self, event: str, args: tuple) -> None:
        if event in ("open", "os.scandir", "os.listdir") and self._mine():
            self.counts["listing" if event != "open" else "open"] += 1

    def _counting_stat(self, *args, **kwargs):
        if self._mine():
            self.counts["stat"] += 1
        return self._stat(*args, **kwargs)


def measure(variant: str, args: argparse.Namespace, calls: FsCalls, work: Path) -> dict:
    from training.checkpoint.sharded import wait_for_ranks

    tmp = work / f"{variant}-{time.monotonic_ns()}" / ".tmp-step-00000001"
    tmp.mkdir(parents=True)
    (tmp / "rank-00000.done.json").write_text(json.dumps({"rank": 0, "step": 1, "files": {}}))
    ctx = mp.get_context("spawn")
    done_at = ctx.Value("d", 0.0)
    start_at = time.time() + 0.5  # the writer is up before the first record is due
    writer = ctx.Process(target=_write_records, args=(str(tmp), args.ranks, args.spread, start_at, done_at))
    writer.start()
    time.sleep(max(0.0, start_at - time.time()))
    calls.counts.clear()
    calls.active = True
    cpu0, t0 = time.thread_time(), time.time()
    try:
        if variant == "old":
            got = _old_wait(tmp, args.ranks, 60)
        else:
            got = wait_for_ranks(tmp, world_size=args.ranks, timeout_s=60)
    finally:
        calls.active = False
    t1, cpu = time.time(), time.thread_time() - cpu0
    writer.join()
    assert len(got) == args.ranks
    ops = sum(calls.counts.values())
    return {"variant": variant, "wall_s": t1 - t0, "cpu_s": cpu, "ops": ops, "ops_per_s": ops / (t1 - t0),
            "after_last_s": t1 - done_at.value, **{k: calls.counts[k] for k in ("stat", "open", "listing")}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=128)
    p.add_argument("--spread", type=float, default=2.0, help="seconds over which ranks 1..N-1 finish")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    calls = FsCalls()
    results = []
    with tempfile.TemporaryDirectory(prefix="commit-wait-") as work:
        for rep in range(args.reps):
            for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                results.append(measure(variant, args, calls, Path(work)))
    keys = ("wall_s", "cpu_s", "ops", "ops_per_s", "after_last_s", "stat", "open", "listing")
    summary = {v: {k: statistics.median(r[k] for r in results if r["variant"] == v) for k in keys} for v in VARIANTS}
    summary["ranks"], summary["spread_s"] = args.ranks, args.spread
    old, new = summary["old"], summary["new"]
    print(f"rank 0 waiting for {args.ranks - 1} done records arriving over {args.spread:.1f} s; "
          f"medians of {args.reps} interleaved repetitions")
    print(f"{'':30s}{'old':>12s}{'new':>12s}{'old/new':>10s}")
    rows = [("filesystem calls", "ops"), ("  of which stat", "stat"), ("  of which open", "open"),
            ("  of which listings", "listing"), ("filesystem calls per second", "ops_per_s"),
            ("waiting thread CPU [s]", "cpu_s"), ("returned after last [s]", "after_last_s")]
    for label, key in rows:
        ratio = f"{old[key] / new[key]:10.1f}" if new[key] else f"{'-':>10s}"
        print(f"{label:30s}{old[key]:12.3f}{new[key]:12.3f}{ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
