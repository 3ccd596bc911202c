"""CAME (Confidence-guided Adaptive Memory Efficient optimizer, Luo et al., ACL 2023,
https://arxiv.org/abs/2307.02047): NVlabs Sana's default optimizer.

Our own implementation of the update in NVlabs/Sana diffusion/utils/optimizer.py
``CAMEWrapper``, which is came-pytorch's ``CAME`` (PyPI came-pytorch 0.1.3, came_pytorch/CAME.py)
with one change: a 4-D weight is factored only when it is a 1x1 conv (over its two channel
dims); other convs (GLUMBConv's 3x3 depthwise) keep a full second moment, where came-pytorch
would factor their 3x3 kernel dims. For 2-D weights and 1-D tensors the two agree, and
tests/training/test_optim.py checks ours against came-pytorch there, update for update.

Per parameter, with g the gradient (in fp32), betas (b1, b2, b3), eps (e1, e2):

- second moment of g**2 + e1: for a factored (rows x cols) weight only its row and column
  means are kept (Adafactor's factorisation: O(rows + cols) memory instead of rows*cols),
  else the full tensor; u = g / sqrt(second moment), clipped so RMS(u) <= clip_threshold;
- m = b1*m + (1-b1)*u (first moment of the update);
- confidence: the instability (u - m)**2 + e2 gets the same factored moment with b3, and the
  step is m / sqrt(instability): confident directions move more;
- decoupled weight decay ``p -= lr * wd * p``, then ``p -= lr * step``.

State tensors are created with ``zeros_like`` of the gradient's reductions, so they take the
gradient's type: plain tensors, XLA tensors or FSDP2 DTensors (whose reductions DTensor
computes over the full tensor, so sharding does not change the math). ``step`` is a 0-d
CPU tensor, like torch's Adam, and everything round-trips through ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def _factored_dims(shape: torch.Size) -> bool:
    """Sana's rule: 2-D weights and 1x1 convs are factored over (out, in)."""
    return len(shape) == 2 or (len(shape) == 4 and shape[2] == 1 and shape[3] == 1)


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.norm(2) / (t.numel() ** 0.5)


def _approx(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """1/sqrt of the rank-1 reconstruction row*col/mean(row) of a (rows x cols) moment."""
    r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    c = col.unsqueeze(-2).rsqrt()
    return torch.mul(r, c)


class CAME(torch.optim.Optimizer):
    """CAME over ``params`` (tensors or param-group dicts).

    Args:
        lr: learning rate (Sana: 1e-4).
        betas: (b1, b2, b3) for the update, squared-gradient and instability averages
            (Sana: (0.9, 0.999, 0.9999)).
        eps: (e1, e2) added to the squared gradient and to the instability (Sana: (1e-30, 1e-16)).
        clip_threshold: RMS bound of the normalised update (1.0).
        weight_decay: decoupled weight decay (Sana's configs: 0.0).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 eps: tuple[float, float] = (1e-30, 1e-16), clip_threshold: float = 1.0,
                 weight_decay: float = 0.0) -> None:
        if lr <= 0:
            raise ValueError(f"CAME: lr must be > 0, got {lr}")
        if len(betas) != 3 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"CAME: betas must be three numbers in [0, 1], got {betas}")
        if len(eps) != 2:
            raise ValueError(f"CAME: eps must be two numbers, got {eps}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=tuple(eps),
                                      clip_threshold=clip_threshold, weight_decay=weight_decay))

    @staticmethod
    def _init_state(grad: torch.Tensor) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float32),
                                          "exp_avg": torch.zeros_like(grad)}
        if _factored_dims(grad.shape):
            g2 = grad.reshape(grad.shape[0], grad.shape[1])
            row, col = torch.zeros_like(g2.sum(dim=1)), torch.zeros_like(g2.sum(dim=0))
            state.update(exp_avg_sq_row=row, exp_avg_sq_col=col,
                         exp_avg_res_row=row.clone(), exp_avg_res_col=col.clone())
        else:
            state["exp_avg_sq"] = torch.zeros_like(grad)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, clip = group["lr"], group["weight_decay"], group["clip_threshold"]
            b1, b2, b3 = group["betas"]
            e1, e2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("CAME does not support sparse gradients")
                if grad.dtype in (torch.float16, torch.bfloat16):
                    grad = grad.float()
                state = self.state[p]
                if not state:
                    state.update(self._init_state(grad))
                state["step"] += 1
                factored = "exp_avg_sq_row" in state
                shape = grad.shape
                g = grad.reshape(shape[0], shape[1]) if factored else grad

                sq = g**2 + e1
                if factored:
                    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
                    row.mul_(b2).add_(sq.mean(dim=1), alpha=1.0 - b2)
                    col.mul_(b2).add_(sq.mean(dim=0), alpha=1.0 - b2)
                    update = _approx(row, col).mul_(g).reshape(shape)
                else:
                    exp_avg_sq = state["exp_avg_sq"]
                    exp_avg_sq.mul_(b2).add_(sq, alpha=1.0 - b2)
                    update = exp_avg_sq.rsqrt().mul_(grad)
                update.div_((_rms(update) / clip).clamp_(min=1.0))

                exp_avg = state["exp_avg"]
                exp_avg.mul_(b1).add_(update, alpha=1.0 - b1)

                if factored:
                    res = (update - exp_avg).reshape(shape[0], shape[1]) ** 2 + e2
                    rrow, rcol = state["exp_avg_res_row"], state["exp_avg_res_col"]
                    rrow.mul_(b3).add_(res.mean(dim=1), alpha=1.0 - b3)
                    rcol.mul_(b3).add_(res.mean(dim=0), alpha=1.0 - b3)
                    update = _approx(rrow, rcol).mul_(exp_avg.reshape(shape[0], shape[1])).reshape(shape)
                else:
                    update = exp_avg.clone()

                if wd != 0:
                    p.add_(p, alpha=-wd * lr)
                update.mul_(lr)
                p.add_(-update.to(p.dtype))
        return loss
