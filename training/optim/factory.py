"""Optimizers (AdamW, or CAME as NVlabs Sana trains), weight-decay groups and the
learning-rate schedule (linear warm-up, then constant or cosine).

Sana's configs (configs/sana_config/512ms/Sana_600M_img512.yaml, 1024ms/Sana_1600M_img1024.yaml
``train.optimizer``) train with ``type: CAMEWrapper``, ``lr: 1e-4``, ``betas: [0.9, 0.999,
0.9999]``, ``eps: [1e-30, 1e-16]``, ``weight_decay: 0.0``: what every preset sets.
Sana_1600M_img1024_AdamW.yaml is the AdamW variant, with ``weight_decay: 0.01``, ``eps: 1e-8``,
``betas: [0.9, 0.999]``. The CAME implementation is ours (training/optim/came.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

OPTIMIZERS = ("adamw", "came")
#: betas / eps when the config leaves them unset, per optimizer (Sana's CAME values above;
#: torch's AdamW defaults)
DEFAULT_BETAS = {"adamw": (0.9, 0.999), "came": (0.9, 0.999, 0.9999)}
DEFAULT_EPS: dict[str, Any] = {"adamw": 1e-8, "came": (1e-30, 1e-16)}


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """Optimizer, schedule, clipping and accumulation. The section's defaults are torch's AdamW
    without weight decay; the presets set Sana's CAME recipe (see the module docstring), and
    Sana's AdamW variant adds ``weight_decay: 0.01``."""

    #: "adamw" (torch.optim.AdamW) or "came" (Sana's optimizer, the presets'; training/optim/came.py)
    name: str = "adamw"
    #: peak learning rate (Sana 600M/1.6B: 1e-4, AdamW and CAME alike)
    lr: float = 1e-4
    #: AdamW: (beta1, beta2); CAME: (beta1, beta2, beta3). Unset = DEFAULT_BETAS[name]
    betas: tuple[float, ...] | None = None
    #: decoupled weight decay, never applied to biases, norms, embeddings or the
    #: scale-shift tables (see ``param_groups``); Sana's CAME configs use 0.0, its AdamW one 0.01
    weight_decay: float = 0.0
    #: AdamW: one number; CAME: (eps1, eps2). Unset = DEFAULT_EPS[name]
    eps: float | tuple[float, ...] | None = None
    #: CAME: clip the update's RMS to this (came-pytorch / Sana default 1.0)
    clip_threshold: float = 1.0
    #: linear warm-up from 0 to ``lr`` over this many optimizer steps
    warmup_steps: int = 0
    #: after warm-up: "constant" or "cosine" (decays to ``min_lr_ratio * lr`` at max_steps)
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    #: clip the global gradient norm to this (0 = no clipping; the norm is still logged)
    max_grad_norm: float = 1.0
    #: micro-batches per optimizer step; global batch = batch_size * world_size * this
    grad_accum_steps: int = 1
    #: AdamW: torch's fused kernel (``fused=True``: a few kernels for all parameters instead of
    #: ~a dozen foreach passes) when every parameter is on CUDA or CPU; XLA parameters
    #: (Trainium, ZeRO-1) and CAME keep their implementation
    fused: bool = True

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optim.name: {self.name!r} is not one of {list(OPTIMIZERS)}")
        want = 2 if self.name == "adamw" else 3
        betas = DEFAULT_BETAS[self.name] if self.betas is None else self.betas
        self.betas = tuple(float(b) for b in betas)  # YAML gives a list
        if self.lr <= 0:
            raise ValueError("optim.lr: must be > 0")
        if len(self.betas) != want or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas: {self.name} takes {want} numbers in [0, 1), got {list(self.betas)}")
        eps = DEFAULT_EPS[self.name] if self.eps is None else self.eps
        if self.name == "adamw":
            if isinstance(eps, list | tuple):
                raise ValueError("optim.eps: adamw takes one number (e.g. 1e-8)")
            self.eps = float(eps)
        else:
            if not isinstance(eps, list | tuple) or len(eps) != 2:
                raise ValueError("optim.eps: came takes two numbers (Sana: [1e-30, 1e-16])")
            self.eps = tuple(float(e) for e in eps)
        eps_all = self.eps if isinstance(self.eps, tuple) else (self.eps,)
        if self.weight_decay < 0 or not all(e > 0 for e in eps_all):
            raise ValueError("optim.weight_decay / optim.eps: must be >= 0 / > 0")
        if self.clip_threshold <= 0:
            raise ValueError("optim.clip_threshold: must be > 0")
        if self.warmup_steps < 0:
            raise ValueError("optim.warmup_steps: must be >= 0")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.schedule: {self.schedule!r} is not one of 'constant', 'cosine'")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("optim.min_lr_ratio: must be in [0, 1]")
        if self.max_grad_norm < 0:
            raise ValueError("optim.max_grad_norm: must be >= 0 (0 = no clipping)")
        if self.grad_accum_steps < 1:
            raise ValueError("optim.grad_accum_steps: must be >= 1")


#: parameter-name fragments that never take weight decay besides biases and norm weights:
#: the adaLN scale-shift tables (diffusers ``scale_shift_table``; Sana ``scale_shift_table``)
NO_DECAY_NAMES = ("scale_shift_table",)
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    # diffusers' RMSNorm (diffusers.models.normalization.RMSNorm) is its own class, not nn.RMSNorm
    return isinstance(module, NORM_TYPES) or type(module).__name__ in ("RMSNorm", "FP32LayerNorm")


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of the parameters weight decay must not touch: biases, norm weights, embedding
    tables and the scale-shift tables (decaying them pulls gains/offsets towards 0, not a
    regulariser - the usual exclusion, e.g. minGPT's configure_optimizers). Sana's own
    constructor (diffusion/utils/optimizer.py ``MyOptimizerConstructor``) only exempts what a
    module lists in ``zero_weight_decay``; its configs train with weight_decay 0.0, where the
    question does not arise."""
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if (p_name == "bias" or _is_norm(module) or isinstance(module, nn.Embedding)
                    or any(frag in full for frag in NO_DECAY_NAMES)):
                names.add(full)
    return names


def param_groups(params: Iterable[nn.Parameter], cfg: OptimConfig, model: nn.Module | None
                 ) -> list[dict[str, Any]]:
    """``params`` (what a backend hands ``make``: the model's own, possibly DTensor or XLA,
    parameter objects) split into [decay, no-decay] groups when weight decay is on.

    With weight_decay 0 there is one group (nothing to exempt; checkpoints of such runs keep
    one group). Names are looked up by identity on ``model`` at call time, after the backend
    moved/sharded it. Without a model, 0-/1-D tensors (biases, norm weights) are exempt.
    """
    params = [p for p in params if p.requires_grad]  # frozen weights (a LoRA base) take no state
    if cfg.weight_decay == 0:
        return [{"params": params}]
    if model is not None:
        exempt_names = no_decay_names(model)
        exempt = {id(p) for n, p in model.named_parameters() if n in exempt_names}
    else:
        exempt = {id(p) for p in params if p.dim() <= 1}
    groups = [{"params": [p for p in params if id(p) not in exempt], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def optimizer_factory(cfg: OptimConfig, model: nn.Module | None = None
                      ) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """What ``Backend.build_optimizer`` calls with the (possibly sharded) parameters.

    Args:
        cfg: the optim section.
        model: the model those parameters belong to (the loop passes the prepared model),
            for the no-decay names; see ``param_groups``.
    """

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        groups = param_groups(params, cfg, None if model is None else _unwrapped(model))
        if cfg.name == "came":
            from training.optim.came import CAME

            return CAME(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, clip_threshold=cfg.clip_threshold,
                        weight_decay=cfg.weight_decay)
        # fused=None lets torch pick foreach on CUDA (and DTensor); fused=True is the single
        # fused kernel, supported for CUDA since torch 2.0 and CPU since 2.4 (torch.optim.AdamW
        # docs: "fused (bool, optional) - whether the fused implementation is used. Currently,
        # torch.float64, torch.float32, torch.float16, and torch.bfloat16 are supported").
        fused = cfg.fused and fused_supported(g["params"] for g in groups)
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                fused=fused or None)
        opt.register_load_state_dict_pre_hook(_keep_implementation)
        return opt

    return make


#: devices torch's fused AdamW runs on in the versions the project pins (torch>=2.4 for CPU)
FUSED_DEVICES = ("cuda", "cpu")


def fused_supported(param_lists: Iterable[list[nn.Parameter]]) -> bool:
    """True when every parameter is a float tensor on a device with fused AdamW."""
    params = [p for ps in param_lists for p in ps]
    return bool(params) and all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)


#: param-group keys that choose an implementation, not a hyper-parameter
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def _keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``load_state_dict`` pre-hook: the implementation keys are this process's, not the
    checkpoint's. torch's ``Optimizer.load_state_dict`` takes every group key from the saved
    groups, and decides by the saved ``fused``/``capturable`` whether ``step`` moves to the
    parameter's device (``_process_value_according_to_param_policy``). Unchanged, a foreach
    checkpoint would silently resume unfused, and a fused one (CUDA, or CPU since this default)
    would put ``step`` on the XLA device on Trainium: another step graph, a recompile."""
    groups = [{**g, **{k: optimizer.defaults[k] for k in IMPLEMENTATION_KEYS if k in optimizer.defaults}}
              for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def _unwrapped(model: nn.Module) -> nn.Module:
    """torch.compile / DDP wrappers -> the module whose parameter names checkpoints use."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def named_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[tuple[float, list[str]]]:
    """(weight_decay, parameter names) per group: for logs and tests."""
    names = {id(p): n for n, p in _unwrapped(model).named_parameters()}
    for group in optimizer.param_groups:
        yield group["weight_decay"], [names.get(id(p), "?") for p in group["params"]]


def lr_multiplier(step: int, *, cfg: OptimConfig, max_steps: int) -> float:
    """LR / peak LR for the optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, *, max_steps: int
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over ``lr_multiplier``; its state_dict is just the step count, so resume is exact."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg=cfg, max_steps=max_steps))
