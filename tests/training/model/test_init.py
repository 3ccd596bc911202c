"""Sana's from-scratch init (training/model/init.py), checked by statistics per module family.

Reference: NVlabs/Sana diffusion/model/nets/sana.py ``Sana.initialize_weights`` (xavier on
every Linear with zero bias, xavier on the patch conv viewed 2-D, N(0, 0.02) on the timestep
and caption MLPs) and the caption RMSNorm at ``y_norm_scale_factor`` 0.01.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from training.model.build import ModelConfig, build_model
from training.model.init import CAPTION_NORM_SCALE, EMBED_STD

#: a model wide enough for statistics: inner dim 128, 2 blocks
WIDE = dict(num_layers=2, num_attention_heads=4, attention_head_dim=32, num_cross_attention_heads=4,
            cross_attention_head_dim=32, cross_attention_dim=128, caption_channels=64, in_channels=8,
            out_channels=8)
C = 128


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny", overrides=WIDE))


def _xavier(weights: list[torch.Tensor], fan_in: int, fan_out: int) -> None:
    """Uniform(-b, b) with b = sqrt(6 / (fan_in + fan_out)): bound and std (b / sqrt(3))."""
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    w = torch.cat([x.detach().flatten() for x in weights])
    assert w.abs().max().item() <= bound + 1e-7
    assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def test_attention_projections_are_xavier_with_sanas_fused_shapes(model) -> None:
    for block in model.transformer_blocks:
        a1, a2 = block.attn1, block.attn2
        # LiteLA's qkv is one Linear(C, 3C); diffusers splits it into to_q/to_k/to_v
        _xavier([a1.to_q.weight, a1.to_k.weight, a1.to_v.weight], C, 3 * C)
        _xavier([a1.to_out[0].weight], C, C)
        # cross-attention: q_linear (C, C), kv_linear (C, 2C), proj (C, C)
        _xavier([a2.to_q.weight], C, C)
        _xavier([a2.to_k.weight, a2.to_v.weight], C, 2 * C)
        _xavier([a2.to_out[0].weight], C, C)


def test_linear_biases_are_zero(model) -> None:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert len(linears) > 10
    assert all(torch.count_nonzero(m.bias) == 0 for m in linears)


def test_patch_embed_and_output_projection_are_xavier(model) -> None:
    w = model.patch_embed.proj.weight  # Conv2d (C, in, 1, 1) initialised as a (C, in) Linear
    _xavier([w], w[0].numel(), w.shape[0])
    # the conv bias is not a Linear's: Sana leaves PyTorch's default, which is not all zero
    assert torch.count_nonzero(model.patch_embed.proj.bias) > 0
    _xavier([model.proj_out.weight], C, WIDE["out_channels"])


@pytest.mark.parametrize("path", ["time_embed.emb.timestep_embedder.linear_1",
                                  "time_embed.emb.timestep_embedder.linear_2", "time_embed.linear",
                                  "caption_projection.linear_1", "caption_projection.linear_2"])
def test_timestep_and_caption_mlps_are_normal_002(model, path: str) -> None:
    w = model.get_submodule(path).weight.detach()
    assert w.std().item() == pytest.approx(EMBED_STD, rel=0.05)
    assert abs(w.mean().item()) < 0.1 * EMBED_STD
    # a normal, not a uniform: ~4.6% of N(0, s) lies beyond 2s; a uniform of std s ends at 1.73s
    assert (w.abs() > 2 * EMBED_STD).float().mean().item() > 0.02


def test_caption_norm_starts_at_sanas_y_norm_scale(model) -> None:
    assert torch.equal(model.caption_norm.weight, torch.full((C,), CAPTION_NORM_SCALE))


def test_what_sana_leaves_alone_keeps_diffusers_construction(model) -> None:
    # scale_shift_table: randn / sqrt(dim) in both Sana and diffusers
    table = torch.cat([b.scale_shift_table.detach().flatten() for b in model.transformer_blocks])
    assert table.std().item() == pytest.approx(1 / math.sqrt(C), rel=0.05)
    # GLUMBConv convs: PyTorch's Conv2d default, kaiming_uniform(a=sqrt(5)): bound 1/sqrt(fan_in)
    conv = model.transformer_blocks[0].ff.conv_inverted.weight
    assert conv.abs().max().item() <= 1 / math.sqrt(conv[0].numel()) + 1e-7


def test_pretrained_weights_are_not_reinitialised(tmp_path: Path) -> None:
    torch.manual_seed(1)
    src = build_model(ModelConfig(preset="tiny", init="torch"))
    src.save_pretrained(tmp_path)
    torch.manual_seed(2)
    loaded = build_model(ModelConfig(preset="tiny", pretrained=str(tmp_path)))
    for (name, a), b in zip(src.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_torch_init_is_still_available_and_seeded_init_is_reproducible() -> None:
    torch.manual_seed(0)
    plain = build_model(ModelConfig(preset="tiny", init="torch"))
    assert torch.equal(plain.caption_norm.weight, torch.ones_like(plain.caption_norm.weight))
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(build_model(ModelConfig(preset="tiny")).state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    with pytest.raises(ValueError, match="model.init"):
        ModelConfig(init="xavier")
