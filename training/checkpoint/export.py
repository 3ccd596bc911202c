"""``python -m training.export CHECKPOINT_OR_RUN_DIR --out DIR [--ema]``: a checkpoint -> diffusers.

The output is a plain diffusers model directory (``config.json`` +
``diffusion_pytorch_model.safetensors``) that ``SanaTransformer2DModel.from_pretrained`` loads
and that replaces the ``transformer`` of a ``SanaPipeline``. The source may be one
``step-XXXXXXXX`` directory, a checkpoint root, a run directory (its ``checkpoints/``), or an
``s3://`` URL of either (fetched first). The checkpoint is verified against its manifest
(sha256) before anything is written, and the model is rebuilt and loaded strictly, so a key
or shape mismatch fails here rather than in someone's inference job.

Next to the weights: ``training_provenance.json`` (checkpoint, step, sha256s and the run's
provenance: job package/env, text conditioning) and ``text_conditioning.json``: how the
training captions were encoded (training/data/text_features.py TextConditioning). Sample the
model the way it was trained::

    tc = json.load(open("<out>/text_conditioning.json"))
    pipe(prompt, complex_human_instruction=tc["complex_human_instruction"],
         max_sequence_length=tc["max_text_tokens"])

(SanaPipeline's own default list differs from NVlabs Sana's in one quote character.) The
file also lets a later fine-tune from this directory warn when its data was encoded
otherwise (``warn_if_unexpected``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from training.checkpoint.consolidate import has_part, iter_full
from training.checkpoint.layout import EMA_FILE, MANIFEST, MODEL_FILE, STATE_FILE
from training.checkpoint.resume import resolve_checkpoint
from training.data.text_features import CONDITIONING_FILE, TextConditioning
from training.errors import UserError, exits_cleanly
from training.files import honour_umask
from training.files.publish import replace_dir
from training.model.dtypes import DTYPES

PROVENANCE = "training_provenance.json"


def model_config(ckpt: Path) -> dict[str, Any]:
    """The diffusers config the checkpoint was trained with."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    if state.get("model_config"):
        return state["model_config"]
    model_section = (state.get("config") or {}).get("model")
    if not model_section:
        raise UserError(f"{ckpt}/{STATE_FILE}: holds neither model_config nor the run's model section; "
                        "cannot tell which architecture to rebuild")
    from training.model.build import ModelConfig

    return ModelConfig(**model_section).model_kwargs()


def export(ckpt: Path, out: Path, *, ema: bool = False, dtype: str = "fp32", overwrite: bool = False,
           lora_merge: bool = False) -> Path:
    """Write the diffusers directory for ``ckpt`` to ``out`` (through a temp dir). Returns ``out``."""
    from diffusers import SanaTransformer2DModel

    from training.checkpoint import lora_export
    if lora_export.is_lora_checkpoint(ckpt):  # adapter file for load_lora_weights (+ merged transformer)
        return lora_export.export_lora(ckpt, out, merge=lora_merge, ema=ema, dtype=dtype, overwrite=overwrite)
    if lora_merge:
        raise UserError(f"--lora-merge: {ckpt} is not a LoRA run (lora.rank 0); export without --lora-merge")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out: {out} exists and is not empty; choose a new directory or pass --overwrite")
    # Either format; a sharded one is consolidated here, one tensor at a time (consolidate.py).
    weights = dict(iter_full(ckpt, "model"))
    if ema:
        if not has_part(ckpt, "ema"):
            raise UserError(f"--ema: {ckpt} has no EMA weights (the run kept no EMA); export without --ema")
        for name, tensor in iter_full(ckpt, "ema"):
            if name not in weights:
                raise UserError(f"{ckpt}: EMA key {name} is not a model parameter")
            weights[name] = tensor  # EMA covers the trainable parameters; buffers come from the model
    config = {k: v for k, v in model_config(ckpt).items() if not k.startswith("_")}
    # NOTE: built on CPU, not "meta": non-persistent buffers (positional tables) are not in the
    # state dict and would stay on the meta device.
    model = SanaTransformer2DModel.from_config(config)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{ckpt}: weights do not fit the SanaTransformer2DModel config stored with them "
                        f"({str(exc).splitlines()[0]})") from None
    with torch.no_grad():  # (ModelMixin.to warns about fp32-pinned modules; Sana has none)
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(DTYPES[dtype])
    manifest = json.loads((ckpt / MANIFEST).read_text())
    provenance = json.loads((ckpt / STATE_FILE).read_text()).get("provenance") or {}
    conditioning = TextConditioning.from_dict(provenance.get("text_conditioning"))
    tmp = out.with_name(f".{out.name}.tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / PROVENANCE).write_text(json.dumps({
        "checkpoint": str(ckpt.resolve()), "step": manifest["step"], "weights": "ema" if ema else "model",
        "dtype": dtype, "source_sha256": {n: m["sha256"] for n, m in manifest["files"].items()
                                          if n in (MODEL_FILE, EMA_FILE) or n.startswith("shard-rank-")},
        "provenance": provenance,
    }, indent=1))
    (tmp / CONDITIONING_FILE).write_text(json.dumps(conditioning.to_dict(), indent=1))
    honour_umask(tmp)  # save_pretrained's safetensors file is 0600 otherwise (training/files)
    return replace_dir(tmp, out)


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.splitlines()[0])
    p.add_argument("source", help="step-XXXXXXXX dir, checkpoint root, run dir, or s3:// URL of one")
    p.add_argument("--out", required=True, help="diffusers model directory to write")
    p.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weight dtype on disk (default fp32)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--lora-merge", action="store_true",
                   help="LoRA checkpoint: also write <out>/transformer with the adapter merged in")
    p.add_argument("--cache-dir", help="where an s3:// checkpoint is downloaded (default: a temp dir)")
    args = p.parse_args(argv)
    ckpt = resolve_checkpoint(args.source, args.cache_dir)
    out = export(ckpt, Path(args.out), ema=args.ema, dtype=args.dtype, overwrite=args.overwrite,
                 lora_merge=args.lora_merge)
    print(json.dumps({"checkpoint": str(ckpt), "out": str(out), "ema": args.ema, "dtype": args.dtype}), flush=True)


if __name__ == "__main__":
    main()
