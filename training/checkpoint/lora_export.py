"""A LoRA run's checkpoint -> ``pytorch_lora_weights.safetensors`` (what diffusers'
``SanaPipeline.load_lora_weights`` reads), plus the base with the adapter merged on request.

``python -m training.export`` calls ``export_lora`` for a run whose ``lora.rank`` > 0
(export.py); the adapter format and the merge are the model layer's (training/model/lora.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.checkpoint.consolidate import has_part, iter_full
from training.checkpoint.layout import MANIFEST, STATE_FILE
from training.data.text_features import CONDITIONING_FILE, TextConditioning
from training.errors import UserError
from training.files import honour_umask
from training.files.publish import replace_dir
from training.model.build import ModelConfig, build_model
from training.model.dtypes import DTYPES
from training.model.lora import (
    MERGED_DIR,
    PROVENANCE,
    LoraConfig,
    apply_lora,
    is_adapter_key,
    merged_state_dict,
    save_lora,
    to_diffusers_keys,
)


def run_config(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text()).get("config") or {}


def is_lora_checkpoint(ckpt: Path) -> bool:
    """True when the run that wrote ``ckpt`` trained LoRA adapters (``lora.rank`` > 0)."""
    return int((run_config(ckpt).get("lora") or {}).get("rank", 0)) > 0


def _checkpoint_weights(ckpt: Path, *, ema: bool) -> dict[str, torch.Tensor]:
    """Model weights saved in ``ckpt`` (at least the trainable ones: the sharded format keeps
    no frozen base), with the EMA over them when ``ema``. Either checkpoint format, through
    training/checkpoint/consolidate.py."""
    weights = dict(iter_full(ckpt, "model"))
    if ema:
        if not has_part(ckpt, "ema"):
            raise UserError(f"--ema: {ckpt} holds no EMA (the run kept none); export without --ema")
        weights.update(iter_full(ckpt, "ema"))  # EMA covers the trainable (adapter) params
    return weights


def _base_model(run: Mapping[str, Any], weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """The frozen base the adapters were trained on: the checkpoint's own ``base_layer``
    weights when it holds them, else rebuilt as the run built it (``model.pretrained``, or
    the seeded from-scratch init ``train`` does: ``torch.manual_seed(seed)`` then build)."""
    section = dict(run["model"])
    if "activation_checkpointing" in section:  # the saved config mirrors the deprecated alias too
        section.pop("gradient_checkpointing", None)
    model_cfg = ModelConfig(**section)
    torch.manual_seed(int(run.get("seed", 0)))
    model = build_model(model_cfg)
    base = {k.replace(".base_layer.", "."): v for k, v in weights.items() if not is_adapter_key(k)}
    if base:
        _missing, unexpected = model.load_state_dict(base, strict=False)
        if unexpected:
            raise UserError(f"checkpoint weights {unexpected[:3]} do not fit the run's model section")
    return model


def export_lora(
    ckpt: Path,
    out: Path,
    *,
    merge: bool = False,
    ema: bool = False,
    dtype: str = "fp32",
    overwrite: bool = False,
) -> Path:
    """``ckpt`` of a LoRA run -> ``out/pytorch_lora_weights.safetensors`` (what
    ``SanaPipeline.load_lora_weights(out)`` reads), plus ``out/transformer/`` with the adapter
    merged when ``merge``. Written through a temp dir; returns ``out``."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out: {out} exists and is not empty; choose a new directory or pass --overwrite")
    run = run_config(ckpt)
    cfg = LoraConfig(**run["lora"])
    weights = _checkpoint_weights(ckpt, ema=ema)
    adapter = to_diffusers_keys(weights)
    if not adapter:
        raise UserError(
            f"{ckpt}: the run trained LoRA (lora.rank={cfg.rank}) but holds no lora_A/lora_B weights"
        )
    tmp = out.with_name(f".{out.name}.tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_lora(tmp, {k: v.to(DTYPES[dtype]) for k, v in adapter.items()}, cfg)
    if merge:
        model = apply_lora(_base_model(run, weights), cfg)
        own = {k for k in model.state_dict() if is_adapter_key(k)}
        lora_weights = {k: v for k, v in weights.items() if k in own}
        if own != set(lora_weights):
            raise UserError(f"{ckpt}: adapter keys do not match lora.target_modules {cfg.target_modules}")
        model.load_state_dict(lora_weights, strict=False)
        _save_plain(merged_state_dict(model), dict(model.config), tmp / MERGED_DIR, DTYPES[dtype])
    state = json.loads((ckpt / STATE_FILE).read_text())
    provenance = state.get("provenance") or {}
    manifest = json.loads((ckpt / MANIFEST).read_text())
    (tmp / PROVENANCE).write_text(
        json.dumps(
            {
                "checkpoint": str(ckpt.resolve()),
                "step": manifest["step"],
                "weights": "ema" if ema else "model",
                "dtype": dtype,
                "lora": dataclasses.asdict(cfg),
                "merged": merge,
                "base": run["model"].get("pretrained") or f"from-scratch preset {run['model'].get('preset')}",
                "provenance": provenance,
            },
            indent=1,
        )
    )
    conditioning = TextConditioning.from_dict(provenance.get("text_conditioning"))
    for where in [tmp, tmp / MERGED_DIR] if merge else [tmp]:  # the merged dir can seed a later fine-tune
        (where / CONDITIONING_FILE).write_text(json.dumps(conditioning.to_dict(), indent=1))
    honour_umask(tmp)  # safetensors writes 0600 whatever the umask (training/files)
    return replace_dir(tmp, out)


def _save_plain(
    state: Mapping[str, torch.Tensor], config: Mapping[str, Any], out: Path, dtype: torch.dtype
) -> None:
    """A fresh ``SanaTransformer2DModel`` loaded strictly with ``state`` -> ``save_pretrained``."""
    from diffusers import SanaTransformer2DModel

    model = SanaTransformer2DModel.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
