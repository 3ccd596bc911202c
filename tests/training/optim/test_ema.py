"""EMA: the one-launch foreach update computes what the per-parameter update computed, in
fp32 and from bf16 parameters, and the EMA's sharded pieces read back under another world size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.checkpoint.sharded import Stager
from training.checkpoint.shards import ShardReader, write_shard
from training.optim.ema import EMA, EmaConfig


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 9), nn.LayerNorm(9), nn.Linear(9, 3)).to(dtype)
    model[1].weight.requires_grad_(False)  # frozen: no shadow
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_foreach_update_is_bit_identical_to_the_per_parameter_lerp(dtype):
    model = _model(dtype)
    ema = EMA(model, EmaConfig(decay=0.9, start_step=1))
    assert "1.weight" not in ema.shadow and all(t.dtype == torch.float32 for t in ema.shadow.values())
    reference = {name: t.clone() for name, t in ema.shadow.items()}
    for step in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ema.update(model, step)
        weight = 1.0 if step <= 1 else 0.1
        named = dict(model.named_parameters())
        for name, t in reference.items():  # the previous EMA.update, one lerp_ per parameter
            t.lerp_(named[name].detach().float(), weight)
        for name, t in reference.items():
            assert torch.equal(ema.shadow[name], t), (dtype, step, name)
    assert any(not torch.equal(ema.shadow[n], named[n].float()) for n in ema.shadow)  # really averaging


def test_ema_pieces_written_by_three_ranks_load_into_one(tmp_path):
    model = _model(torch.float32)
    ema = EMA(model, EmaConfig(decay=0.5))
    with torch.no_grad():
        for t in ema.shadow.values():
            t.normal_()
    files = []
    for rank in range(3):
        files.append(tmp_path / f"shard-rank-{rank}.safetensors")
        write_shard(files[-1], Stager().stage(ema.pieces(rank, 3)))
    other = EMA(_model(torch.float32), EmaConfig(decay=0.5))
    with ShardReader(files) as reader:
        assert reader.keys() == {f"ema/{n}" for n in ema.shadow}
        other.load_pieces(reader, reader.keys())
        with pytest.raises(KeyError, match="EMA state lacks"):
            other.load_pieces(reader, set())
    assert all(torch.equal(other.shadow[n], t) for n, t in ema.shadow.items())
