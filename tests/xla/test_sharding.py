"""Rank logic, with the world size faked where it lives: the data sampler and the objective's
slice of the global random draw. (Real multi-process XLA is proven by scripts/trn-smoke.py.)"""

from __future__ import annotations

import torch

from training.data.loader import FeatureLoader
from training.objective import ObjectiveConfig, RectifiedFlow


def test_ranks_take_disjoint_slices_of_the_same_global_batch(features):
    world = 4
    single = FeatureLoader(str(features), batch_size=2 * world, seed=3, prefetch=0)
    ranks = [FeatureLoader(str(features), batch_size=2, rank=r, world_size=world, seed=3, prefetch=0)
             for r in range(world)]
    for _ in range(3):
        whole = next(single)["latents"][:, 0, 0, 0]  # sample id is latents.flatten()[0]
        parts = [next(loader)["latents"][:, 0, 0, 0] for loader in ranks]
        assert torch.equal(torch.cat(parts), whole)
        assert len(set(torch.cat(parts).tolist())) == 2 * world


def test_same_xla_seed_gives_every_rank_its_slice_of_one_global_draw():
    """Each rank seeds the XLA generator identically and keeps its slice of the global draw, so
    the union over ranks is exactly what one process with the whole batch draws."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    world, batch = 4, 2
    latents = torch.zeros(batch, 4, 8, 8, device=device)
    null = torch.zeros(8, 8, device=device), torch.ones(8, dtype=torch.long, device=device)

    def draw(rank: int, world_size: int, x: torch.Tensor):
        xm.set_rng_state(1234)
        flow = RectifiedFlow(ObjectiveConfig(), vae_scaling_factor=1.0, null_text=null[0], null_mask=null[1],
                             rank=rank, world_size=world_size)
        sigma, noise, drop = flow.sample(x)
        return sigma.cpu(), noise.cpu(), drop.cpu()

    whole = draw(0, 1, torch.zeros(batch * world, 4, 8, 8, device=device))
    parts = [draw(r, world, latents) for r in range(world)]
    for i in range(3):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
