"""Device-memory (HBM) estimate per rank, checked before the first compile on Trainium.

A NeuronCore-v2 (trn1/trn1n) has 16 GiB of HBM (training/flops.py ACCELERATORS). neuronx-cc
only finds out after minutes of compiling ("Estimated peak HBM usage exceeds 16GB",
awsdocs-neuron neuronx-cc error codes / troubleshooting), so a config that cannot fit is
refused here first, naming the knob that makes it fit.

The estimate, per rank, for P parameters, N data-parallel ranks, micro-batch B:

  weights      P * w           w = 4 (fp32, bf16-mixed: fp32 master weights) or 2 (bf16)
  gradients    P * w           same dtype as the weights
  optimizer    AdamW: 2 moments in the weight dtype (P * 2w); with ZeRO-1 the moments
               and an fp32 master copy of each shard, in fp32 (P * 12 / N), plus the
               reduce-scattered gradient shard (P * 4 / N): torch_xla
               ZeroRedundancyOptimizer with optimizer_dtype=float32 (pytorch/xla v2.9
               torch_xla/distributed/zero_redundancy_optimizer.py)
  EMA          P * 4 when ema.decay > 0 (fp32 shadow on the device, training/ema.py)
  activations  measured, not modelled: the bytes autograd keeps for backward, counted with
               ``torch.autograd.graph.saved_tensors_hooks`` on a meta-device model of the
               same widths (no memory, no compute), deduplicated by storage. Two forwards
               (1 and 2 blocks) give the per-block cost a and the rest b; without
               checkpointing B * (b + L * a); with diffusers' per-block checkpointing each
               block keeps only its input hidden states, and one block is recomputed at a
               time: B * (b + L * h + a).

Activations are counted in fp32 for fp32 and bf16-mixed (under autocast some saved tensors
are bf16 and some fp32: fp32 is the upper bound) and in bf16 for pure bf16. What this does
NOT count: the compiler's scratch and collective buffers, the runtime's reservation, and
XLA's freedom to keep fewer (fusion) or more (scheduling) tensors live. It is a guard
against configs that are clearly too big, not the compiler's number; the smoke and bench
jobs report the real peak (``peak_memory_bytes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from training.errors import UserError

GIB = 1024 ** 3
#: padded caption length Sana trains with (Gemma-2 tokens; NVlabs Sana model_max_length 300)
DEFAULT_TEXT_TOKENS = 300


@dataclasses.dataclass(kw_only=True)
class MemoryEstimate:
    """Bytes per rank by component, for one configuration."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    ema: int
    activations: int
    activations_no_checkpointing: int
    activations_checkpointing: int
    gradient_checkpointing: bool
    world_size: int
    zero1: bool
    batch_size: int
    precision: str

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.ema + self.activations

    def as_gib(self) -> dict[str, Any]:
        """Rounded GiB per component (and the inputs), for logs and JSON."""
        parts = ("weights", "gradients", "optimizer", "ema", "activations",
                 "activations_no_checkpointing", "activations_checkpointing")
        return {"parameters": self.parameters, **{k: round(getattr(self, k) / GIB, 2) for k in parts},
                "total": round(self.total / GIB, 2), "gradient_checkpointing": self.gradient_checkpointing,
                "world_size": self.world_size, "zero1": self.zero1, "batch_size": self.batch_size,
                "precision": self.precision}


@dataclasses.dataclass(frozen=True)
class ActivationCost:
    """Bytes autograd saves per sample: outside the blocks, per block, and one block's input."""

    base: int
    per_block: int
    block_input: int


def measure_activations(model_kwargs: Mapping[str, Any], *, text_tokens: int, bf16: bool) -> ActivationCost:
    """Saved-for-backward bytes per sample of ``SanaTransformer2DModel`` (see the module doc)."""
    import torch
    from diffusers import SanaTransformer2DModel

    dtype = torch.bfloat16 if bf16 else torch.float32

    def saved_bytes(layers: int) -> int:
        kw = {**model_kwargs, "num_layers": layers}
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in the dtype: .to() would log a diffusers warning
        try:
            with torch.device("meta"):
                model = SanaTransformer2DModel(**kw)
        finally:
            torch.set_default_dtype(default)
        with torch.device("meta"):
            size = int(kw.get("sample_size", 32))
            x = torch.empty(1, int(kw.get("in_channels", 32)), size, size, dtype=dtype)
            text = torch.empty(1, text_tokens, int(kw.get("caption_channels", 2304)), dtype=dtype)
            mask, t = torch.ones(1, text_tokens), torch.ones(1)
        by_storage: dict[int, int] = {}
        keep: list[torch.Tensor] = []  # alive until counted, so storages are not reused

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            keep.append(tensor)
            key = tensor.untyped_storage()._cdata
            by_storage[key] = max(by_storage.get(key, 0), tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(hidden_states=x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask,
                  return_dict=False)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        return sum(v for k, v in by_storage.items() if k not in params)  # weights are counted apart

    one, two = saved_bytes(1), saved_bytes(2)
    kw = dict(model_kwargs)
    size = int(kw.get("sample_size", 32)) // int(kw.get("patch_size", 1))
    width = int(kw.get("num_attention_heads", 70)) * int(kw.get("attention_head_dim", 32))
    return ActivationCost(base=one - (two - one), per_block=two - one,
                          block_input=size * size * width * (2 if bf16 else 4))


def count_parameters(model_kwargs: Mapping[str, Any]) -> int:
    import torch
    from diffusers import SanaTransformer2DModel

    with torch.device("meta"):
        return sum(p.numel() for p in SanaTransformer2DModel(**model_kwargs).parameters())


def estimate(cfg: Any, *, world_size: int, text_tokens: int = DEFAULT_TEXT_TOKENS,
             activations: ActivationCost | None = None) -> MemoryEstimate:
    """HBM per rank for a TrainConfig ``cfg`` on ``world_size`` data-parallel ranks."""
    kw = cfg.model.model_kwargs()
    layers = int(kw.get("num_layers", 20))
    params = count_parameters(kw)
    bf16 = cfg.precision == "bf16"
    w = 2 if bf16 else 4
    zero1 = bool(cfg.trainium.zero1)
    n = max(1, int(world_size))
    optimizer = (params * 12 + params * 4) // n if zero1 else params * 2 * w
    act = activations or measure_activations(kw, text_tokens=text_tokens, bf16=bf16)
    b = int(cfg.data.batch_size)
    plain = b * (act.base + layers * act.per_block)
    ckpt = b * (act.base + layers * act.block_input + act.per_block)
    ckpt_on = bool(cfg.model.gradient_checkpointing)
    return MemoryEstimate(parameters=params, weights=params * w, gradients=params * w, optimizer=optimizer,
                          ema=params * 4 if cfg.ema.decay > 0 else 0,
                          activations=ckpt if ckpt_on else plain, activations_no_checkpointing=plain,
                          activations_checkpointing=ckpt, gradient_checkpointing=ckpt_on, world_size=n,
                          zero1=zero1, batch_size=b, precision=cfg.precision)


def largest_fitting_batch(est: MemoryEstimate, limit: int) -> int:
    """The largest micro-batch that fits ``limit`` with everything else unchanged (0: none)."""
    fixed = est.total - est.activations
    per_sample = est.activations // max(1, est.batch_size)
    return max(0, (limit - fixed) // per_sample) if per_sample else est.batch_size


def fix_for(est: MemoryEstimate, limit: int) -> str:
    """The first knob (cheapest in step time first) that brings ``est`` under ``limit``."""
    over = est.total - limit
    if not est.gradient_checkpointing and est.activations_no_checkpointing - est.activations_checkpointing >= over:
        return "set model.gradient_checkpointing: true"
    batch = largest_fitting_batch(est, limit)
    if not est.zero1 and est.world_size > 1:
        zero_saving = est.optimizer - (est.parameters * 16) // est.world_size
        if zero_saving >= over:
            return "set trainium.zero1: true"
    if 0 < batch < est.batch_size:
        return f"lower data.batch_size to {batch} (and raise optim.grad_accum_steps to keep the global batch)"
    if est.precision != "bf16":
        return "set precision: bf16 (bf16 weights with stochastic rounding; fp32 masters under zero1)"
    return "use a smaller model.preset or more ranks with trainium.zero1: true"


def check_fits(est: MemoryEstimate, *, limit_gib: float, device: str) -> None:
    """Raise a one-line UserError when ``est`` exceeds the device's memory."""
    limit = int(limit_gib * GIB)
    if est.total > limit:
        g = est.as_gib()
        raise UserError(f"memory estimate: {g['total']} GiB per {device} exceeds its {limit_gib:g} GiB "
                        f"(weights {g['weights']}, grads {g['gradients']}, optimizer {g['optimizer']}, "
                        f"ema {g['ema']}, activations {g['activations']}); {fix_for(est, limit)}")


def format_table(est: MemoryEstimate, *, limit_gib: float, device: str) -> str:
    """A few lines for the job log: each component and the total against the limit."""
    g = est.as_gib()
    rows = [f"HBM estimate per {device} ({est.parameters / 1e6:.1f}M params, {est.precision}, "
            f"batch {est.batch_size}, world {est.world_size}, zero1 {est.zero1}):"]
    for key in ("weights", "gradients", "optimizer", "ema"):
        rows.append(f"  {key:<12} {g[key]:>7.2f} GiB")
    rows.append(f"  {'activations':<12} {g['activations']:>7.2f} GiB  (checkpointing "
                f"{'on' if est.gradient_checkpointing else 'off'}; off {g['activations_no_checkpointing']:.2f}, "
                f"on {g['activations_checkpointing']:.2f})")
    rows.append(f"  {'total':<12} {g['total']:>7.2f} GiB of {limit_gib:g} GiB")
    return "\n".join(rows)


def neuron_core_memory(instance_type: str | None = None) -> tuple[str, float]:
    """(name, GiB) of what one Trainium rank drives: from ``instance_type`` ("ml.trn2.48xlarge",
    "trn1.32xlarge") or, without one, this host's DMI product name (NeuronCore-v2 elsewhere)."""
    from training.backends.neuron import neuron_accelerator
    from training.flops import ACCELERATORS

    product = instance_type.removeprefix("ml.") if instance_type and instance_type != "local" else None
    name = neuron_accelerator(product)
    return name, float(ACCELERATORS[name].memory_gib)


def check_trainium_config(cfg: Any, *, world_size: int, instance_type: str | None = None,
                          out: Any = None) -> MemoryEstimate:
    """Print the per-core HBM table (to ``out``, e.g. sys.stdout; None = silent) and raise a
    UserError naming the knob when the config cannot fit. Called before the first compile."""
    device, limit = neuron_core_memory(instance_type)
    est = estimate(cfg, world_size=world_size)
    if out is not None:
        print(format_table(est, limit_gib=limit, device=device), file=out, flush=True)
    check_fits(est, limit_gib=limit, device=device)
    return est
