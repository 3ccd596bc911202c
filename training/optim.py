"""AdamW and the learning-rate schedule (linear warm-up, then constant or cosine)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import torch


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """Optimizer, schedule, clipping and accumulation. Defaults follow Sana's AdamW recipe."""

    #: peak learning rate (Sana 600M/1.6B: 1e-4 with AdamW)
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    #: decoupled weight decay (AdamW); Sana uses 0 for its AdamW runs, 0.03 for CAME
    weight_decay: float = 0.0
    eps: float = 1e-8
    #: linear warm-up from 0 to ``lr`` over this many optimizer steps
    warmup_steps: int = 0
    #: after warm-up: "constant" or "cosine" (decays to ``min_lr_ratio * lr`` at max_steps)
    schedule: str = "constant"
    min_lr_ratio: float = 0.0
    #: clip the global gradient norm to this (0 = no clipping; the norm is still logged)
    max_grad_norm: float = 1.0
    #: micro-batches per optimizer step; global batch = batch_size * world_size * this
    grad_accum_steps: int = 1

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # YAML gives a list
        if self.lr <= 0:
            raise ValueError("optim.lr: must be > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError("optim.betas: must be two numbers in [0, 1)")
        if self.weight_decay < 0 or self.eps <= 0:
            raise ValueError("optim.weight_decay / optim.eps: must be >= 0 / > 0")
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


def optimizer_factory(cfg: OptimConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """What ``Backend.build_optimizer`` calls with the (possibly sharded) parameters."""

    def make(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        # torch picks the foreach implementation on CUDA (and DTensor) by itself.
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)

    return make


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
