"""Sana's linear self-attention with its matmuls and normaliser in fp32 under any autocast.

Why: diffusers' ``SanaLinearAttnProcessor2_0`` (diffusers/models/attention_processor.py)
casts q/k/v to fp32, but ``torch.matmul`` is on autocast's lower-precision list
(https://pytorch.org/docs/stable/amp.html#cuda-ops-that-can-autocast-to-float16), so under
``torch.autocast(bf16)`` - our ``bf16-mixed`` training - both batched matmuls run in bf16
again. NVlabs/Sana trains with autocast *disabled* around this kernel and fp32 inputs:
``LiteLA.attn_matmul`` in diffusion/model/nets/sana_blocks.py is decorated
``@torch.amp.autocast("cuda", enabled=os.environ.get("AUTOCAST_LINEAR_ATTN") == "true")``
(off by default) and casts q/k/v to float when ``fp32_attention`` (``"necessary for NAN
loss"``), which every Sana config sets (configs/sana_config/*/Sana_*.yaml
``model.fp32_attention: true``). The sum over all N tokens in ``V @ K^T`` and the
normaliser (the padded row of ones) are where bf16's 8-bit mantissa hurts: at 1024px N is
1024-4096 tokens, at 4K 16384.

What stays as it was: the q/k/v/out projections run under the caller's autocast (Sana's
``self.qkv``/``self.proj`` Linear layers do too), and the output returns in the input's
dtype. The normaliser's epsilon is diffusers' 1e-15 (Sana's LiteLA uses 1e-8 in training):
we keep the inference pipeline's value so a trained model is sampled with the arithmetic
it was trained with; in fp32 the denominator (a sum of N non-negative products) is far above
either epsilon unless every product is zero.

The processor is set on each block's ``attn1`` by ``training.model.build.build_model``. Processors
are not serialized by ``save_pretrained`` (only config.json + weights), so an exported
directory loads in plain diffusers with its stock processor: same weights, same math in
fp32 inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Fp32LinearAttnProcessor:
    """Drop-in for diffusers' ``SanaLinearAttnProcessor2_0`` (same signature and math)."""

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        original_dtype = hidden_states.dtype
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        # (B, N, h*d) -> (B, h, d, N) for q and v, (B, h, N, d) for k, as diffusers lays them out.
        query = query.transpose(1, 2).unflatten(1, (attn.heads, -1))
        key = key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)
        value = value.transpose(1, 2).unflatten(1, (attn.heads, -1))
        # Autocast off for this device type: the matmuls below run in the dtype we give them.
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            query = F.relu(query.float())
            key = F.relu(key.float())
            value = F.pad(value.float(), (0, 0, 0, 1), mode="constant", value=1.0)
            scores = torch.matmul(value, key)  # (B, h, d+1, d): sums over all N tokens
            out = torch.matmul(scores, query)  # (B, h, d+1, N); last row is the normaliser
            out = out[:, :, :-1] / (out[:, :, -1:] + 1e-15)
        out = out.flatten(1, 2).transpose(1, 2).to(original_dtype)
        out = attn.to_out[0](out)
        out = attn.to_out[1](out)
        if original_dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out


def use_fp32_linear_attention(model: nn.Module) -> int:
    """Set ``Fp32LinearAttnProcessor`` on every Sana block's linear self-attention.

    Only ``attn1`` (the linear self-attention) changes; the cross-attention keeps diffusers'
    SDPA processor under autocast, as Sana's ``MultiHeadCrossAttention`` runs (xformers/SDPA
    kernels accumulate their softmax in fp32 themselves). Returns how many it set.
    """
    count = 0
    for block in getattr(model, "transformer_blocks", []):
        attn = getattr(block, "attn1", None)
        if attn is not None and hasattr(attn, "set_processor"):
            attn.set_processor(Fp32LinearAttnProcessor())
            count += 1
    return count
