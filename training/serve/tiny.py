"""A tiny serving export built offline in about a second: the serve tests, the demo fallback and
``serve-smoke`` (training/serve/smoke.py) compile and serve this.

The transformer is the ``tiny`` preset (training/model/build.py), saved as ``training.export`` saves
one (a diffusers directory plus ``text_conditioning.json`` recording Sana's complex human
instruction, N and the fingerprints of the tiny tokenizer and Gemma-2 it pairs with); the
VAE, text encoder and tokenizer are training/model/tiny.py's. Sizes: 64x64 (the tiny
VAE's 2x compression gives the preset's 32x32 latents) and 32x64 (a non-square one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from training.serve.spec import Limits, Size

TINY_SIZES = (Size(64, 64), Size(32, 64))
TINY_TEXT_TOKENS = 16


def tiny_transformer_export(out: Path, *, tokenizer: Path, text_encoder: Path, seed: int = 0,
                            max_text_tokens: int = TINY_TEXT_TOKENS) -> Path:
    """A training.export-shaped directory for a randomly initialised tiny transformer."""
    import torch
    from diffusers import SanaTransformer2DModel

    from training.data.text_features import CONDITIONING_FILE, SANA_CHI, TextConditioning, dir_fingerprint
    from training.model.build import PRESETS

    torch.manual_seed(seed)
    SanaTransformer2DModel(**PRESETS["tiny"]).save_pretrained(out, safe_serialization=True)
    conditioning = TextConditioning.of(
        SANA_CHI, max_text_tokens=max_text_tokens,
        tokenizer={"path": str(tokenizer), "fingerprint": dir_fingerprint(tokenizer)},
        text_encoder={"path": str(text_encoder), "fingerprint": dir_fingerprint(text_encoder)})
    (Path(out) / CONDITIONING_FILE).write_text(json.dumps(conditioning.to_dict(), indent=1))
    return Path(out)


def build_tiny_serving_export(work: Path, *, sizes: Sequence[Size] = TINY_SIZES, seed: int = 0,
                              limits: Limits | None = None) -> Path:
    """``work/export``: the serving export of a tiny random Sana (components under ``work``)."""
    from training.model.tiny import build_tiny_components
    from training.serve.export import build_serving_export

    work = Path(work)
    parts = build_tiny_components(work / "models", seed=seed)
    transformer = tiny_transformer_export(work / "transformer", tokenizer=parts["tokenizer"],
                                          text_encoder=parts["text_encoder"], seed=seed)
    return build_serving_export(transformer=transformer, vae=parts["vae"], out=work / "export", sizes=tuple(sizes),
                                dtype="fp32", limits=limits or Limits(max_steps=8, default_steps=2),
                                overwrite=True)
