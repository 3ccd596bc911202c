"""LoRA fine-tuning of the Sana transformer (PEFT adapters), and its export to diffusers.

What it follows (read, not copied):
- diffusers ``examples/dreambooth/train_dreambooth_lora_sana.py``: the base transformer is
  frozen (``transformer.requires_grad_(False)``), adapters come from
  ``LoraConfig(r, lora_alpha, lora_dropout, init_lora_weights="gaussian", target_modules)``
  with ``target_modules`` defaulting to ``["to_k", "to_q", "to_v"]`` and are attached with
  ``transformer.add_adapter``; only ``p.requires_grad`` parameters reach the optimizer; the
  adapter is saved with ``get_peft_model_state_dict`` +
  ``SanaPipeline.save_lora_weights(dir, transformer_lora_layers=..., <adapter metadata>)``.
- diffusers ``loaders/lora_pipeline.py`` ``SanaLoraLoaderMixin``: ``load_lora_weights`` reads
  ``pytorch_lora_weights.safetensors`` (``loaders/lora_base.py`` ``LORA_WEIGHT_NAME_SAFE``),
  every key carries the ``transformer.`` prefix, and the adapter's ``LoraConfig`` kwargs are
  taken from the safetensors metadata key ``lora_adapter_metadata`` when present
  (``utils/peft_utils.py`` ``_create_lora_config``); without it diffusers assumes
  ``lora_alpha == r`` (``get_peft_kwargs``), so the metadata is what carries our alpha.
- PEFT ``LoraConfig`` docs / ``tuners/lora/layer.py`` ``update_layer``: the adapter's output is
  scaled by ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``);
  ``utils/save_and_load.py`` ``get_peft_model_state_dict`` drops the adapter name
  (``...to_q.lora_A.default.weight`` -> ``...to_q.lora_A.weight``).

Checkpoints of a LoRA run hold the model's own parameter names (PEFT's
``.lora_A.default.weight`` / ``.base_layer.weight``); export turns them into the diffusers
file, and with ``merge`` also into a plain transformer directory with the adapter fused in
(diffusers ``fuse_lora`` + ``unload_lora``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.errors import UserError

log = logging.getLogger(__name__)

#: diffusers' LoRA file name (loaders/lora_base.py LORA_WEIGHT_NAME_SAFE)
LORA_FILE = "pytorch_lora_weights.safetensors"
#: where the merged transformer goes inside an export directory
MERGED_DIR = "transformer"
PROVENANCE = "training_provenance.json"
#: PEFT's default adapter name (what ``add_adapter`` uses when none is given)
ADAPTER = "default"
INITS = ("gaussian", "default")


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the transformer (section ``lora``); ``rank`` 0 = full fine-tuning."""

    #: adapter rank r (0 = off: every weight trains)
    rank: int = 0
    #: adapter output scale is alpha / rank (PEFT); diffusers' Sana script defaults alpha = rank
    alpha: float | None = None
    #: module names (suffixes) to adapt; diffusers' Sana script default: the self- and
    #: cross-attention q/k/v projections
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["to_k", "to_q", "to_v"])
    #: dropout on the adapter input (PEFT ``lora_dropout``)
    dropout: float = 0.0
    #: "gaussian" (A ~ N(0, 1/r), diffusers' Sana script) or "default" (PEFT: Kaiming-uniform
    #: A); B starts at zero either way, so step 0 computes the base model
    init: str = "gaussian"

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError("lora.rank: must be >= 0 (0 = off)")
        if self.alpha is not None and self.alpha <= 0:
            raise ValueError("lora.alpha: must be > 0 (or unset = rank)")
        if (
            not isinstance(self.target_modules, list)
            or not self.target_modules
            or not all(isinstance(m, str) and m for m in self.target_modules)
        ):
            raise ValueError(
                "lora.target_modules: must be a non-empty list of module names, e.g. [to_q, to_k, to_v]"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("lora.dropout: must be in [0, 1)")
        if self.init not in INITS:
            raise ValueError(f"lora.init: {self.init!r} is not one of {list(INITS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_config(self):
        """The ``peft.LoraConfig`` these settings describe."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.rank,
            lora_alpha=self.rank if self.alpha is None else self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            init_lora_weights=True if self.init == "default" else "gaussian",
        )


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freeze ``model`` and attach trainable LoRA adapters (in place; returns ``model``).

    Runs before ``Backend.prepare_model``, so DDP / FSDP2 / XLA see the final parameter set.
    A no-op with ``rank`` 0.
    """
    if not cfg.enabled:
        return model
    model.requires_grad_(False)
    try:
        model.add_adapter(cfg.peft_config())
    except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
        raise UserError(
            f"lora.target_modules: {cfg.target_modules} ({str(exc).splitlines()[0][:200]}); "
            "name Linear modules of SanaTransformer2DModel, e.g. to_q, to_k, to_v, to_out.0"
        ) from None
    bad = [n for n, p in model.named_parameters() if p.requires_grad != is_adapter_key(n)]
    if bad:  # PEFT marks only adapters trainable; anything else would train (and checkpoint) silently
        raise RuntimeError(f"LoRA left the wrong parameters trainable: {bad[:3]}")
    if getattr(model, "is_gradient_checkpointing", False):
        # Reentrant checkpointing (torch_xla's ``checkpoint`` on Trainium) gives a block output
        # a gradient only if one of its *inputs* has one; with a frozen patch embedding none
        # does, so no adapter would get a gradient ("element 0 of tensors does not require
        # grad"). transformers' ``enable_input_require_grads`` (modeling_utils.py: "useful for
        # fine-tuning adapter weights while keeping the model weights fixed") fixes it the
        # same way: the embedding's output requires grad.
        model.patch_embed.register_forward_hook(_output_requires_grad)
    log.info(
        "LoRA rank %d on %s: %.3f%% of the parameters train",
        cfg.rank,
        cfg.target_modules,
        100 * trainable_fraction(model),
    )
    return model


def _output_requires_grad(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
    if torch.is_grad_enabled():  # not in sampling / validation (no_grad, inference_mode)
        output.requires_grad_(True)


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def trainable_fraction(model: nn.Module) -> float:
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad) / max(total, 1)


def to_diffusers_keys(state: Mapping[str, torch.Tensor], adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """Model-named adapter tensors (``...to_q.lora_A.default.weight``) -> the keys
    ``get_peft_model_state_dict`` returns (``...to_q.lora_A.weight``); other keys are dropped."""
    tag = f".{adapter}."
    return {k.replace(tag, "."): v for k, v in state.items() if is_adapter_key(k)}


def save_lora(out_dir: Path, adapter_state: Mapping[str, torch.Tensor], cfg: LoraConfig) -> Path:
    """Write ``out_dir/pytorch_lora_weights.safetensors`` with diffusers' own writer
    (``SanaPipeline.save_lora_weights``: adds the ``transformer.`` prefix and the
    ``lora_adapter_metadata`` that carries alpha)."""
    from diffusers import SanaPipeline

    SanaPipeline.save_lora_weights(
        out_dir,
        transformer_lora_layers=dict(adapter_state),
        transformer_lora_adapter_metadata=cfg.peft_config().to_dict(),
    )
    return out_dir / LORA_FILE


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA model's weights with the adapters fused in, under plain diffusers names.

    Works on a copy (``fuse_lora`` + ``unload_lora`` rewrite the module tree)."""
    import copy

    fused = copy.deepcopy(model)
    fused.fuse_lora(lora_scale=1.0)
    fused.unload_lora()
    return {k: v.detach().clone() for k, v in fused.state_dict().items()}


def adapter_parameter_count(model_kwargs: Mapping[str, Any], cfg: LoraConfig) -> int:
    """Trainable parameters ``apply_lora`` adds, without building the model (memory estimates:
    gradients, optimizer state and EMA exist for these only). Counts the attention projections
    (to_q / to_k / to_v / to_out.0 of attn1 and attn2): r * (in + out) each (PEFT's lora_A is
    r x in, lora_B out x r, no bias). Other targets raise ValueError."""
    from training.model import flops
    if not cfg.enabled:
        return 0
    c = {**flops._SANA_DEFAULTS, **dict(model_kwargs)}
    dim = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    shapes = {("attn1", m): (dim, dim) for m in ("to_q", "to_k", "to_v", "to_out.0")}
    if c.get("cross_attention_dim") is not None:
        dc = int(c["num_cross_attention_heads"]) * int(c["cross_attention_head_dim"])
        dx = int(c["cross_attention_dim"])
        shapes.update(
            {
                ("attn2", "to_q"): (dim, dc),
                ("attn2", "to_k"): (dx, dc),
                ("attn2", "to_v"): (dx, dc),
                ("attn2", "to_out.0"): (dc, dim),
            }
        )
    unknown = set(cfg.target_modules) - {m for _, m in shapes}
    if unknown:
        raise ValueError(f"adapter_parameter_count: no shape rule for {sorted(unknown)}")
    per_block = sum(cfg.rank * (i + o) for (_, m), (i, o) in shapes.items() if m in cfg.target_modules)
    return int(c["num_layers"]) * per_block


# ----- FLOPs of a LoRA step (the MFU numerator) -------------------------------------------
def train_flops_per_sample(
    model_kwargs: Mapping[str, Any],
    text_tokens: int,
    latent_hw: tuple[int, int],
    *,
    cfg: LoraConfig,
    real_text_tokens: float | None = None,
) -> float:
    """fwd + bwd FLOPs per sample of a LoRA step, from training/model/flops.py's forward breakdown.

    Full training counts 3x the forward (grad-input + grad-weight). With a frozen base autograd
    computes no weight gradient (torch only fills ``grad`` of tensors that require it), and no
    input gradient where nothing upstream needs one, so per op the backward is:
    - weight matmuls whose input carries a gradient: 1x forward (grad-input only);
    - weight matmuls on inputs without one: 0 (patch embed, timestep / adaLN embedding,
      caption projection, cross-attention k/v on the text, block 0's self-attention q/k/v);
    - activation products (linear attention, cross-attention scores): 2x, as before;
    - the adapters: ~2x their (small) forward.
    With activation checkpointing ``apply_lora`` makes the patch embedding's output carry a
    gradient (reentrant checkpointing needs it), which adds block 0's q/k/v input gradients
    (< 1% at 20+ blocks); recomputation is not counted, as for full training.
    tests/training/model/test_lora.py checks this against torch's FlopCounterMode.
    """
    from training.model import flops
    c = {**flops._SANA_DEFAULTS, **dict(model_kwargs)}
    parts = flops.forward_flops_breakdown(
        model_kwargs, text_tokens, latent_hw, real_text_tokens=real_text_tokens
    )
    forward = sum(parts.values())
    h, w = (int(v) for v in latent_hw)
    p = int(c["patch_size"])
    tokens = (h // p) * (w // p)
    t = float(real_text_tokens if real_text_tokens is not None else text_tokens)
    dim = int(c["num_attention_heads"]) * int(c["attention_head_dim"])
    layers = int(c["num_layers"])
    act = parts["linear_attention"] + parts.get("cross_attention", 0.0)
    no_input_grad = parts["patch_embed"] + parts["timestep_embed"] + parts["caption_projection"]
    no_input_grad += 3 * 2.0 * tokens * dim * dim  # block 0's attn1 q, k, v: inputs need no grad
    adapters = 0.0
    r = cfg.rank
    targets = set(cfg.target_modules)
    if c.get("cross_attention_dim") is not None:
        dc = int(c["num_cross_attention_heads"]) * int(c["cross_attention_head_dim"])
        dx = int(c["cross_attention_dim"])
        no_input_grad += layers * 2 * 2.0 * t * dx * dc  # k, v on the (gradient-free) text
        adapters += (
            layers
            * 2.0
            * r
            * (("to_q" in targets) * tokens * (dim + dc) + (len(targets & {"to_k", "to_v"})) * t * (dx + dc))
        )
    adapters += layers * 2.0 * r * len(targets & {"to_q", "to_k", "to_v"}) * tokens * 2 * dim
    weight_ops = forward - act
    return forward + (weight_ops - no_input_grad) + 2 * act + 3 * adapters
