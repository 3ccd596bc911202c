"""Exponential moving average of the weights (what Sana samples from at the end)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from training.optim.sharding import Piece, RowReader, local_piece, read_like


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
    collective under FSDP: call it on every rank. Sharded checkpoints use ``pieces`` /
    ``load_pieces`` instead, which never gather.
    """

    def __init__(self, model: nn.Module, cfg: EmaConfig) -> None:
        self.cfg = cfg
        self.shadow: dict[str, torch.Tensor] = {
            name: p.detach().float().clone() for name, p in model.named_parameters() if p.requires_grad}
        self._params: list[torch.Tensor] | None = None
        self._model_id: int | None = None

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """After optimizer step ``step`` (1-based count of steps done).

        One ``torch._foreach_lerp_`` over all shadows instead of a ``lerp_`` per parameter:
        the foreach ops group same-device/dtype tensors into multi-tensor kernels (torch's
        ``_foreach_*`` ops, as ``torch.optim`` uses them with ``foreach=True``), so a CUDA
        step launches a handful of kernels, not one per parameter (~600 for Sana 1.6B).
        Same arithmetic as ``lerp_`` element by element (bit-identical on CPU).
        """
        weight = 1.0 if step <= self.cfg.start_step else 1.0 - self.cfg.decay
        if self._model_id != id(model) or self._params is None:
            named = dict(model.named_parameters())
            self._params = [named[name] for name in self.shadow]
            self._model_id = id(model)
        params = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self._params]
        torch._foreach_lerp_(list(self.shadow.values()), params, weight)

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

    # ----- sharded checkpoints (training/checkpoint/sharded.py) ------------------------
    def pieces(self, rank: int, world: int) -> dict[str, Piece]:
        """This rank's rows of every shadow tensor, keyed ``ema/<name>`` (no gather)."""
        out = {}
        for name, t in self.shadow.items():
            if (piece := local_piece(t, rank, world)) is not None:
                out[f"ema/{name}"] = piece
        return out

    @torch.no_grad()
    def load_pieces(self, read: RowReader, keys: set[str]) -> None:
        """Read back the rows each shadow holds on this rank, under any world size."""
        missing = {f"ema/{n}" for n in self.shadow} - keys
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...")
        for name, t in self.shadow.items():
            target = t.to_local() if hasattr(t, "device_mesh") else t
            target.copy_(read_like(t, f"ema/{name}", read).to(device=target.device, dtype=torch.float32))

    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA weights into ``model`` (e.g. before an export)."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in self.shadow:
                    p.copy_(self.shadow[name].to(p.dtype))
