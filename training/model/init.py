"""Sana's from-scratch weight init, mapped onto diffusers' ``SanaTransformer2DModel`` names.

NVlabs/Sana ``Sana.initialize_weights`` (diffusion/model/nets/sana.py; ``SanaMS.initialize``
in sana_multi_scale.py calls it and repeats the same steps) does, in order:

1. every ``nn.Linear``: ``xavier_uniform_`` weight, zero bias (``_basic_init``);
2. the patch-embedding conv ``x_embedder.proj``: xavier on its weight viewed as 2-D
   (``w.view([w.shape[0], -1])``), bias left at PyTorch's default;
3. timestep MLP ``t_embedder.mlp[0]``/``mlp[2]`` and ``t_block[1]``: weight ~ N(0, 0.02);
4. caption MLP ``y_embedder.y_proj.fc1``/``fc2``: weight ~ N(0, 0.02);
5. (SanaMS with ``cfg_embed``) ``cfg_embedder.mlp[0]`` ~ N(0, 0.02), ``mlp[2]`` zero.

Outside that function: the caption RMSNorm is built with ``weight = ones * scale_factor``
(diffusion/model/norms.py ``RMSNorm``) and ``y_norm_scale_factor: 0.01`` in every Sana
config (configs/sana_config/*/Sana_*.yaml ``text_encoder``); the ``scale_shift_table``s are
``randn / sqrt(dim)`` and the GLUMBConv convs keep PyTorch's default - diffusers builds
both the same way already, so they are left alone.

Sana fuses some projections that diffusers splits, and xavier's bound depends on the fused
shape (``sqrt(6 / (fan_in + fan_out))``): LiteLA's ``qkv`` is one ``Linear(C, 3C)``
(timm ``Attention``) -> diffusers ``attn1.to_q/to_k/to_v``; the cross-attention's
``kv_linear`` is ``Linear(C, 2C)`` -> ``attn2.to_k/to_v``. Those are initialised as the
fused matrix and split, so their statistics are Sana's.

Name map (Sana -> diffusers): x_embedder.proj -> patch_embed.proj;
t_embedder.mlp[0]/[2] -> time_embed.emb.timestep_embedder.linear_1/linear_2;
t_block[1] -> time_embed.linear; y_embedder.y_proj.fc1/fc2 -> caption_projection.linear_1/
linear_2; attention_y_norm -> caption_norm; blocks[i].attn.qkv/proj -> attn1.to_q,k,v/
to_out[0]; blocks[i].cross_attn.q_linear/kv_linear/proj -> attn2.to_q/to_k,to_v/to_out[0];
final_layer.linear -> proj_out.
"""

from __future__ import annotations

import torch
from torch import nn

#: Sana's y_norm_scale_factor (configs/sana_config/*/Sana_*.yaml, text_encoder section)
CAPTION_NORM_SCALE = 0.01
#: std of the timestep / caption MLP weights in Sana.initialize_weights
EMBED_STD = 0.02


@torch.no_grad()
def _xavier_fused(linears: list[nn.Linear]) -> None:
    """xavier_uniform_ over the row-concatenation of ``linears`` (Sana's fused projection)."""
    fused = torch.empty(sum(m.weight.shape[0] for m in linears), linears[0].weight.shape[1],
                        dtype=linears[0].weight.dtype, device=linears[0].weight.device)
    nn.init.xavier_uniform_(fused)
    for m, part in zip(linears, fused.split([m.weight.shape[0] for m in linears]), strict=True):
        m.weight.copy_(part)


def _normal(linear: nn.Linear, std: float = EMBED_STD) -> None:
    nn.init.normal_(linear.weight, std=std)


@torch.no_grad()
def initialize_weights(model: nn.Module) -> None:
    """Re-initialise a freshly built ``SanaTransformer2DModel`` in place as Sana does.

    Only for from-scratch runs: a pretrained model keeps its weights (build_model skips this).
    Draws from torch's global RNG, so a seeded run is reproducible.
    """
    # 1. every Linear: xavier weight, zero bias
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    # ... with Sana's fused shapes where diffusers splits a projection
    for block in getattr(model, "transformer_blocks", []):
        attn1 = block.attn1
        _xavier_fused([attn1.to_q, attn1.to_k, attn1.to_v])
        attn2 = getattr(block, "attn2", None)
        if attn2 is not None:
            _xavier_fused([attn2.to_k, attn2.to_v])
    # 2. patch embedding conv as a Linear over (in * k * k); bias untouched (Sana's _basic_init
    # only touches nn.Linear)
    proj = model.patch_embed.proj.weight
    nn.init.xavier_uniform_(proj.view(proj.shape[0], -1))
    # 3. timestep embedding MLP and the adaLN-single projection
    time_embed = model.time_embed
    if hasattr(time_embed, "emb"):  # AdaLayerNormSingle (guidance_embeds=False, every Sana preset)
        timestep_mlp = time_embed.emb.timestep_embedder
    else:  # SanaCombinedTimestepGuidanceEmbeddings (Sana-Sprint style guidance_embeds=True)
        timestep_mlp = time_embed.timestep_embedder
        # 5. Sana's cfg_embedder: first layer N(0, 0.02), last layer zero (starts as a no-op)
        _normal(time_embed.guidance_embedder.linear_1)
        nn.init.zeros_(time_embed.guidance_embedder.linear_2.weight)
        nn.init.zeros_(time_embed.guidance_embedder.linear_2.bias)
    _normal(timestep_mlp.linear_1)
    _normal(timestep_mlp.linear_2)
    _normal(time_embed.linear)
    # 4. caption projection MLP
    _normal(model.caption_projection.linear_1)
    _normal(model.caption_projection.linear_2)
    # caption RMSNorm at Sana's y_norm_scale_factor
    model.caption_norm.weight.fill_(CAPTION_NORM_SCALE)
