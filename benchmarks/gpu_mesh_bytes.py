"""Bytes each rank communicates per training step: FSDP (flat, all ranks) vs HSDP (2-D mesh).

Four gloo processes stand for 2 nodes x 2 GPUs (ranks 0-1 = node 0, 2-3 = node 1;
LOCAL_WORLD_SIZE=2, so HSDP shards within a node). Counting: FSDP2 issues its collectives
through ``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce``
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py); this script wraps those three (and
the ``*_tensor`` variants) for the run, and books each call under its process group: a
group whose ranks span both nodes is inter-node traffic, one inside a node intra-node. Bytes
per rank are the ring-algorithm volumes (what NCCL's ring sends per rank): all-gather and
reduce-scatter (n-1)/n of the full tensor, all-reduce 2(n-1)/n of it.

Run: ``python benchmarks/gpu_mesh_bytes.py [--layers 4] [--steps 2]`` (CPU only, ~1 min).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD, PER_NODE = 4, 2
WRAPPED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
)


def _count(totals: collections.Counter) -> None:
    """Wrap the collectives FSDP2 calls; add ring bytes per rank to totals[(kind, scope)]."""
    for name in WRAPPED:
        original = getattr(dist, name)

        def wrapper(*args, _name=name, _orig=original, **kwargs):
            group = kwargs.get("group")
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(WORLD))
            n = len(ranks)
            if _name == "all_reduce":
                full = args[0] if args else kwargs["tensor"]
                volume = 2 * (n - 1) / n * full.numel() * full.element_size()
            elif _name.startswith("all_gather"):
                out = args[0] if args else kwargs.get("output_tensor", kwargs.get("output"))
                volume = (n - 1) / n * out.numel() * out.element_size()
            else:
                inp = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
                volume = (n - 1) / n * inp.numel() * inp.element_size()
            scope = "inter-node" if len({r // PER_NODE for r in ranks}) > 1 else "intra-node"
            if n > 1:
                totals[(_name.split("_single")[0].split("_into")[0].replace("_tensor", ""), scope)] += volume
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapper)


def _worker(rank: int, mode: str, layers: int, steps: int, port: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank % PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import warnings

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the root's view output
    from training.backends.gpu import GpuBackend, GpuConfig
    from training.model.build import ModelConfig, build_model

    backend = GpuBackend(GpuConfig(distributed=mode), precision="bf16-mixed")
    backend.init()
    torch.manual_seed(0)
    cfg = ModelConfig(preset="sana-600m-512", overrides=dict(num_layers=layers, sample_size=8))
    model = backend.prepare_model(build_model(cfg))
    params = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    totals: collections.Counter = collections.Counter()

    def step() -> None:
        x = torch.randn(1, 32, 8, 8)
        text = torch.randn(1, 16, 2304)
        with backend.autocast():
            out = model(x, text, torch.tensor([500.0]), return_dict=False)[0]
        out.float().square().mean().backward()
        backend.clip_and_step(model, opt, 1.0)
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: lazy init, first all-gathers
    _count(totals)
    for _ in range(steps):
        step()
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "params": params,
                    "mesh": backend.describe()["mesh"],
                    "bytes": {f"{k}|{s}": v / steps for (k, s), v in totals.items()},
                }
            )
        )
    backend.close()


def measure(mode: str, layers: int, steps: int) -> dict:
    from training.backends.gpu import _free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.spawn(_worker, args=(mode, layers, steps, _free_port(), out), nprocs=WORLD, join=True)
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="sana-600m-512 blocks (the real width)")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    results = {mode: measure(mode, args.layers, args.steps) for mode in ("fsdp", "hsdp")}
    print(
        f"sana-600m-512 width, {args.layers} blocks ({results['fsdp']['params'] / 1e6:.1f}M params), "
        f"bf16-mixed, 4 gloo ranks = 2 nodes x 2; MiB per rank per step (ring volumes)"
    )
    print(f"{'mode':6} {'mesh':28} {'collective':16} {'intra-node':>11} {'inter-node':>11}")
    inter = {}
    for mode, r in results.items():
        by = collections.defaultdict(dict)
        for key, v in r["bytes"].items():
            kind, scope = key.split("|")
            by[kind][scope] = v / 2**20
        for kind, scopes in sorted(by.items()):
            print(
                f"{mode:6} {json.dumps(r['mesh']):28} {kind:16} {scopes.get('intra-node', 0):11.1f} "
                f"{scopes.get('inter-node', 0):11.1f}"
            )
        inter[mode] = sum(v for k, v in r["bytes"].items() if k.endswith("inter-node"))
        total = sum(r["bytes"].values())
        print(
            f"{mode:6} {'':28} {'total':16} {(total - inter[mode]) / 2**20:11.1f} {inter[mode] / 2**20:11.1f}"
        )
    print(f"inter-node bytes fsdp / hsdp: {inter['fsdp'] / max(inter['hsdp'], 1):.2f}x (measured, 2 x 2)")
    # The same per-step tensors on 8 nodes x 8 GPUs (64 ranks), from the counts above: flat FSDP
    # moves every all-gather / reduce-scatter in a group spanning nodes, HSDP only all-reduces
    # each gradient shard (1/8 of the gradients) across the 8 replicas.
    full = inter["fsdp"] / ((WORLD - 1) / WORLD)  # bytes of the gathered/reduced tensors per step
    shard = results["hsdp"]["bytes"]["all_reduce|inter-node"] / (
        2 * (WORLD // PER_NODE - 1) / (WORLD // PER_NODE)
    )
    fsdp64, hsdp64 = full * 63 / 64, 2 * 7 / 8 * shard * PER_NODE / 8
    print(
        f"projected 8 x 8: fsdp {fsdp64 / 2**20:.1f} MiB vs hsdp {hsdp64 / 2**20:.1f} MiB inter-node per rank "
        f"per step: {fsdp64 / hsdp64:.1f}x"
    )


if __name__ == "__main__":
    main()
