"""All-reduce bandwidth probe, one process per GPU under torchrun (gloo on CPU for tests).

Every rank contributes ``rank + 1``; the sum must be ``world * (world + 1) / 2`` everywhere
(a wrong value fails the check, not just a slow one). Bandwidths follow nccl-tests'
definitions (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): algbw = bytes / time, and for
all-reduce busbw = algbw * 2 * (n - 1) / n, the number comparable with the link speed.
Rank 0 prints one line ``SMOKE_ALLREDUCE {json}`` that the smoke job parses.

    torchrun --nnodes=2 --nproc-per-node=8 ... -m training.smoke.allreduce --backend nccl
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Sequence

MARKER = "SMOKE_ALLREDUCE"


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.smoke.allreduce")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--size-mib", type=float, default=256.0, help="message size per all-reduce")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, device_id=device if args.backend == "nccl" else None)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        numel = max(1, int(args.size_mib * 2**20) // 4)
        buf = torch.empty(numel, dtype=torch.float32, device=device)

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        buf.fill_(rank + 1)
        dist.all_reduce(buf)
        sync()
        expected = world * (world + 1) / 2
        correct = bool(torch.all(buf == expected))
        for _ in range(args.warmup):
            dist.all_reduce(buf)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(buf)
        sync()
        seconds = (time.perf_counter() - start) / args.iters
        ok = torch.tensor([1.0 if correct else 0.0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank must have summed correctly
        hosts: list[str | None] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname().split(".")[0])
        algbw = numel * 4 / seconds / 1e9
        return {"rank": rank, "world_size": world, "backend": args.backend, "correct": bool(ok.item() == 1.0),
                "bytes": numel * 4, "time_us": seconds * 1e6, "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world - 1) / world if world > 1 else 0.0,
                "nodes": sorted(set(hosts)),
                "nccl": torch.cuda.nccl.version() if args.backend == "nccl" else None}
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    result = run(_args(argv))
    if result["rank"] == 0:
        print(f"{MARKER} {json.dumps(result)}", flush=True)
    if not result["correct"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
