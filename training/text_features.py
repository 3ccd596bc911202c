"""Caption -> Gemma-2 embedding, exactly as diffusers' SanaPipeline conditions the model.

Training must see the embeddings inference will feed, so this follows
``SanaPipeline.encode_prompt`` / ``_get_gemma_prompt_embeds`` (diffusers 0.42) step by
step: lower-case + strip (``clean_caption=False``), optional complex-human-instruction
(CHI) prefix, right padding to ``max_length_all`` (N, or CHI tokens + N - 2), Gemma-2 with
the attention mask, then keep the first token and the last N-1 positions
(``select_index = [0] + list(range(-N + 1, 0))``, Sana paper section 3.1). Without CHI
that selection is the identity.

The selected mask is always a prefix of ones (padding is on the right), so a caption is
stored as its first ``mask.sum()`` rows only; ``training.data`` restores the padding.
The empty caption for classifier-free guidance is encoded without CHI, as the pipeline
encodes its negative prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


@functools.cache
def default_complex_human_instruction() -> tuple[str, ...]:
    """The pipeline's own default CHI list, read from its signature (no copy to drift)."""
    import inspect

    from diffusers import SanaPipeline

    return tuple(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


@torch.no_grad()
def encode_captions(captions: Sequence[str], tokenizer, text_encoder, *, max_tokens: int = 300,
                    complex_human_instruction: Sequence[str] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded embeddings ``[B, max_tokens, D]`` and mask ``[B, max_tokens]`` as SanaPipeline
    produces them (in the text encoder's dtype, on its device)."""
    device = next(text_encoder.parameters()).device
    tokenizer.padding_side = "right"
    prompts = [c.lower().strip() for c in captions]
    if complex_human_instruction:
        chi = "\n".join(complex_human_instruction)
        prompts = [chi + p for p in prompts]
        max_length_all = len(tokenizer.encode(chi)) + max_tokens - 2
    else:
        max_length_all = max_tokens
    tokens = tokenizer(prompts, padding="max_length", max_length=max_length_all, truncation=True,
                       add_special_tokens=True, return_tensors="pt")
    mask = tokens.attention_mask.to(device)
    embeds = text_encoder(tokens.input_ids.to(device), attention_mask=mask)[0]
    select = [0] + list(range(-max_tokens + 1, 0))
    return embeds[:, select], mask[:, select]


def real_tokens(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Per caption, the rows under the mask (``[n_real, D]``, CPU): what a shard stores."""
    out = []
    for e, m in zip(embeds, mask, strict=True):
        n = int(m.sum())
        if not bool(m[:n].all()):
            raise ValueError("attention mask is not a prefix of ones; the tokenizer must pad on the right")
        out.append(e[:n].detach().cpu())
    return out


def encode_for_shards(captions: Sequence[str], tokenizer, text_encoder, *, max_tokens: int = 300,
                      complex_human_instruction: Sequence[str] | None = None) -> list[torch.Tensor]:
    embeds, mask = encode_captions(captions, tokenizer, text_encoder, max_tokens=max_tokens,
                                   complex_human_instruction=complex_human_instruction)
    return real_tokens(embeds, mask)


def null_caption(tokenizer, text_encoder, *, max_tokens: int = 300) -> torch.Tensor:
    """The empty caption's real-token rows ``[n, D]`` (n = 1 for Gemma: just <bos>)."""
    return encode_for_shards([""], tokenizer, text_encoder, max_tokens=max_tokens)[0]
