"""``python -m training.serve.export --transformer DIR --vae DIR --out DIR``: the serving export.

Serving needs the whole pipeline, not only the transformer ``training.export`` writes: the
Gemma-2 text encoder and tokenizer the captions were encoded with, the DC-AE the latents came
from, and the flow-matching sampler. This writes them as ONE diffusers ``SanaPipeline``
directory (``SanaPipeline.save_pretrained``: ``model_index.json``, ``transformer/``,
``text_encoder/``, ``tokenizer/``, ``vae/``, ``scheduler/``) plus:

- ``serving.json`` (training/serve/spec.py): the sizes to serve, request limits, and the text
  conditioning the transformer was trained with (``text_conditioning.json`` of the export:
  Sana's complex human instruction and N), so every request is encoded as training was;
- ``serving_provenance.json``: the sources and a sha256 of every file written
  (``export_sha256``), which ``compile`` records and ``package`` checks.

``--text-encoder`` and ``--tokenizer`` default to the directories the transformer's features
were precomputed with (recorded in its ``text_conditioning.json``). If the export recorded
their fingerprints (training/data/text_features.py ``dir_fingerprint``), a different directory is
refused: the model would be served captions encoded otherwise than it was trained on.

The scheduler is ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``: NVlabs Sana's
"flow_euler" sampler, whose fixed step count the compiled serving graphs are traced for.
Training validation and ``python -m training.evaluation.sample`` render with Sana's default
"flow_dpm-solver" instead (training/evaluation/validation.py ``sana_scheduler``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.data.text_features import (
    CONDITIONING_FILE,
    check_recorded_fingerprint,
    export_conditioning,
    recorded_component_dir,
)
from training.errors import UserError, exits_cleanly
from training.files.publish import replace_dir
from training.serve.spec import Limits, ServingSpec, Size, parse_sizes

PROVENANCE_FILE = "serving_provenance.json"
#: files of a serving export that are not part of its content hash (they record the hash)
UNHASHED = (PROVENANCE_FILE,)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def export_sha256(root: Path, *, skip: Sequence[str] = UNHASHED) -> str:
    """sha256 over (relative path, file sha256) of every file under ``root`` but ``skip``."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel in skip:
            continue
        digest.update(f"{rel}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


def build_serving_export(*, transformer: Path, vae: Path, out: Path, text_encoder: str | None = None,
                         tokenizer: str | None = None, sizes: Sequence[Size] | None = None,
                         flow_shift: float = 3.0, dtype: str = "bf16", limits: Limits | None = None,
                         overwrite: bool = False, allow_conditioning_mismatch: bool = False) -> Path:
    """Write the serving export for ``transformer`` (a training.export directory) to ``out``."""
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import AutoTokenizer, Gemma2Model

    transformer, vae, out = Path(transformer), Path(vae), Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out: {out} exists and is not empty; choose a new directory or pass --overwrite")
    conditioning = export_conditioning(transformer)
    encoder_dir = recorded_component_dir("--text-encoder", text_encoder, dict(conditioning.text_encoder), "text encoder")
    tokenizer_dir = recorded_component_dir("--tokenizer", tokenizer, dict(conditioning.tokenizer), "tokenizer")
    check_recorded_fingerprint("--text-encoder", encoder_dir, dict(conditioning.text_encoder), allow_conditioning_mismatch)
    check_recorded_fingerprint("--tokenizer", tokenizer_dir, dict(conditioning.tokenizer), allow_conditioning_mismatch)
    try:
        model = SanaTransformer2DModel.from_pretrained(transformer)
        vae_model = AutoencoderDC.from_pretrained(vae)
        encoder = Gemma2Model.from_pretrained(encoder_dir)
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a pipeline component ({str(exc).splitlines()[0]}); check --transformer, "
                        "--vae, --text-encoder and --tokenizer") from None
    if vae_model.config.latent_channels != model.config.in_channels:
        raise UserError(f"--vae {vae}: {vae_model.config.latent_channels} latent channels, but the transformer takes "
                        f"{model.config.in_channels}; give the DC-AE the training latents were encoded with")
    if encoder.config.hidden_size != model.config.caption_channels:
        raise UserError(f"--text-encoder {encoder_dir}: hidden size {encoder.config.hidden_size}, but the transformer "
                        f"takes caption_channels {model.config.caption_channels}")
    scale = 2 ** (len(vae_model.config.encoder_block_out_channels) - 1)  # as SanaPipeline computes it
    if sizes is None:  # the training resolution (sample_size latents)
        side = int(model.config.sample_size) * scale
        sizes = (Size(side, side),)
    for size in sizes:
        if size.height % scale or size.width % scale:
            raise UserError(f"--sizes {size}: not a multiple of the VAE's {scale}x compression")
    pipe = SanaPipeline(tokenizer=tok, text_encoder=encoder, vae=vae_model, transformer=model,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=flow_shift))
    tmp = out.with_name(f".{out.name}.tmp-serving-export")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    shutil.copy2(transformer / CONDITIONING_FILE, tmp / CONDITIONING_FILE)
    ServingSpec(sizes=tuple(sizes), complex_human_instruction=conditioning.complex_human_instruction,
                max_sequence_length=int(conditioning.max_text_tokens), flow_shift=flow_shift, dtype=dtype,
                limits=limits or Limits()).write(tmp)
    digest = export_sha256(tmp)
    (tmp / PROVENANCE_FILE).write_text(json.dumps({
        "sha256": digest, "transformer": str(transformer.resolve()), "vae": str(vae.resolve()),
        "text_encoder": str(encoder_dir.resolve()), "tokenizer": str(tokenizer_dir.resolve()),
        "training_provenance": _read_json(transformer / "training_provenance.json"),
    }, indent=1) + "\n")
    return replace_dir(tmp, out)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def recorded_sha256(export: Path) -> str:
    """The content hash the serving export recorded when it was written."""
    try:
        return json.loads((Path(export) / PROVENANCE_FILE).read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        raise UserError(f"--export {export}: no {PROVENANCE_FILE}; write it with python -m training.serve.export") from None


def flow_shift_of(transformer: Path) -> float | None:
    """The training run's objective.flow_shift, if the export's checkpoint is still readable."""
    prov = _read_json(Path(transformer) / "training_provenance.json") or {}
    state = _read_json(Path(prov.get("checkpoint", "/nonexistent")) / "train_state.json") or {}
    value = ((state.get("config") or {}).get("objective") or {}).get("flow_shift")
    return float(value) if isinstance(value, int | float) else None


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.serve.export", description=__doc__.splitlines()[0])
    p.add_argument("--transformer", required=True, help="training.export directory (SanaTransformer2DModel)")
    p.add_argument("--vae", required=True, help="AutoencoderDC directory the training latents were encoded with")
    p.add_argument("--text-encoder", help="Gemma-2 directory (default: the one precompute recorded)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the one precompute recorded)")
    p.add_argument("--out", required=True, help="serving export directory to write")
    p.add_argument("--sizes", help="sizes to serve, HEIGHTxWIDTH,... (default: the training resolution, square)")
    p.add_argument("--flow-shift", type=float,
                   help="sampler flow shift (default: the run's objective.flow_shift if readable, else 3.0)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="accelerator weights (CPU runs fp32)")
    p.add_argument("--max-steps", type=int, default=Limits.max_steps, help="most inference steps a request may ask")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--allow-conditioning-mismatch", action="store_true",
                   help="serve with a text encoder/tokenizer other than the training captions' (warned)")
    args = p.parse_args(argv)
    transformer = Path(args.transformer)
    shift = args.flow_shift or flow_shift_of(transformer) or 3.0
    try:
        limits = Limits(max_steps=args.max_steps, default_steps=min(Limits.default_steps, args.max_steps))
    except ValueError as exc:
        raise UserError(f"--max-steps {args.max_steps}: {exc}") from None
    out = build_serving_export(
        transformer=transformer, vae=Path(args.vae), out=Path(args.out), text_encoder=args.text_encoder,
        tokenizer=args.tokenizer, sizes=parse_sizes(args.sizes, flag="--sizes") if args.sizes else None,
        flow_shift=shift, dtype=args.dtype, limits=limits, overwrite=args.overwrite,
        allow_conditioning_mismatch=args.allow_conditioning_mismatch)
    spec = ServingSpec.read(out)
    print(json.dumps({"out": str(out), "sizes": [str(s) for s in spec.sizes], "flow_shift": shift,
                      "sha256": recorded_sha256(out)}), flush=True)


if __name__ == "__main__":
    main()
