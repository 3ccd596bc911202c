"""Device-memory estimate per rank: per NeuronCore before the first compile on Trainium, and
per GPU by mesh (ddp/fsdp/hsdp) and activation-checkpointing mode (the GPU section below:
``estimate_gpu``, ``check_gpu_config``, ``gpu_memory_table`` for ``bench --memory-table``).

A NeuronCore-v2 (trn1/trn1n) has 16 GiB of HBM (training/model/flops.py ACCELERATORS). neuronx-cc
only finds out after minutes of compiling ("Estimated peak HBM usage exceeds 16GB",
awsdocs-neuron neuronx-cc error codes / troubleshooting), so a config that cannot fit is
refused here first, naming the knob that makes it fit.

The estimate, per rank, for P parameters, N data-parallel ranks, micro-batch B:

  weights      P * w           w = 4 (fp32, bf16-mixed: fp32 master weights) or 2 (bf16)
  gradients    P * w           same dtype as the weights
  optimizer    AdamW: 2 moments in the weight dtype (P * 2w); CAME (Sana's optimizer,
               training/optim/came.py): its state in fp32 whatever the weights' dtype, the first
               moment (P) plus, per weight it factors, 2 x (rows + columns) statistics,
               and the full second moment of the rest (biases, 3x3 depthwise convs):
               counted exactly from the parameter shapes (``optimizer_state_elements``).
               With ZeRO-1 the state is sharded by rows (CAME's column statistics stay
               whole on every rank) next to an fp32 master copy of each shard and the
               reduce-scattered gradient shard (AdamW: P * 16 / N): torch_xla
               ZeroRedundancyOptimizer with optimizer_dtype=float32 (pytorch/xla v2.9
               torch_xla/distributed/zero_redundancy_optimizer.py). The reduce-scatter
               runs in fp32 (``higher_cc_precision``): in precision bf16 each bucket of
               gradients is cast to fp32 first, one ``trainium.zero1_bucket_mb`` bucket
               counted with the gradients (XLA schedules the casts bucket by bucket: the
               compiler, not this estimate, has the last word)
  EMA          P * 4 when ema.decay > 0 (fp32 shadow on the device, training/optim/ema.py)
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
import functools
import math
from collections.abc import Mapping, Sequence
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


def optimizer_state_elements(shapes: Sequence[tuple[int, ...]], name: str) -> tuple[int, int]:
    """(elements sharded by rows, elements whole on every rank) of optimizer ``name``'s state
    for parameters of ``shapes`` (``step`` scalars left out). AdamW: two moments per
    element; CAME: training/optim/came.py ``_init_state`` (factored weights keep row and column
    statistics, the column ones whole under ZeRO-1 / FSDP)."""
    import torch

    from training.optim.came import _factored_dims

    if name != "came":
        return 2 * sum(math.prod(s) for s in shapes), 0
    rows = whole = 0
    for shape in shapes:
        rows += math.prod(shape)  # exp_avg
        if _factored_dims(torch.Size(shape)):
            rows += 2 * shape[0]  # exp_avg_sq_row, exp_avg_res_row
            whole += 2 * shape[1]  # exp_avg_sq_col, exp_avg_res_col
        else:
            rows += math.prod(shape)  # exp_avg_sq
    return rows, whole


def trainable_shapes(cfg: Any) -> list[tuple[int, ...]]:
    """Shapes of the parameters that train: the whole transformer, or its LoRA adapters."""
    if getattr(getattr(cfg, "lora", None), "enabled", False):
        from training.model.build import build_model
        from training.model.lora import apply_lora

        model = build_model(dataclasses.replace(cfg.model, pretrained=None, init="torch"), device="meta")
        apply_lora(model, cfg.lora)
        return [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return list(_shapes(_frozen(cfg.model.model_kwargs())))


@functools.cache
def _shapes(frozen_kwargs: tuple[tuple[str, Any], ...]) -> tuple[tuple[int, ...], ...]:
    import torch
    from diffusers import SanaTransformer2DModel

    with torch.device("meta"):
        return tuple(tuple(p.shape) for p in SanaTransformer2DModel(**dict(frozen_kwargs)).parameters())


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
    # LoRA (training/model/lora.py): gradients, optimizer state and EMA exist for the adapters only
    shapes = trainable_shapes(cfg)
    trainable = sum(math.prod(s) for s in shapes)
    name = getattr(cfg.optim, "name", "adamw")
    rows, whole = optimizer_state_elements(shapes, name)
    state_bytes = 4 if name == "came" else w  # CAME computes (and keeps) its state in fp32
    if zero1:  # fp32 master shard + gradient shard + the state's rows, over N; CAME's columns whole
        optimizer = (trainable * 4 + trainable * 4 + rows * 4) // n + whole * 4
    else:
        optimizer = (rows + whole) * state_bytes
    gradients = trainable * w
    if zero1 and bf16:  # one bucket of gradients cast to fp32 for the reduce-scatter
        gradients += min(trainable * 4, int(cfg.trainium.zero1_bucket_mb) * 2**20)
    act = activations or measure_activations(kw, text_tokens=text_tokens, bf16=bf16)
    b = int(cfg.data.batch_size)
    plain = b * (act.base + layers * act.per_block)
    ckpt = b * (act.base + layers * act.block_input + act.per_block)
    ckpt_on = bool(cfg.model.gradient_checkpointing)
    return MemoryEstimate(parameters=params, weights=params * w, gradients=gradients, optimizer=optimizer,
                          ema=trainable * 4 if cfg.ema.decay > 0 else 0,
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
        return "set model.activation_checkpointing: full"
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
    from training.backends.neuron_runtime import neuron_accelerator
    from training.model.flops import ACCELERATORS

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


# ----- GPU: per-GPU estimate by mesh and activation-checkpointing mode ----------------------
#
# Per rank, P parameters, mesh shard factor S (ddp 1, fsdp N ranks, hsdp the shard group),
# fp32 weights under both fp32 and bf16-mixed (fp32 masters, training/backends/gpu.py):
#
#   weights     4P / S, plus under FSDP/HSDP the unsharded copies of the units being gathered:
#               two blocks at a time (the current one and the prefetched next, FSDP2's default
#               forward/backward prefetch of one unit) in fp32 (every unit gathers fp32,
#               training/backends/gpu.py ``_fully_shard``), and the root's own parameters
#   gradients   DDP: 4P once - ``param.grad`` is a view into DDP's all-reduce buckets
#               (``gradient_as_bucket_view=True``; without it the buckets are a second copy,
#               torch DistributedDataParallel docs: "the saved memory size will be equal to
#               the total gradients size");
#               FSDP/HSDP: 4P / S reduce-scattered shards plus two blocks' unsharded grads
#   optimizer   AdamW: exp_avg + exp_avg_sq in fp32, 8P / S; CAME: ~4P / S, counted exactly
#               (``optimizer_state_elements``: the first moment in full, the second
#               factored into row statistics, sharded, and column statistics, whole)
#   EMA         4P / S when ema.decay > 0
#   (with LoRA, gradients, optimizer state and EMA count the adapters' parameters only)
#   activations measured, not modelled: the bytes autograd saves for backward
#               (``saved_tensors_hooks``, deduplicated by storage) in a forward of the real
#               diffusers model with our fp32 linear-attention processor, on fake tensors
#               (``FakeTensorMode``: no memory, no compute) under the run's autocast, so the
#               bf16 copies autocast makes are counted where they are saved. From 1- and
#               2-block forwards: per-block cost a, the rest b; block input h (the fp32
#               residual stream [L, D]); s = the outputs selective checkpointing keeps per
#               block (training/model/activation_checkpointing.py SAC_SAVE_OPS, counted by a
#               dispatch mode). Per sample, with k checkpointed blocks of L:
#                 none        b + L a
#                 full        b + L h + a          (one block recomputed at a time)
#                 every_n     b + (L - k) a + k h + a
#                 selective   b + L (h + s) + a
#
# Not counted: the CUDA context and cuBLAS/cuDNN workspaces (~0.5-1 GiB), NCCL buffers, the
# caching allocator's fragmentation, torch.compile's own buffers (compile usually keeps fewer
# activations: fused elementwise ops save less). The table is for choosing a config; the bench
# records the real peak (``peak_memory_bytes``). Caption tokens are counted at the padded
# length: trimming only lowers a batch's activations, and the largest batch must still fit.

#: device memory assumed when not on CUDA: an 80 GB H100 / A100-80GB
DEFAULT_GPU_GIB = 80.0
MESHES = ("ddp", "fsdp", "hsdp")
AC_MODES = ("none", "full", "every_n", "selective")
#: FSDP2 keeps the current unit and the one it prefetches unsharded
_GATHERED_BLOCKS = 2


@dataclasses.dataclass(frozen=True)
class GpuActivationCost:
    """Saved-for-backward bytes per sample under one precision (see the section comment)."""

    base: int
    per_block: int
    block_input: int
    selective_per_block: int

    def per_sample(self, layers: int, mode: str, checkpointed: int) -> int:
        if mode == "none":
            return self.base + layers * self.per_block
        if mode == "selective":
            return self.base + layers * (self.block_input + self.selective_per_block) + self.per_block
        k = layers if mode == "full" else checkpointed
        return self.base + (layers - k) * self.per_block + k * self.block_input + (self.per_block if k else 0)


def _fake_saved_bytes(model_kwargs: Mapping[str, Any], layers: int, text_tokens: int,
                      autocast: bool) -> tuple[int, int]:
    """(autograd-saved bytes, outputs of SAC_SAVE_OPS bytes) of one sample's forward."""
    import torch
    from diffusers import SanaTransformer2DModel
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from training.model.activation_checkpointing import SAC_SAVE_OPS
    from training.model.attention import use_fp32_linear_attention

    save_ops = frozenset(o.default for o in SAC_SAVE_OPS if hasattr(o, "default"))

    class KeptOutputs(TorchDispatchMode):
        """Sums the output bytes of the ops selective checkpointing saves."""

        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func in save_ops:
                for t in out if isinstance(out, tuple | list) else (out,):
                    if isinstance(t, torch.Tensor):
                        self.total += t.numel() * t.element_size()
            return out

    kw = {**model_kwargs, "num_layers": layers}
    with FakeTensorMode():
        model = SanaTransformer2DModel(**kw)
        use_fp32_linear_attention(model)
        model.train()
        size = int(kw.get("sample_size", 32))
        x = torch.empty(1, int(kw.get("in_channels", 32)), size, size)
        text = torch.empty(1, text_tokens, int(kw.get("caption_channels", 2304)))
        mask, t = torch.ones(1, text_tokens), torch.ones(1)
        by_storage: dict[int, int] = {}
        keep: list[torch.Tensor] = []  # alive until counted, so storages are not reused

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            keep.append(tensor)
            key = tensor.untyped_storage()._cdata
            by_storage[key] = max(by_storage.get(key, 0), tensor.numel() * tensor.element_size())
            return tensor

        kept = KeptOutputs()
        with (torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
              torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), kept):
            model(hidden_states=x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask,
                  return_dict=False)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
    return sum(v for k, v in by_storage.items() if k not in params), kept.total


def _frozen(kwargs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, list | dict)))


@functools.cache
def _param_counts(frozen_kwargs: tuple[tuple[str, Any], ...]) -> tuple[int, int]:
    """(parameters, parameters outside the transformer blocks), counted on the meta device."""
    kw = dict(frozen_kwargs)
    return count_parameters(kw), count_parameters({**kw, "num_layers": 0})


@functools.cache
def _gpu_activations(frozen_kwargs: tuple[tuple[str, Any], ...], text_tokens: int,
                     autocast: bool) -> GpuActivationCost:
    kw = dict(frozen_kwargs)
    (one, sac1), (two, sac2) = (_fake_saved_bytes(kw, n, text_tokens, autocast) for n in (1, 2))
    size = int(kw.get("sample_size", 32)) // int(kw.get("patch_size", 1))
    width = int(kw.get("num_attention_heads", 70)) * int(kw.get("attention_head_dim", 32))
    return GpuActivationCost(base=one - (two - one), per_block=two - one, block_input=size * size * width * 4,
                             selective_per_block=sac2 - sac1)


def gpu_activations(model_kwargs: Mapping[str, Any], *, text_tokens: int, precision: str) -> GpuActivationCost:
    """Measured activation bytes per sample for ``precision`` ("bf16-mixed" under autocast)."""
    return _gpu_activations(_frozen(model_kwargs), int(text_tokens), precision == "bf16-mixed")


@dataclasses.dataclass(kw_only=True)
class GpuMemoryEstimate:
    """Bytes per GPU by component for one config, mesh and checkpointing mode."""

    parameters: int
    weights: int
    gradients: int
    optimizer: int
    ema: int
    activations: int
    mesh: str
    shard: int  # ranks the state is sharded over (1 under DDP)
    world_size: int
    activation_checkpointing: str
    batch_size: int
    precision: str

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.ema + self.activations

    def as_gib(self) -> dict[str, Any]:
        parts = ("weights", "gradients", "optimizer", "ema", "activations")
        return {"parameters": self.parameters, **{k: round(getattr(self, k) / GIB, 2) for k in parts},
                "total": round(self.total / GIB, 2), "mesh": self.mesh, "shard": self.shard,
                "world_size": self.world_size, "activation_checkpointing": self.activation_checkpointing,
                "batch_size": self.batch_size, "precision": self.precision}


def _mesh_of(cfg: Any) -> str:
    mesh = str(getattr(cfg.gpu, "distributed", "ddp"))
    return mesh if mesh in MESHES else "ddp"


def _ac_of(cfg: Any) -> tuple[str, int]:
    """(mode, every_n) from model.activation_checkpointing, or the older boolean."""
    mode = getattr(cfg.model, "activation_checkpointing", None)
    if mode is None:
        mode = "full" if cfg.model.gradient_checkpointing else "none"
    return str(mode), int(getattr(cfg.model, "checkpoint_every_n", 2))


def estimate_gpu(cfg: Any, *, world_size: int, mesh: str | None = None, ac: str | None = None,
                 text_tokens: int = DEFAULT_TEXT_TOKENS, shard_group_size: int | None = None) -> GpuMemoryEstimate:
    """Per-GPU memory of TrainConfig ``cfg`` on ``world_size`` ranks (mesh / ac default to the config's)."""
    from training.model.activation_checkpointing import checkpointed_blocks

    kw = cfg.model.model_kwargs()
    mesh = mesh or _mesh_of(cfg)
    mode, every_n = _ac_of(cfg)
    mode = ac or mode
    if mesh not in MESHES or mode not in AC_MODES:
        raise ValueError(f"mesh {mesh!r} / activation checkpointing {mode!r}: not one of {MESHES} / {AC_MODES}")
    n = max(1, int(world_size))
    group = int(shard_group_size or getattr(cfg.gpu, "shard_group_size", 0) or 8)
    shard = {"ddp": 1, "fsdp": n, "hsdp": min(group, n)}[mesh]
    layers = int(kw.get("num_layers", 20))
    params, no_blocks = _param_counts(_frozen(kw))
    block = (params - no_blocks) // max(1, layers)
    root = params - block * layers
    # FSDP units gather fp32 parameters in every precision (training/backends/gpu.py
    # ``_fully_shard``: autocast casts per op, as under DDP)
    gathered = (_GATHERED_BLOCKS * block * 4 + root * 4) if shard > 1 else 0
    weights = params * 4 // shard + gathered
    # DDP: the buckets are the gradients (gradient_as_bucket_view); FSDP: shards + gathered units
    grads = params * 4 if mesh == "ddp" else params * 4 // shard + _GATHERED_BLOCKS * block * 4
    # LoRA (training/model/lora.py): gradients, optimizer state and EMA exist for the adapters only
    shapes = trainable_shapes(cfg)
    trainable = sum(math.prod(s) for s in shapes)
    # fp32 state; under FSDP/HSDP sharded by rows (DTensor Shard(0)), CAME's column statistics whole
    rows, whole = optimizer_state_elements(shapes, getattr(cfg.optim, "name", "adamw"))
    if trainable != params:
        grads = trainable * 4 // (1 if mesh == "ddp" else shard)
    act = gpu_activations(kw, text_tokens=text_tokens, precision=cfg.precision)
    k = len(checkpointed_blocks(layers, mode, every_n))
    b = int(cfg.data.batch_size)
    return GpuMemoryEstimate(parameters=params, weights=weights, gradients=grads,
                             optimizer=rows * 4 // shard + whole * 4,
                             ema=trainable * 4 // shard if cfg.ema.decay > 0 else 0,
                             activations=b * act.per_sample(layers, mode, k), mesh=mesh, shard=shard,
                             world_size=n, activation_checkpointing=mode, batch_size=b, precision=cfg.precision)


def gpu_fix_for(est: GpuMemoryEstimate, cfg: Any, limit: int) -> str:
    """The first knob (cheapest in step time first) that brings ``est`` under ``limit``."""
    # recompute cost: selective (elementwise ops only) < every_n (1/n of the blocks) < full
    for mode in ("selective", "every_n", "full"):
        if (mode != est.activation_checkpointing and est.activation_checkpointing != "full"
                and estimate_gpu(cfg, world_size=est.world_size, mesh=est.mesh, ac=mode).total <= limit):
            return f"set model.activation_checkpointing: {mode}"
    if est.mesh == "ddp" and est.world_size > 1:
        for mesh in ("hsdp", "fsdp"):
            if estimate_gpu(cfg, world_size=est.world_size, mesh=mesh,
                            ac=est.activation_checkpointing).total <= limit:
                return f"set gpu.distributed: {mesh}"
    fixed = est.total - est.activations
    per_sample = est.activations // max(1, est.batch_size)
    batch = max(0, (limit - fixed) // per_sample) if per_sample else 0
    if 0 < batch < est.batch_size:
        return f"lower data.batch_size to {batch} (and raise optim.grad_accum_steps to keep the global batch)"
    return "use gpu.distributed: fsdp with more GPUs, model.activation_checkpointing: full, or a smaller model.preset"


def check_gpu_fits(est: GpuMemoryEstimate, cfg: Any, *, limit_gib: float, device: str) -> None:
    """One-line UserError naming the knob when ``est`` exceeds the GPU's memory."""
    limit = int(limit_gib * GIB)
    if est.total > limit:
        g = est.as_gib()
        raise UserError(f"memory estimate: {g['total']} GiB per {device} exceeds its {limit_gib:g} GiB "
                        f"(weights {g['weights']}, grads {g['gradients']}, optimizer {g['optimizer']}, "
                        f"ema {g['ema']}, activations {g['activations']} at batch {est.batch_size}, "
                        f"{est.mesh}, checkpointing {est.activation_checkpointing}); {gpu_fix_for(est, cfg, limit)}")


def gpu_device_memory() -> tuple[str, float]:
    """(name, GiB) of this process's CUDA device, or the 80 GB default off CUDA."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.name, props.total_memory / GIB
    return "80 GB GPU (default; no CUDA device here)", DEFAULT_GPU_GIB


def check_gpu_config(cfg: Any, *, world_size: int, out: Any = None) -> GpuMemoryEstimate:
    """Before step 0 on the GPU backend: print the estimate (to ``out``; None = silent) and
    refuse a config that cannot fit this GPU (80 GB off CUDA) with the knob to change."""
    device, limit = gpu_device_memory()
    est = estimate_gpu(cfg, world_size=world_size)
    if out is not None:
        g = est.as_gib()
        print(f"memory estimate per GPU ({device}, {limit:.0f} GiB): weights {g['weights']}, grads "
              f"{g['gradients']}, optimizer {g['optimizer']}, ema {g['ema']}, activations {g['activations']} "
              f"(batch {est.batch_size}, {est.mesh} over {est.shard}, checkpointing "
              f"{est.activation_checkpointing}) = {g['total']} GiB", file=out, flush=True)
    check_gpu_fits(est, cfg, limit_gib=limit, device=device)
    return est


def gpu_memory_table(cfg: Any, *, world_size: int, limit_gib: float = DEFAULT_GPU_GIB) -> str:
    """A markdown table: total GiB per GPU (activations in brackets) for every mesh and mode."""
    rows = [f"| checkpointing | {' | '.join(MESHES)} |", f"|---|{'---|' * len(MESHES)}"]
    for mode in AC_MODES:
        cells = []
        for mesh in MESHES:
            est = estimate_gpu(cfg, world_size=world_size, mesh=mesh, ac=mode)
            g = est.as_gib()
            mark = "" if est.total <= limit_gib * GIB else " (over)"
            cells.append(f"{g['total']:.1f} ({g['activations']:.1f}){mark}")
        label = f"every_n (n={_ac_of(cfg)[1]})" if mode == "every_n" else mode
        rows.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(rows)
