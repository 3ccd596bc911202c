"""CAME (Confidence-guided Adaptive Memory Efficient optimizer, Luo et al., ACL 2023,
https://arxiv.org/abs/2307.02047): NVlabs Sana's default optimizer.

Our own implementation of the update in NVlabs/Sana diffusion/utils/optimizer.py
``CAMEWrapper``, which is came-pytorch's ``CAME`` (PyPI came-pytorch 0.1.3, came_pytorch/CAME.py)
with one change: a 4-D weight is factored only when it is a 1x1 conv (over its two channel
dims); other convs (GLUMBConv's 3x3 depthwise) keep a full second moment, where came-pytorch
would factor their 3x3 kernel dims. For 2-D weights and 1-D tensors the two agree, and
tests/training/optim/test_optim.py checks ours against came-pytorch there, update for update.

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

Row-sharded (ZeRO-1, torch_xla ``ZeroRedundancyOptimizer``): each rank steps only its dim-0
shard of every parameter (``_shard_tensor``: zero-padded to a multiple of the world size,
then ``chunk(world)[rank]``). A shard holds whole rows, so the row statistics, the first
moment and the unfactored second moments shard by rows exactly like Adam's moments; what
needs every row is a *sum over rows*: the column statistics (means over rows), the mean of
the row statistics in the rank-1 reconstruction, and the update's RMS. ``shard()`` gives
this optimizer, per parameter shard, the full row count and a mask of its real (unpadded)
rows as device data, plus a ``reduce`` (an all-reduce SUM over the ZeRO group); the step
then sums those quantities over its real rows, reduces them, and divides by the full row
count, so every rank computes the update of the unsharded CAME on its rows. The sums of all
parameters go out together: three all-reduces per step (after the squared gradient, after
the update, after the instability). The column statistics come out equal on every rank and
are kept whole there (``REPLICATED_STATE``); tests/training/optim/test_came_sharded.py checks the
sharded step against the unsharded one over real collectives (gloo), padding included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch


def _factored_dims(shape: torch.Size) -> bool:
    """Sana's rule: 2-D weights and 1x1 convs are factored over (out, in)."""
    return len(shape) == 2 or (len(shape) == 4 and shape[2] == 1 and shape[3] == 1)


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.norm(2) / (t.numel() ** 0.5)


def _approx(row: torch.Tensor, col: torch.Tensor, row_mean: torch.Tensor | None = None) -> torch.Tensor:
    """1/sqrt of the rank-1 reconstruction row*col/mean(row) of a (rows x cols) moment
    (``row_mean``: the mean over every row, when ``row`` is a shard of them)."""
    mean = row.mean(dim=-1, keepdim=True) if row_mean is None else row_mean
    r = (row / mean).rsqrt_().unsqueeze(-1)
    c = col.unsqueeze(-2).rsqrt()
    return torch.mul(r, c)


#: state entries that are whole on every rank under ZeRO-1 (column statistics); every other
#: non-scalar entry is sharded by rows like the parameter
REPLICATED_STATE = frozenset({"exp_avg_sq_col", "exp_avg_res_col"})

#: all-reduce SUM of a list of tensors (returns the reduced tensors, same shapes)
Reduce = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class RowShard:
    """A parameter shard's place in the full parameter: ``rows`` = the full parameter's first
    dimension; ``real`` = bool [shard rows], True for the rows that are not ZeRO padding."""

    rows: int
    real: torch.Tensor


def flat_reduce(all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> Reduce:
    """A ``Reduce`` that sends its tensors as ONE flat tensor through ``all_reduce`` (a SUM
    over the group, returning the result): one collective per phase, whatever the count."""

    def reduce(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]))
        out, at = [], 0
        for t in tensors:
            out.append(flat[at:at + t.numel()].view_as(t))
            at += t.numel()
        return out

    return reduce


def row_shards(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], shard_rows: Callable[[torch.Tensor], torch.Tensor],
               device: torch.device) -> dict[torch.Tensor, RowShard]:
    """``RowShard`` of each (full parameter, its shard), with ``shard_rows`` the sharder's own
    rule applied to a column of ones (ZeRO-1's ``_shard_tensor``: pad, then this rank's
    chunk), so the padding rows are exactly where the sharder put them. The masks are made
    on the host and transferred: graph inputs, not constants (one step graph on every rank,
    whose last ranks hold the padding)."""
    return {shard: RowShard(rows=int(param.shape[0]), real=(shard_rows(torch.ones(param.shape[0])) > 0).to(device))
            for param, shard in pairs}


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
        self._shards: dict[torch.Tensor, RowShard] = {}
        self._reduce: Reduce | None = None

    def shard(self, shards: Mapping[torch.Tensor, RowShard], reduce: Reduce) -> None:
        """Step ``shards`` (this optimizer's parameters, each a dim-0 shard) as rows of their
        full parameters: sums over rows go through ``reduce`` (see the module docstring)."""
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) not in mine for p in shards):
            raise ValueError("CAME.shard: a shard that is not one of this optimizer's parameters")
        self._shards, self._reduce = dict(shards), reduce

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

    def init_state(self) -> None:
        """Create every parameter's state now, as zeros on its device, as its first step would
        (in fp32, the dtype the step computes in). On XLA this makes step 0 trace the steady
        graph instead of one that also creates the state: one compile instead of two."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and not self.state.get(p):
                    host = torch.zeros(p.shape, dtype=torch.float32)  # host zeros + one transfer each
                    self.state[p] = {k: (v if k == "step" else v.to(p.device))
                                     for k, v in self._init_state(host).items()}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CAME does not support sparse gradients")
                grad = p.grad.float() if p.grad.dtype in (torch.float16, torch.bfloat16) else p.grad
                state = self.state[p]
                if not state:
                    state.update(self._init_state(grad))
                state["step"] += 1
                items.append(_Item(p, group, grad, state, self._shards.get(p)))
        # 1. squared gradient -> row / column statistics -> normalised update
        pending = [t for it in items for t in it.second_moment()]
        _give(items, "second_moment", self._reduced(pending))
        pending = [t for it in items for t in it.normalise()]
        _give(items, "normalise", self._reduced(pending))
        # 2. first moment, instability -> its statistics -> the step
        pending = [t for it in items for t in it.instability()]
        _give(items, "instability", self._reduced(pending))
        for it in items:
            it.apply()
        return loss

    def _reduced(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not tensors or self._reduce is None:
            return tensors
        return self._reduce(tensors)


def _give(items: list[_Item], phase: str, reduced: list[torch.Tensor]) -> None:
    """Hand each item back the reduced tensors it asked for in ``phase``, in order."""
    at = 0
    for it in items:
        n = it.asked[phase]
        it.received[phase] = reduced[at:at + n]
        at += n


class _Item:
    """One parameter's step, in the phases the optimizer interleaves with its reductions.

    Unsharded, every phase computes exactly came-pytorch's expressions (bit for bit:
    tests/training/optim/test_optim.py); sharded, the means over rows become sums over the real
    rows, reduced across ranks, over the full row count."""

    def __init__(self, p: torch.Tensor, group: dict[str, Any], grad: torch.Tensor, state: dict[str, Any],
                 shard: RowShard | None) -> None:
        self.p, self.group, self.grad, self.state, self.shard = p, group, grad, state, shard
        self.shape = grad.shape
        self.factored = "exp_avg_sq_row" in state
        self.g = grad.reshape(self.shape[0], self.shape[1]) if self.factored else grad
        self.asked: dict[str, int] = {}
        self.received: dict[str, list[torch.Tensor]] = {}
        self.update: torch.Tensor | None = None

    # -- helpers -----------------------------------------------------------------------
    def _real(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with its padding rows zeroed (``where``, so an inf/nan there cannot leak)."""
        real = self.shard.real.view(-1, *([1] * (t.dim() - 1)))
        return torch.where(real, t, torch.zeros((), dtype=t.dtype, device=t.device))

    def _ask(self, phase: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.asked[phase] = len(tensors)
        return tensors

    def _numel(self) -> int:
        return self.shard.rows * (self.grad.numel() // self.shape[0])

    # -- phases ------------------------------------------------------------------------
    def second_moment(self) -> list[torch.Tensor]:
        b2 = self.group["betas"][1]
        self.sq = self.g**2 + self.group["eps"][0]
        if not self.factored:
            return self._ask("second_moment", [])
        row = self.state["exp_avg_sq_row"]
        row.mul_(b2).add_(self.sq.mean(dim=1), alpha=1.0 - b2)  # whole rows: local either way
        if self.shard is None:
            return self._ask("second_moment", [])
        return self._ask("second_moment", [self._real(self.sq).sum(dim=0), self._real(row).sum().reshape(1)])

    def normalise(self) -> list[torch.Tensor]:
        b2 = self.group["betas"][1]
        if self.factored:
            row, col = self.state["exp_avg_sq_row"], self.state["exp_avg_sq_col"]
            if self.shard is None:
                col.mul_(b2).add_(self.sq.mean(dim=0), alpha=1.0 - b2)
                update = _approx(row, col)
            else:
                col_sum, row_sum = self.received["second_moment"]
                col.mul_(b2).add_(col_sum / self.shard.rows, alpha=1.0 - b2)
                update = _approx(row, col, row_sum / self.shard.rows)
            self.update = update.mul_(self.g).reshape(self.shape)
        else:
            exp_avg_sq = self.state["exp_avg_sq"]
            exp_avg_sq.mul_(b2).add_(self.sq, alpha=1.0 - b2)
            self.update = exp_avg_sq.rsqrt().mul_(self.grad)
        if self.shard is None:
            return self._ask("normalise", [])
        return self._ask("normalise", [self._real(self.update**2).sum().reshape(1)])

    def instability(self) -> list[torch.Tensor]:
        b1, b3 = self.group["betas"][0], self.group["betas"][2]
        clip = self.group["clip_threshold"]
        rms = _rms(self.update) if self.shard is None else (self.received["normalise"][0][0] / self._numel()).sqrt()
        self.update.div_((rms / clip).clamp_(min=1.0))
        exp_avg = self.state["exp_avg"]
        exp_avg.mul_(b1).add_(self.update, alpha=1.0 - b1)
        if not self.factored:
            return self._ask("instability", [])
        self.res = (self.update - exp_avg).reshape(self.shape[0], self.shape[1]) ** 2 + self.group["eps"][1]
        rrow = self.state["exp_avg_res_row"]
        rrow.mul_(b3).add_(self.res.mean(dim=1), alpha=1.0 - b3)
        if self.shard is None:
            return self._ask("instability", [])
        return self._ask("instability", [self._real(self.res).sum(dim=0), self._real(rrow).sum().reshape(1)])

    def apply(self) -> None:
        b3 = self.group["betas"][2]
        lr, wd = self.group["lr"], self.group["weight_decay"]
        exp_avg = self.state["exp_avg"]
        if self.factored:
            rrow, rcol = self.state["exp_avg_res_row"], self.state["exp_avg_res_col"]
            if self.shard is None:
                rcol.mul_(b3).add_(self.res.mean(dim=0), alpha=1.0 - b3)
                approx = _approx(rrow, rcol)
            else:
                col_sum, row_sum = self.received["instability"]
                rcol.mul_(b3).add_(col_sum / self.shard.rows, alpha=1.0 - b3)
                approx = _approx(rrow, rcol, row_sum / self.shard.rows)
            update = approx.mul_(exp_avg.reshape(self.shape[0], self.shape[1])).reshape(self.shape)
        else:
            update = exp_avg.clone()
        if wd != 0:
            self.p.add_(self.p, alpha=-wd * lr)
        update.mul_(lr)
        self.p.add_(-update.to(self.p.dtype))
