"""Exponential moving average of the weights (what Sana samples from at the end)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn


@dataclasses.dataclass(kw_only=True)
class EmaConfig:
    """EMA of the transformer weights; off unless ``decay`` > 0."""

    #: per optimizer step: ema = decay * ema + (1 - decay) * weights (Sana: 0.9999); 0 = off
    decay: float = 0.0
    #: optimizer steps before the EMA starts tracking (it copies the weights until then)
    start_step: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError("ema.decay: must be in [0, 1) (0 = off)")
        if self.start_step < 0:
            raise ValueError("ema.start_step: must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.decay > 0.0


def _full(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters are DTensors: gather the full tensor (collective on every rank).
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class EMA:
    """Shadow fp32 copies of ``model``'s trainable parameters, on the same device and
    with the same sharding as the parameters (so FSDP shards the EMA too).

    ``state_dict()`` is full, on CPU, keyed by parameter name like the model's, and is a
    collective under FSDP: call it on every rank.
    """

    def __init__(self, model: nn.Module, cfg: EmaConfig) -> None:
        self.cfg = cfg
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().float().clone() for name, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step ``step`` (1-based count of steps done)."""
        weight = 1.0 if step <= self.cfg.start_step else 1.0 - self.cfg.decay
        for name, p in model.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach().float(), weight)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: _full(t).detach().cpu().clone() for name, t in self.shadow.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...")
        for name, t in self.shadow.items():
            full = state[name].to(torch.float32)
            if hasattr(t, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full.to(t.device), t.device_mesh, t.placements)
            t.copy_(full)

    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA weights into ``model`` (e.g. before an export)."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in self.shadow:
                    p.copy_(self.shadow[name].to(p.dtype))
