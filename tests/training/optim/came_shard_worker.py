"""One rank of test_came_sharded.py: CAME over this rank's ZeRO-1 shards, sums reduced over
gloo, checked against the unsharded CAME every rank also runs on the full tensors."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from training.optim.came import CAME, flat_reduce, row_shards

#: rows not divisible by 3 (padding), a 1x1 conv (factored), a 3x3 depthwise conv and a bias
#: (full second moment), and one whose 4 rows leave rank 2 with no real row at all
SHAPES = {"linear": (10, 6), "conv1x1": (7, 5, 1, 1), "depthwise": (5, 1, 3, 3), "bias": (10,), "short": (4, 3)}
HYPER = dict(lr=3e-2, weight_decay=0.05, clip_threshold=0.5)


def shard_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """torch_xla zero_redundancy_optimizer.py ``_shard_tensor``: zero-pad dim 0 to a multiple
    of the world size, then ``chunk(world)[rank]``."""
    if t.size(0) % world:
        t = F.pad(t, [0, 0] * (t.dim() - 1) + [0, world - t.size(0) % world])
    return t.chunk(world)[rank]


def all_reduce(flat: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(flat)
    return flat


def gather_rows(t: torch.Tensor, rows: int, world: int) -> torch.Tensor:
    pieces = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(pieces, t.contiguous())
    return torch.cat(pieces)[:rows]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = {n: torch.nn.Parameter(torch.randn(s)) for n, s in SHAPES.items()}
    shards = {n: torch.nn.Parameter(shard_rows(p.detach().clone(), rank, world)) for n, p in full.items()}
    reference, sharded = CAME(list(full.values()), **HYPER), CAME(list(shards.values()), **HYPER)
    # the backend's own wiring (training/backends/neuron_zero1.py Zero1._shard_came), with gloo for XLA's all-reduce
    sharded.shard(row_shards(((full[n], shards[n]) for n in SHAPES), lambda t: shard_rows(t, rank, world),
                             torch.device("cpu")), flat_reduce(all_reduce))
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for n, p in full.items():  # the same full gradient on every rank, as after a reduce-scatter
            p.grad = torch.randn(p.shape, generator=gen) * 3.0
            shards[n].grad = shard_rows(p.grad, rank, world).clone()
        reference.step()
        sharded.step()
    for n, p in full.items():
        rows = SHAPES[n][0]
        torch.testing.assert_close(gather_rows(shards[n].detach(), rows, world), p.detach(), rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=n: f"{n}: parameter: {m}")
        want, got = reference.state[p], sharded.state[shards[n]]
        for key, value in want.items():
            if key == "step":
                assert got[key] == value
            elif key in ("exp_avg_sq_col", "exp_avg_res_col"):  # whole on every rank
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-12, msg=lambda m, n=n, key=key: f"{n}.{key}: {m}")
            else:  # sharded by rows like the parameter
                torch.testing.assert_close(gather_rows(got[key], rows, world), value, rtol=1e-4, atol=1e-12,
                                           msg=lambda m, n=n, key=key: f"{n}.{key}: {m}")
        assert torch.isfinite(shards[n]).all(), n  # padding rows never turn into inf / nan
    print(f"rank {rank}: sharded CAME == unsharded CAME", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
