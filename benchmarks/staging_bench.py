"""Host memory of staging a sharded checkpoint on an XLA device (Trainium's path): old vs new.

``.venv-xla/bin/python benchmarks/staging_bench.py [--tensors 32] [--rows 1024] [--cols 1024]
[--world 32] [--reps 2] [--json PATH]``

The layout of ``trn-600m-512`` without ZeRO-1: every process holds every weight and moment
on its NeuronCore (replicated) and writes 1/world of the rows of each
(training/optim/sharding.py ``local_piece``). One process (PJRT_DEVICE=CPU here; the same
code on a trn node) makes ``--tensors`` fp32 tensors of ``--rows`` x ``--cols`` on the XLA
device, materialises them, and stages rank ``--rank``'s pieces with each variant in turn
(alternating between repetitions; the staged copies are dropped before the next). Every
buffer here is above the mmap threshold set below, so a freed one goes back to the OS and
cannot hide the next variant's growth. Reported per variant: the peak RSS growth while
staging (the kernel's high-water mark, reset first: proc(5) "clear_refs") and the bytes the
staged tensors keep alive until the background write ends (the storages they hold, counted
once each: a view holds its whole base), against the process's own share (its rows) and
the largest tensor:

- old: ``host[lo:hi].contiguous()``, a view that keeps each full host copy alive;
- new: the Stager of training/checkpoint/sharded.py (a clone of the rows, the copy dropped).

On PJRT CPU the device buffers live in host memory too; they exist before the baseline is
taken, so the growth is the staging's alone. ``--json PATH`` writes the numbers (tests/training/checkpoint/test_checkpoint_memory.py reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("old", "new")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _stage_old(pieces):
    """The previous XLA staging (kept here to measure against): a contiguous slice of a
    contiguous tensor is a view, so every full host copy stays alive with it."""
    out = {}
    for key, piece in pieces.items():
        host = piece.src.detach().cpu()
        rows = host if piece.lo is None else host[piece.lo:piece.hi]
        out[key] = (rows.contiguous(), piece.row0, piece.shape)
    return out


def _measure(args: argparse.Namespace) -> list[dict]:
    import gc

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from training.checkpoint.sharded import Stager
    from training.optim.sharding import local_piece

    device = torch_xla.device()
    tensors = [torch.randn(args.rows, args.cols, device=device) for _ in range(args.tensors)]
    torch_xla.sync()
    xm.wait_device_ops()  # the device buffers exist before any baseline is taken
    pieces = {f"t{i}": p for i, t in enumerate(tensors) if (p := local_piece(t, args.rank, args.world)) is not None}
    stages = {"old": _stage_old, "new": Stager().stage}
    for stage in stages.values():  # warm up the transfer path (first-call allocations)
        stage({"warm": local_piece(torch.zeros(8, args.cols, device=device), 0, 1)})
    results = []
    for rep in range(args.reps):
        for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")
            base = _status_kib("VmRSS")
            staged = stages[variant](pieces)
            peak = _status_kib("VmHWM") - base
            own = sum(t.numel() * t.element_size() for t, _, _ in staged.values())
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t, _, _ in staged.values()}
            results.append({"variant": variant, "peak_bytes": peak * 1024, "held_bytes": sum(storages.values()),
                            "own_bytes": own})
            del staged
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--world", type=int, default=32)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536" or "torch" in sys.modules:
        # Freed buffers must go back to the OS at once (mallopt(3) M_MMAP_THRESHOLD, read from
        # its environment variable when the process starts), so RSS after staging is what
        # staging still holds: run again with it set.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
        os.execve(sys.executable, [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env)
    results = _measure(args)
    summary = {"own_bytes": results[0]["own_bytes"], "largest_bytes": args.rows * args.cols * 4,
               "state_bytes": args.tensors * args.rows * args.cols * 4, "world": args.world}
    for variant in VARIANTS:
        runs = [r for r in results if r["variant"] == variant]
        summary[variant] = {k: statistics.median(r[k] for r in runs) for k in ("peak_bytes", "held_bytes")}
    mb = 1e6
    old, new = summary["old"], summary["new"]
    print(f"staging rank {args.rank} of {args.world}: {args.tensors} x {args.rows}x{args.cols} fp32 on the XLA "
          f"device ({summary['state_bytes'] / mb:.0f} MB replicated), own rows {summary['own_bytes'] / mb:.1f} MB, "
          f"largest tensor {summary['largest_bytes'] / mb:.1f} MB; medians of {args.reps}")
    print(f"{'':22s}{'old (view)':>12s}{'new (clone)':>13s}{'old/new':>9s}")
    for label, key in (("peak RSS growth [MB]", "peak_bytes"), ("held until write [MB]", "held_bytes")):
        ratio = old[key] / new[key] if new[key] > 0 else float("inf")
        print(f"{label:22s}{old[key] / mb:12.1f}{new[key] / mb:13.1f}{ratio:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
