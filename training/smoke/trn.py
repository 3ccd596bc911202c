"""On-cluster smoke test of the Trainium backend's distributed path (what PJRT CPU cannot test).

Run on trn nodes, one process per NeuronCore, e.g. from an allocation on the ``trn`` partition::

    torchrun --nproc_per_node=32 -m training.smoke.trn --steps 5
    torchrun --nproc_per_node=32 -m training.smoke.trn --steps 5 --zero1

Every rank trains the same model from the same seed on DIFFERENT data (a rank-dependent
batch), through the shared loop's ``train_step`` and the real objective. If the gradient
all-reduce (or ZeRO-1's reduce-scatter + all-gather) works, every parameter stays identical
on every rank; without it they diverge after one step. Checked here, each with a
non-vacuity control:

1. ``all_reduce`` of the rank ids returns ``world*(world-1)/2`` on every rank (XLA
   collectives across processes; silently wrong on PJRT CPU, pytorch/xla#5005);
2. the per-rank losses differ (the ranks really saw different data);
3. after ``--steps`` steps, per-parameter checksums are bit-identical across ranks;
4. the compile count does not grow after the warm-up step (no recompiling step);
5. ``broadcast_object`` / ``barrier`` (rendezvous) work; the full CPU state dicts on rank 0
   have every parameter at its full shape (ZeRO-1 gathers its shards);
6. every rank traced the same step graph: the hash of the last step's pending graph
   (forward, backward, all-reduce, optimizer; ``step_graph_hash``) is all-gathered and must
   be one value (a rank-dependent constant would mean one neuronx-cc compile per rank and
   replicas running different programs; tests/xla/test_same_graph.py proves it on PJRT CPU).

Prints one JSON line on rank 0 and exits 1 if any check fails. Also runs on one process
(``python -m training.smoke.trn``), where checks 1-3 are trivially true: useful only to see
the script work.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from training.errors import exits_cleanly


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.smoke.trn", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to train (>= 2)")
    p.add_argument("--preset", default="tiny", help="model preset (training/model/build.py PRESETS)")
    p.add_argument("--precision", default="bf16-mixed", choices=("fp32", "bf16-mixed", "bf16"))
    p.add_argument("--zero1", action="store_true", help="shard AdamW state with ZeRO-1")
    p.add_argument("--batch-size", type=int, default=2, help="samples per rank per step")
    p.add_argument("--text-tokens", type=int, default=32, help="padded caption length")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (step 1 compiles; the check needs a steady step after it)")
    return args


def _batches(shape: tuple[int, int, int], text_dim: int, tokens: int, batch: int, rank: int):
    """Endless random batches, different on every rank (seeded by rank) and on the host."""
    import torch

    gen = torch.Generator().manual_seed(10_000 + rank)
    while True:
        yield {"latents": torch.randn(batch, *shape, generator=gen),
               "text": torch.randn(batch, tokens, text_dim, generator=gen),
               "text_mask": torch.ones(batch, tokens, dtype=torch.long)}


def step_graph_tensors(model: Any, optimizer: Any, *outputs: Any) -> list[Any]:
    """Every tensor an optimizer step updates: parameters, optimizer state (of a ZeRO-1
    wrapper's base optimizer too, whose fp32 shards are what it steps) and ``outputs``."""
    import torch

    opts = [optimizer, getattr(optimizer, "base_optimizer", None)]
    found = [*outputs, *model.parameters()]
    for opt in filter(None, opts):
        found += [p for group in opt.param_groups for p in group["params"]]
        found += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    unique = {id(t): t for t in found if t.device.type == "xla"}  # first occurrence's order
    return list(unique.values())


def step_graph_hash(tensors: Sequence[Any]) -> str:
    """Hex hash of the pending (not yet synced) XLA graph that computes ``tensors``: call it
    after a step is traced and before ``sync()``. It is torch-xla's own graph hash
    (``torch_xla._XLAC._get_graph_hash``, pytorch/xla v2.9 torch_xla/csrc/init_python_bindings.cpp),
    the key its compilation cache looks graphs up by, so equal hashes on two ranks mean one
    compile serves both."""
    import torch_xla

    return torch_xla._XLAC._get_graph_hash(list(tensors)).hex()


def _hash_words(digest: str) -> list[float]:
    """A hex digest as exact small floats (16-bit words) for an all-gather."""
    raw = bytes.fromhex(digest)
    return [float(int.from_bytes(raw[i:i + 2], "big")) for i in range(0, len(raw), 2)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from training.backends.neuron import NeuronBackend
    from training.backends.neuron_config import NeuronConfig
    from training.loop import train_step
    from training.model.build import ModelConfig, build_model
    from training.objective import ObjectiveConfig, RectifiedFlow
    from training.optim.factory import OptimConfig, build_scheduler, optimizer_factory

    backend = NeuronBackend(NeuronConfig(zero1=args.zero1), precision=args.precision)
    backend.init()
    checks: dict[str, bool] = {}
    try:
        world, rank, device = backend.world_size, backend.rank, backend.device
        ids = torch.tensor([float(rank)], device=device)
        total = xm.all_reduce(xm.REDUCE_SUM, ids)
        torch_xla.sync()
        checks["all_reduce"] = float(total.cpu()) == world * (world - 1) / 2

        torch.manual_seed(0)  # same init everywhere (prepare_model also broadcasts rank 0's)
        model_cfg = ModelConfig(preset=args.preset)
        model = backend.prepare_model(build_model(model_cfg))
        optim = OptimConfig(lr=1e-3, max_grad_norm=1.0)
        optimizer = backend.build_optimizer(model, optimizer_factory(optim, model))
        scheduler = build_scheduler(optimizer, optim, max_steps=args.steps)
        kw = model_cfg.model_kwargs()
        size = int(kw.get("sample_size", 32))
        shape = (int(kw["in_channels"]), size, size)
        text_dim = int(kw["caption_channels"])
        # Host tensors moved over are device data; torch.zeros(..., device=xla) would be a traced
        # op inside step 1's graph only, i.e. one extra compile that the check below would catch.
        objective = RectifiedFlow(ObjectiveConfig(), vae_scaling_factor=1.0,
                                  null_text=torch.zeros(args.text_tokens, text_dim).to(device),
                                  null_mask=torch.ones(args.text_tokens, dtype=torch.long).to(device),
                                  rank=rank, world_size=world)
        batches = backend.device_batches(_batches(shape, text_dim, args.text_tokens, args.batch_size, rank))
        compiles, losses = [], []
        digest = ""
        for _ in range(args.steps):
            loss, norm = train_step(model, optimizer, scheduler, objective, batches, backend, optim)
            losses.append(loss)
            digest = step_graph_hash(step_graph_tensors(model, optimizer, loss, norm))
            backend.sync()
            compiles.append(backend.compile_stats()["compiles"])
        checks["no_recompile_after_warmup"] = len(set(compiles[1:])) == 1

        params = [p for _, p in sorted(backend.unwrap(model).named_parameters())]
        sums = torch.stack([torch.stack([p.detach().float().sum(), p.detach().float().pow(2).sum()])
                            for p in params]).flatten()
        gathered = xm.all_gather(sums.unsqueeze(0), dim=0)  # [world, 2 * n_params]
        rank_losses = xm.all_gather(losses[0].detach().float().reshape(1), dim=0)
        # the words come from the host: device data, exact in fp32 (< 2**16)
        hashes = xm.all_gather(torch.tensor([_hash_words(digest)]).to(device), dim=0)
        torch_xla.sync()
        gathered, rank_losses, hashes = gathered.cpu(), rank_losses.cpu(), hashes.cpu()
        checks["same_step_graph_on_every_rank"] = bool((hashes == hashes[0]).all())
        checks["params_identical_across_ranks"] = bool((gathered == gathered[0]).all())
        checks["ranks_saw_different_data"] = world == 1 or len(set(rank_losses.tolist())) == world

        checks["broadcast_object"] = backend.broadcast_object({"r": rank})["r"] == 0
        model_sd = backend.model_state_dict(model)
        optim_sd = backend.optimizer_state_dict(model, optimizer)
        if backend.is_main:
            full = {n: tuple(p.shape) for n, p in backend.unwrap(model).named_parameters()}
            checks["full_model_state"] = {n: tuple(model_sd[n].shape) for n in full} == full
            checks["full_optimizer_state"] = all(
                tuple(optim_sd["state"][n]["exp_avg"].shape) == shape_ for n, shape_ in full.items())
        backend.barrier()
        return {"ok": all(checks.values()), "checks": checks, "rank": rank, "world_size": world,
                "steps": args.steps, "step_graph_hash": digest,
                "distinct_step_graphs": len({tuple(row) for row in hashes.tolist()}),
                "zero1": args.zero1, "precision": args.precision, "compiles_per_step": compiles,
                "max_checksum_spread": float((gathered - gathered[0]).abs().max()),
                "rank_losses": rank_losses.tolist(), "backend": backend.describe()}
    finally:
        backend.close()


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    args = _args(argv)
    result = run(args)
    if result["rank"] == 0:
        print(json.dumps(result, default=str), flush=True)
    if not result["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
