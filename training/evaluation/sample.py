"""``python -m training.evaluation.sample --transformer EXPORT --vae DIR --prompt TEXT --out PNG``:
one image from a training export, offline.

Assembles diffusers' ``SanaPipeline`` from the transformer ``python -m training.export`` wrote,
the DC-AE the latents were encoded with, and the Gemma-2 text encoder + tokenizer the captions
were encoded with (by default the directories the export's ``text_conditioning.json`` records;
a directory whose fingerprint differs from the recorded one is refused, as in
training/serve/export.py), and samples one prompt with the text conditioning the model was
trained with (its complex human instruction and N) and Sana's sampler: ``flow_dpm-solver`` by
default (training/evaluation/validation.py ``sana_scheduler``). Nothing is downloaded.

The last step of the offline loop in runbooks/data.md (tiny models -> precompute -> train ->
export -> this), which tests/docs/test_offline_loop.py runs as written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly
from training.evaluation.validation import SAMPLERS, sana_scheduler


def load_pipeline(transformer: Path, vae: Path, *, text_encoder: str | None = None, tokenizer: str | None = None,
                  sampler: str = "flow_dpm-solver", flow_shift: float = 3.0,
                  allow_conditioning_mismatch: bool = False) -> tuple[Any, Any]:
    """(SanaPipeline on CPU in fp32, the export's TextConditioning)."""
    from diffusers import AutoencoderDC, SanaPipeline, SanaTransformer2DModel
    from transformers import AutoTokenizer, Gemma2Model

    from training.data.text_features import (
        check_recorded_fingerprint,
        export_conditioning,
        recorded_component_dir,
    )

    conditioning = export_conditioning(transformer)
    encoder_dir = recorded_component_dir("--text-encoder", text_encoder, dict(conditioning.text_encoder), "text encoder")
    tokenizer_dir = recorded_component_dir("--tokenizer", tokenizer, dict(conditioning.tokenizer), "tokenizer")
    check_recorded_fingerprint("--text-encoder", encoder_dir, dict(conditioning.text_encoder), allow_conditioning_mismatch)
    check_recorded_fingerprint("--tokenizer", tokenizer_dir, dict(conditioning.tokenizer), allow_conditioning_mismatch)
    if not vae.is_dir():
        raise UserError(f"--vae {vae}: not a directory; give the AutoencoderDC the features were encoded with")
    try:
        pipe = SanaPipeline(tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                            text_encoder=Gemma2Model.from_pretrained(encoder_dir).eval(),
                            vae=AutoencoderDC.from_pretrained(vae).eval(),
                            transformer=SanaTransformer2DModel.from_pretrained(transformer).eval(),
                            scheduler=sana_scheduler(sampler, flow_shift))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot assemble SanaPipeline ({str(exc).splitlines()[0]}); check --transformer, --vae, "
                        "--text-encoder and --tokenizer") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe, conditioning


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m training.evaluation.sample", description=__doc__.splitlines()[0])
    p.add_argument("--transformer", required=True, help="a python -m training.export directory")
    p.add_argument("--vae", required=True, help="the AutoencoderDC directory the features were encoded with")
    p.add_argument("--text-encoder", help="Gemma2Model directory (default: the one the export records)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the one the export records)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the model's sample_size x the VAE's)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--steps", type=int, default=20, help="sampling steps (Sana's flow_dpm-solver: 20)")
    p.add_argument("--guidance-scale", type=float, default=4.5, help="classifier-free guidance (Sana: 4.5)")
    p.add_argument("--sampler", default="flow_dpm-solver", choices=list(SAMPLERS))
    p.add_argument("--flow-shift", type=float, default=3.0, help="the training objective.flow_shift")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-conditioning-mismatch", action="store_true")
    a = p.parse_args(argv)
    if a.steps < 1:
        raise UserError(f"--steps: must be >= 1, got {a.steps}")
    import torch

    pipe, conditioning = load_pipeline(Path(a.transformer), Path(a.vae), text_encoder=a.text_encoder,
                                       tokenizer=a.tokenizer, sampler=a.sampler, flow_shift=a.flow_shift,
                                       allow_conditioning_mismatch=a.allow_conditioning_mismatch)
    scale = 2 ** (len(pipe.vae.config.encoder_block_out_channels) - 1)  # as SanaPipeline computes it
    side = int(pipe.transformer.config.sample_size) * scale
    height, width = a.height or side, a.width or side
    if height % scale or width % scale:
        raise UserError(f"--height/--width {height}x{width}: not a multiple of the VAE's {scale}x compression")
    image = pipe(a.prompt, height=height, width=width, num_inference_steps=a.steps, guidance_scale=a.guidance_scale,
                 max_sequence_length=conditioning.max_text_tokens,
                 complex_human_instruction=list(conditioning.complex_human_instruction or []) or None,
                 use_resolution_binning=False, generator=torch.Generator().manual_seed(a.seed)).images[0]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
    print(json.dumps({"image": str(out), "size": [height, width], "sampler": a.sampler, "steps": a.steps,
                      "chi": conditioning.chi, "max_text_tokens": conditioning.max_text_tokens}), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
