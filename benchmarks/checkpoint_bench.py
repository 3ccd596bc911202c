"""Old (``checkpoint.format: full``) vs new (sharded, async) checkpoints, side by side.

``python benchmarks/checkpoint_bench.py [--ranks 4] [--dim 1024] [--blocks 8] [--reps 3]``

Spawns ``--ranks`` gloo processes (FSDP2 on CPU, the real GpuBackend and Checkpointer) on a
mid-size model (``--blocks`` x two dim x 4dim Linear layers; at the defaults 67M parameters:
270 MB of fp32 weights, 1.07 GB with AdamW moments and EMA) and, in interleaved repetitions
(the order of the formats alternates), saves and restores with each format, every save and
every restore in fresh processes (so no phase inherits another's freed heap). Per format it reports:
the time the training loop is blocked per save, the total save time (until the checkpoint is
committed), the bytes read back during the save (``/proc`` rchar of the saving processes: the
old path re-reads every file for its sha256), and the peak RSS growth per rank during save
and during restore (the kernel's RSS high-water mark, reset at the start of each). Then the EMA update, per-parameter ``lerp_`` vs
one ``torch._foreach_lerp_``, interleaved too. Last, the same cost model applied to Sana 1.6B
on 64 GPUs (8 x p5.48xlarge) with the bandwidths stated there.

``--json PATH`` writes the numbers (tests/training/checkpoint/test_checkpoint_memory.py reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMATS = ("full", "sharded")


class Blocks(nn.Module):
    """A stack of MLP blocks: ``transformer_blocks`` so FSDP2 shards one unit per block, as
    the GPU backend does for Sana."""

    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.transformer_blocks:
            x = x + block(x)
        return x


class PeakRss:
    """Peak RSS growth of this process while the block runs.

    The kernel's own high-water mark: writing "5" to /proc/self/clear_refs resets VmHWM to
    the current RSS, and /proc/self/status reports VmHWM afterwards (proc(5), "clear_refs",
    Linux >= 4.0). A sampling thread would miss peaks while a C++ call (torch.load, a copy)
    holds the GIL.
    """

    def __enter__(self) -> PeakRss:
        Path("/proc/self/clear_refs").write_text("5")
        self.base = _status_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = (_status_kib("VmHWM") - self.base) * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _read_chars() -> int:
    return psutil.Process().io_counters().read_chars


def _setup(rank: int, world: int, args: argparse.Namespace, port: int):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from training.backends.gpu import GpuBackend, GpuConfig
    from training.optim.ema import EMA, EmaConfig

    torch.set_num_threads(1)
    backend = GpuBackend(GpuConfig(distributed="fsdp"), precision="fp32")
    backend.init()
    torch.manual_seed(0)
    model = backend.prepare_model(Blocks(args.dim, args.blocks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, args.dim)).sum().backward()
    optimizer.step()
    ema = EMA(model, EmaConfig(decay=0.99))
    return backend, model, optimizer, ema


def _worker(rank: int, world: int, args: argparse.Namespace, root: Path, port: int, phase: str, fmt: str,
            rep: int) -> None:
    """One measurement in a fresh process (so one phase's freed memory cannot hide the next
    one's growth): ``save`` or ``restore`` with format ``fmt``, or the EMA update timing."""
    from training.checkpoint.checkpointer import Checkpointer
    from training.checkpoint.config import CheckpointConfig
    from training.checkpoint.train_state import TrainState

    backend, model, optimizer, ema = _setup(rank, world, args, port)
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters()) * 4  # weights + 2 moments + EMA
    out: dict = {"rank": rank, "phase": phase, "format": fmt, "rep": rep, "shard_bytes": shard_bytes}
    ckpt_root = root / f"{fmt}-{rep}"
    backend.barrier()
    if phase == "save":
        ckpt = Checkpointer(CheckpointConfig(dir=str(ckpt_root), format=fmt, every_steps=0), backend,
                            output_dir=root)
        backend.barrier()
        read0 = _read_chars()
        with PeakRss() as rss:
            t0 = time.perf_counter()
            path = ckpt.save(step=1, model=model, optimizer=optimizer, ema=ema, state=TrainState(step=1))
            out["blocked_s"] = time.perf_counter() - t0
            ckpt.wait()
            out["save_s"] = time.perf_counter() - t0
        out["read_back_bytes"] = _read_chars() - read0
        out["save_peak_rss"] = rss.peak
        backend.barrier()
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in path.iterdir())
    elif phase == "restore":
        ckpt = Checkpointer(CheckpointConfig(dir=str(ckpt_root), resume="auto"), backend, output_dir=root)
        backend.barrier()
        with PeakRss() as rss:
            t0 = time.perf_counter()
            assert ckpt.restore(model=model, optimizer=optimizer, ema=ema, state=TrainState()) is not None
            out["restore_s"] = time.perf_counter() - t0
        out["restore_peak_rss"] = rss.peak
    else:
        out["ema"] = _ema_bench(model, ema, args.ema_reps)
    backend.barrier()
    (root / f"{phase}-{fmt}-{rep}-rank-{rank}.json").write_text(json.dumps(out))
    backend.close()


@torch.no_grad()
def _ema_bench(model: nn.Module, ema, reps: int) -> dict:
    """Per-parameter lerp_ (the old EMA.update) vs one _foreach_lerp_ (the new), interleaved."""
    named = dict(model.named_parameters())
    times: dict[str, list[float]] = {"per_param": [], "foreach": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        for name, shadow in ema.shadow.items():
            shadow.lerp_(named[name].detach().float(), 0.01)
        times["per_param"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ema.update(model, 10)
        times["foreach"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def summarize(results: list[dict]) -> dict:
    """Medians over repetitions of: the slowest rank (times), the largest rank (memory),
    the sum over ranks (bytes read back)."""
    summary: dict = {"ranks": 1 + max(r["rank"] for r in results),
                     "shard_bytes": max(r["shard_bytes"] for r in results)}
    aggs = {"blocked_s": max, "save_s": max, "read_back_bytes": sum, "save_peak_rss": max,
            "checkpoint_bytes": max, "restore_s": max, "restore_peak_rss": max}
    for fmt in FORMATS:
        summary[fmt] = {}
        for key, agg in aggs.items():
            runs = [r for r in results if r["format"] == fmt and key in r]
            reps = sorted({r["rep"] for r in runs})
            summary[fmt][key] = statistics.median(agg(r[key] for r in runs if r["rep"] == rep) for rep in reps)
    ema = [r["ema"] for r in results if "ema" in r]
    if ema:
        summary["ema"] = {k: statistics.median(e[k] for e in ema) for k in ema[0]}
    return summary


def extrapolate(summary: dict) -> list[str]:
    """The cost model behind the measured ratios, applied to Sana 1.6B on 64 H100s.

    Old path: rank 0 receives the full state (FSDP full_state_dict gather, cpu_offload),
    writes it as one client, then re-reads it for sha256; every other rank waits. New: each
    rank copies its 1/64 to pinned memory (the only blocking part), then writes it while
    hashing; the job finishes when the slowest rank and the shared filesystem are done.
    """
    state = 1.6e9 * 16  # bytes: fp32 weights + 2 AdamW moments + EMA (25.6 GB)
    ranks = 64
    d2h, gather, client_write, fsx_aggregate, sha = 20e9, 10e9, 1.5e9, 10e9, 1.0e9  # bytes/s
    old_blocked = state / gather + state / client_write + state / sha
    new_blocked = state / ranks / d2h
    new_total = max(state / ranks / min(client_write, sha), state / fsx_aggregate)
    return [
        "1.6B on 64 GPUs (assumed: 20 GB/s pinned D2H per GPU, 10 GB/s gather into rank 0, 1.5 GB/s "
        "per FSx client, 10 GB/s FSx aggregate, 1 GB/s sha256 per core):",
        f"  old: blocked {old_blocked:7.1f} s per save (gather {state / gather:.1f} + write "
        f"{state / client_write:.1f} + re-read for sha256 {state / sha:.1f}); rank 0 holds {state / 1e9:.1f} GB",
        f"  new: blocked {new_blocked:7.2f} s per save (D2H of {state / ranks / 1e9:.2f} GB/rank); background "
        f"write {new_total:.1f} s (FSx-aggregate bound); no rank holds more than {state / ranks / 1e9:.2f} GB",
        f"  ratio blocked old/new: {old_blocked / new_blocked:,.0f}x",
    ]


def report(summary: dict) -> str:
    old, new = summary["full"], summary["sharded"]
    mb = 1e6
    lines = [f"{summary['ranks']} gloo ranks (FSDP2, CPU), {old['checkpoint_bytes'] / mb:.0f} MB per checkpoint, "
             f"{summary['shard_bytes'] / mb:.0f} MB of state per rank; medians over repetitions",
             f"{'':24s}{'old (full)':>14s}{'new (sharded)':>16s}{'old/new':>10s}"]
    rows = [("blocked per save [s]", "blocked_s", 1), ("total save [s]", "save_s", 1),
            ("bytes read back [MB]", "read_back_bytes", mb), ("peak RSS save [MB]", "save_peak_rss", mb),
            ("restore [s]", "restore_s", 1), ("peak RSS restore [MB]", "restore_peak_rss", mb)]
    for label, key, scale in rows:
        ratio = old[key] / new[key] if new[key] else float("inf")
        lines.append(f"{label:24s}{old[key] / scale:14.3f}{new[key] / scale:16.3f}{ratio:10.1f}")
    if "ema" in summary:
        ema = summary["ema"]
        lines.append(f"EMA update [ms]: per-parameter lerp_ {ema['per_param'] * 1e3:.2f}, foreach "
                     f"{ema['foreach'] * 1e3:.2f} (ratio {ema['per_param'] / ema['foreach']:.1f}x)")
    return "\n".join(lines + extrapolate(summary))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ema-reps", type=int, default=20)
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    from training.backends.gpu import _free_port

    # Freed tensors go back to the OS at once, so a phase's RSS growth is its own memory, not
    # hidden by heap that setup freed (mallopt(3): setting M_MMAP_THRESHOLD, here through its
    # environment variable, serves every larger allocation by mmap and turns off the dynamic
    # threshold). The spawned ranks inherit it.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        root = Path(tmp)
        for rep in range(args.reps):  # interleaved: the order of the formats alternates
            for fmt in (FORMATS if rep % 2 == 0 else FORMATS[::-1]):
                for phase in ("save", "restore"):
                    mp.spawn(_worker, args=(args.ranks, args, root, _free_port(), phase, fmt, rep),
                             nprocs=args.ranks, join=True)
        if args.ema_reps:
            mp.spawn(_worker, args=(args.ranks, args, root, _free_port(), "ema", "-", 0), nprocs=args.ranks,
                     join=True)
        results = [json.loads(f.read_text()) for f in sorted(root.glob("*-rank-*.json"))]
    summary = summarize(results)
    print(report(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
