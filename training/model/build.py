"""Sana transformer presets and construction (random init or a pretrained diffusers dir).

The model is diffusers' ``SanaTransformer2DModel`` with its weights and config unchanged, so
an exported checkpoint drops into ``SanaPipeline`` and both backends train the identical
graph. Two things differ from a bare ``SanaTransformer2DModel(...)``, both as NVlabs Sana
trains: from-scratch weights follow Sana's ``initialize_weights`` (training/model/init.py), and the
linear self-attention runs its matmuls in fp32 under autocast (training/model/attention.py; an
attention processor, which ``save_pretrained`` does not serialize).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from training.errors import UserError

log = logging.getLogger(__name__)

#: Preset name -> ``SanaTransformer2DModel`` kwargs. The big ones follow the issue's
#: shapes (NVlabs Sana_600M_img512 / Sana_1600M_1024px configs); parameter counts are
#: 591.7M and 1604.5M (checked on the meta device in tests/training/model/test_model.py).
PRESETS: dict[str, dict[str, Any]] = {
    # diffusers' own SanaTransformer2DModel test config (tests/models/transformers/
    # test_models_transformer_sana.py): ~4.3k parameters, ~0.01-0.04 s/step fp32 on CPU.
    "tiny": dict(
        in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8,
        caption_channels=8, patch_size=1, sample_size=32,
    ),
    "sana-600m-512": dict(
        in_channels=32, out_channels=32, num_layers=28, num_attention_heads=36, attention_head_dim=32,
        num_cross_attention_heads=16, cross_attention_head_dim=72, cross_attention_dim=1152,
        caption_channels=2304, patch_size=1, sample_size=16,
    ),
    "sana-1600m-1024": dict(
        in_channels=32, out_channels=32, num_layers=20, num_attention_heads=70, attention_head_dim=32,
        num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
        caption_channels=2304, patch_size=1, sample_size=32,
    ),
    # Higher-resolution presets: same shapes; what changes is the latent grid (sample_size =
    # image_size // 32, DC-AE f32) and the positional embedding. NVlabs Sana
    # configs/sana_config/1024ms/Sana_600M_img1024.yaml sets ``use_pe: false``;
    # 2048ms/Sana_1600M_img2048_bf16.yaml sets ``use_pe: true, pe_interpolation: 1.``; diffusers
    # scripts/convert_sana_to_diffusers.py maps that to ``interpolation_scale`` {1024: None,
    # 2048: 1.0} (None = no positional embedding in SanaTransformer2DModel's PatchEmbed).
    "sana-600m-1024": dict(
        in_channels=32, out_channels=32, num_layers=28, num_attention_heads=36, attention_head_dim=32,
        num_cross_attention_heads=16, cross_attention_head_dim=72, cross_attention_dim=1152,
        caption_channels=2304, patch_size=1, sample_size=32,
    ),
    "sana-1600m-2048": dict(
        in_channels=32, out_channels=32, num_layers=20, num_attention_heads=70, attention_head_dim=32,
        num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
        caption_channels=2304, patch_size=1, sample_size=64, interpolation_scale=1.0,
    ),
}


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which transformer to train."""

    #: one of PRESETS; ignored for the architecture when ``pretrained`` is set
    preset: str = "tiny"
    #: kwargs merged over the preset (e.g. ``{num_layers: 4}`` for a mid-size bench model)
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: diffusers directory (``config.json`` + safetensors) to start from: local path or
    #: s3:// prefix (synced to ``pretrained_cache``); None = random init
    pretrained: str | None = None
    #: local cache for an s3:// ``pretrained``
    pretrained_cache: str = "~/.cache/sana-training/pretrained"
    #: recompute block activations in backward (training/model/activation_checkpointing.py):
    #: "none"; "full" (every block: ~+33% FLOPs, least memory); "every_n" (every
    #: ``checkpoint_every_n``-th block); "selective" (every block, but matmul/attention
    #: outputs are kept: torchtitan's op-level SAC; GPU backend only)
    activation_checkpointing: str = "none"
    #: "every_n": checkpoint blocks n-1, 2n-1, ... (n=1 is "full")
    checkpoint_every_n: int = 2
    #: deprecated alias: true = "full" (when activation_checkpointing is unset), false = "none";
    #: after validation it mirrors ``activation_checkpointing != "none"``
    gradient_checkpointing: bool | None = None
    #: linear self-attention matmuls + normaliser in fp32 under bf16 autocast (Sana's
    #: ``fp32_attention: true``, "necessary for NAN loss"); false = diffusers' processor,
    #: whose matmuls autocast to bf16 (kept for benchmarks/bf16_numerics.py's "before")
    fp32_linear_attention: bool = True
    #: from-scratch init: "sana" (Sana's initialize_weights, training/model/init.py) or "torch"
    #: (PyTorch module defaults); ignored with ``pretrained``
    init: str = "sana"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"model.preset: unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if not isinstance(self.overrides, dict):
            raise ValueError("model.overrides: must be a mapping of SanaTransformer2DModel kwargs")
        if self.init not in ("sana", "torch"):
            raise ValueError(f"model.init: {self.init!r} is not one of 'sana', 'torch'")
        from training.model.activation_checkpointing import MODES

        if self.activation_checkpointing not in MODES:
            raise ValueError(f"model.activation_checkpointing: {self.activation_checkpointing!r} is not one "
                             f"of {', '.join(MODES)}")
        if self.checkpoint_every_n < 1:
            raise ValueError("model.checkpoint_every_n: must be >= 1")
        if self.gradient_checkpointing is not None:
            log.warning("model.gradient_checkpointing is deprecated; use model.activation_checkpointing: "
                        "%s", "full" if self.gradient_checkpointing else "none")
            if self.gradient_checkpointing and self.activation_checkpointing == "none":
                self.activation_checkpointing = "full"
            elif not self.gradient_checkpointing and self.activation_checkpointing != "none":
                raise ValueError("model.gradient_checkpointing: false contradicts model.activation_checkpointing: "
                                 f"{self.activation_checkpointing}; drop the deprecated key")
        self.gradient_checkpointing = self.activation_checkpointing != "none"

    def model_kwargs(self) -> dict[str, Any]:
        """The ``SanaTransformer2DModel`` kwargs this config builds (preset + overrides)."""
        return {**PRESETS[self.preset], **self.overrides}


def _local_pretrained(cfg: ModelConfig) -> Path:
    src = cfg.pretrained
    assert src is not None
    from training.s3 import is_s3_url, sync_down

    if is_s3_url(src):
        digest = hashlib.sha256(src.encode()).hexdigest()[:16]
        local = Path(os.path.expanduser(cfg.pretrained_cache)) / digest
        sync_down(src, local)
        return local
    path = Path(src).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"model.pretrained: {src} has no config.json; point it at a diffusers "
                        "SanaTransformer2DModel directory (e.g. <model>/transformer)")
    return path


def build_model(cfg: ModelConfig, *, device: torch.device | str | None = None) -> torch.nn.Module:
    """Build the transformer in fp32 (backends cast it for their precision mode), with Sana's
    init when random and the fp32 linear-attention processor either way.

    Args:
        cfg: the model section.
        device: where to allocate; ``"meta"`` builds without memory (parameter counts).
    """
    from diffusers import SanaTransformer2DModel

    if cfg.pretrained:
        model = SanaTransformer2DModel.from_pretrained(_local_pretrained(cfg), torch_dtype=torch.float32)
        if device is not None:
            model.to(device)
    else:
        try:
            with torch.device(device or "cpu"):
                model = SanaTransformer2DModel(**cfg.model_kwargs())
        except TypeError as exc:
            raise UserError(f"model.overrides: {exc}; use SanaTransformer2DModel kwargs") from None
        if cfg.init == "sana" and str(device) != "meta":
            from training.model.init import initialize_weights

            initialize_weights(model)
    if cfg.fp32_linear_attention:
        from training.model.attention import use_fp32_linear_attention

        use_fp32_linear_attention(model)
    if cfg.activation_checkpointing != "none":
        from training.model.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, cfg.activation_checkpointing, every_n=cfg.checkpoint_every_n)
    model.train()
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
