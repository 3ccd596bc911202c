"""The portable optimizer-state format every backend produces and consumes.

Format (the same as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
with ``full_state_dict=True, cpu_offload=True``, so FSDP2 output needs no conversion)::

    {"state": {"<param name>": {"step": Tensor, "exp_avg": Tensor, "exp_avg_sq": Tensor}, ...},
     "param_groups": [{"lr": ..., "betas": ..., ..., "params": ["<param name>", ...]}, ...]}

Parameter names are those of the *unwrapped* model's ``named_parameters()`` (no
``module.`` / ``_orig_mod.`` prefixes); tensors are full (unsharded), on CPU, in the
optimizer's own dtype. A parameter the optimizer has not stepped yet has no entry in
``state``. Because nothing refers to parameter positions, a checkpoint written by one
backend or world size loads under another.

Only torch is imported here: the Trainium backend (torch 2.9 + torch-xla) reuses it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> name, over the unwrapped model."""
    return {id(p): name for name, p in model.named_parameters()}


def to_named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Plain (unsharded) optimizer state -> the portable name-keyed CPU format.

    Args:
        model: the unwrapped model whose parameters ``optimizer`` steps.
        optimizer: a torch optimizer over (a subset of) those parameters.
    """
    names = param_names(model)
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        group_names = []
        for p in group["params"]:
            name = names[id(p)]
            group_names.append(name)
            if p in optimizer.state and optimizer.state[p]:
                state[name] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                               for k, v in optimizer.state[p].items()}
        groups.append({**hyper, "params": group_names})
    return {"state": state, "param_groups": groups}


def from_named_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                               named: Mapping[str, Any]) -> None:
    """Load the portable format into a plain optimizer (inverse of ``to_named_optimizer_state``).

    Goes through ``optimizer.load_state_dict`` so dtypes/devices are handled by torch.
    """
    names = param_names(model)
    saved_groups = named["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state has {len(saved_groups)} param groups, optimizer has "
                         f"{len(optimizer.param_groups)}")
    index: dict[str, int] = {}
    groups = []
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        ours = [names[id(p)] for p in group["params"]]
        if sorted(ours) != sorted(saved["params"]):
            raise ValueError("optimizer state names a different parameter set than this model "
                             f"(e.g. {sorted(set(ours) ^ set(saved['params']))[:3]})")
        for name in ours:
            index[name] = len(index)
        groups.append({**{k: v for k, v in saved.items() if k != "params"},
                       "params": [index[n] for n in ours]})
    state = {index[name]: dict(value) for name, value in named["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ----- sharded state: each rank's rows, never gathered -----------------------------------------
#: ``read(key, start, stop)`` -> CPU rows [start, stop) of the saved global tensor ``key``
#: (``start``/``stop`` None: the whole tensor); training/checkpoint/shards.py supplies it.
RowReader = Callable[[str, "int | None", "int | None"], torch.Tensor]


def chunk_rows(n: int, index: int, count: int) -> tuple[int, int]:
    """Rows [start, stop) of chunk ``index`` of ``count`` along dim 0: ceil(n/count) rows each,
    the last ones shorter or empty. Both shardings we hold split this way: FSDP2's
    ``fully_shard`` ("shards ... on dim-0", i.e. ``torch.chunk(dim=0)``;
    https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html) and torch_xla's
    ZeRO-1 (``ZeroRedundancyOptimizer._shard_tensor``: pad dim 0 to a multiple of the world
    size, then ``chunk``), so a ZeRO-1 shard is these rows plus zero padding."""
    size = -(-n // count) if count else n
    start = min(index * size, n)
    return start, min(start + size, n)


@dataclass
class Piece:
    """Rows [lo, hi) of ``src`` (a local tensor on the device) are rows [row0, row0 + hi - lo)
    of the global tensor of ``shape``; ``lo`` None = ``src`` is a whole 0-dim value."""

    src: torch.Tensor
    lo: int | None
    hi: int | None
    row0: int
    shape: tuple[int, ...]


@dataclass
class ShardedState:
    """One rank's part of model + optimizer state: its pieces, small non-tensor optimizer
    values and the (name-keyed) param groups."""

    pieces: dict[str, Piece] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)


def placement_problem(placements: tuple[Any, ...]) -> str | None:
    """Why a DTensor laid out by ``placements`` cannot go into a sharded checkpoint (None: it can).

    A sharded checkpoint stores each tensor by global rows: a mesh dim may hold ``Shard(0)``
    (rows ``chunk_rows`` of the coordinate) or ``Replicate()``, and at most one mesh dim may
    shard. The type is compared exactly, not with isinstance: ``_StridedShard`` (FSDP2 + TP,
    torch/distributed/tensor/placement_types.py) subclasses ``Shard`` in torch 2.9 (the
    Trainium pin) but interleaves rows, so it would pass an isinstance check and be written
    with the wrong rows. ``Partial`` (pending reductions) and ``Shard(d > 0)`` are refused too.
    """
    from torch.distributed.tensor import Replicate, Shard

    sharding = 0
    for placement in placements:
        if type(placement) is Shard and placement.dim == 0:
            sharding += 1
        elif type(placement) is not Replicate:
            return f"placement {placement!r} is not Shard(0) or Replicate()"
    if sharding > 1:
        return f"placements {tuple(placements)!r} shard dim 0 over more than one mesh dim"
    return None


def unsupported_placements(model: nn.Module, extra: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """``name: reason`` for every checkpointed tensor of ``model`` (and ``extra``, e.g. EMA
    shadows) whose DTensor placements a sharded checkpoint cannot store; empty when all can.
    Cheap (no data touched): the Checkpointer calls it before step 0."""
    tensors = {**_trainable(model), **(extra or {})}
    problems = []
    for name, t in tensors.items():
        if hasattr(t, "device_mesh") and (problem := placement_problem(tuple(t.placements))):
            problems.append(f"{name}: {problem}")
    return problems


def local_piece(t: torch.Tensor, rank: int, world: int) -> Piece | None:
    """The piece of ``t`` this rank writes, or None when another rank writes it.

    A DTensor writes rows of its own Shard(0) chunk; the ranks that hold the same chunk (the
    Replicate mesh dims: HSDP's replica groups, one per node) split those rows between them
    with ``chunk_rows``, so every rank writes about 1/world of the state instead of replica 0
    writing all of it. A plain tensor that every rank holds (DDP, the XLA backend's
    replicated weights) is split into ``chunk_rows`` so each rank writes 1/world of it; a
    0-dim tensor is written by one rank. Any split is exact on restore: pieces are
    contiguous global rows and ``ShardReader`` assembles rows from whichever files hold them.
    """
    if hasattr(t, "device_mesh"):  # DTensor (FSDP2 / HSDP)
        return _dtensor_piece(t)
    shape = tuple(t.shape)
    if t.dim() == 0:
        return Piece(t, None, None, 0, shape) if rank == 0 else None
    start, stop = chunk_rows(shape[0], rank, world)
    if stop == start:
        return Piece(t, 0, 0, 0, shape) if shape[0] == 0 and rank == 0 else None
    return Piece(t, start, stop, start, shape)


def _dtensor_piece(t: torch.Tensor) -> Piece | None:
    mesh, coords = t.device_mesh, t.device_mesh.get_coordinate()
    if coords is None:
        return None  # this rank is not part of the tensor's mesh
    if problem := placement_problem(tuple(t.placements)):
        raise ValueError(f"sharded checkpoint: {problem}")
    shard_dim = next((i for i, p in enumerate(t.placements) if p.is_shard()), None)
    local, shape = t.to_local(), tuple(t.shape)
    # The replicas of this rank's chunk, numbered row-major over the non-sharding mesh dims.
    replica, replicas = 0, 1
    for i, coord in enumerate(coords):
        if i != shard_dim:
            replica, replicas = replica * mesh.size(i) + coord, replicas * mesh.size(i)
    if local.dim() == 0:
        return Piece(local, None, None, 0, shape) if replica == 0 else None
    start, stop = 0, shape[0]
    if shard_dim is not None:
        start, stop = chunk_rows(shape[0], coords[shard_dim], mesh.size(shard_dim))
        if local.shape[0] != stop - start:
            raise ValueError(f"sharded checkpoint: local shard of {shape} has {local.shape[0]} rows, "
                             f"torch.chunk gives {stop - start}")
    if shape[0] == 0:  # no rows anywhere: one rank records the (empty) tensor
        return Piece(local, 0, 0, 0, shape) if replica == 0 and not any(coords) else None
    lo, hi = chunk_rows(stop - start, replica, replicas)
    return Piece(local, lo, hi, start + lo, shape) if hi > lo else None


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of the model: trainable parameters and persistent buffers.
    Frozen parameters (``requires_grad=False``: a LoRA base) come from ``model.pretrained``."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in frozen}


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> ShardedState:
    """This rank's ``ShardedState`` of a plain or FSDP2 model and its torch optimizer."""
    out = ShardedState()
    for name, t in _trainable(model).items():
        if (piece := local_piece(t.detach(), rank, world)) is not None:
            out.pieces[f"model/{name}"] = piece
    names = param_names(model)
    for p, entry in optimizer.state.items():
        name = names[id(p)]
        for key, value in entry.items():
            if torch.is_tensor(value):
                if (piece := local_piece(value.detach(), rank, world)) is not None:
                    out.pieces[f"optim/{name}/{key}"] = piece
            elif rank == 0:
                out.values[f"{name}/{key}"] = copy.deepcopy(value)
    out.param_groups = to_named_optimizer_state(model, _NoState(optimizer))["param_groups"]
    return out


class _NoState:
    """An optimizer's param groups without its state (``to_named_optimizer_state`` copies
    every state tensor; the groups are all a sharded save needs from it)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = optimizer.param_groups
        self.state: dict = {}


def read_like(t: torch.Tensor, key: str, read: RowReader) -> torch.Tensor:
    """The saved rows of ``key`` that ``t`` holds on this rank (its local shard for a DTensor,
    everything for a plain tensor), as a CPU tensor in the saved dtype."""
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import Shard

        coords = t.device_mesh.get_coordinate() or []
        for i, placement in enumerate(t.placements):
            if isinstance(placement, Shard):
                start, stop = chunk_rows(t.shape[0], coords[i], t.device_mesh.size(i))
                return read(key, start, stop)
    return read(key, None, None)


def _as_like(rows: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``rows`` (CPU, local) -> a tensor shaped like ``t``: a DTensor of the same layout for a
    DTensor (what FSDP2's optimizer state holds), else moved to ``t``'s device."""
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import DTensor

        local = rows.to(device=t.to_local().device, dtype=t.dtype)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return rows.to(device=t.device)


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, read: RowReader, *,
                       keys: set[str], values: Mapping[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Inverse of ``sharded_state`` under any world size and wrapping: each rank reads only
    the rows it holds. ``keys`` are the saved tensor keys (``model/...``, ``optim/...``)."""
    own = _trainable(model)
    saved = {k.removeprefix("model/") for k in keys if k.startswith("model/")}
    if saved != set(own):
        missing, unexpected = sorted(set(own) - saved), sorted(saved - set(own))
        raise ValueError(f"model state does not match this model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    with torch.no_grad():
        for name, t in own.items():
            rows = read_like(t, f"model/{name}", read)
            target = t.to_local() if hasattr(t, "device_mesh") else t
            target.copy_(rows.to(device=target.device, dtype=target.dtype))
    params = dict(model.named_parameters())
    state: dict[str, dict[str, Any]] = {}
    for key in sorted(keys):
        if key.startswith("optim/"):
            name, sub = key.removeprefix("optim/").rsplit("/", 1)
            p = params[name]
            value = read(key, None, None) if key_is_scalar(key, read) else _as_like(read_like(p, key, read), p)
            state.setdefault(name, {})[sub] = value
    for key, value in values.items():
        name, sub = key.rsplit("/", 1)
        state.setdefault(name, {})[sub] = value
    from_named_optimizer_state(model, optimizer, {"state": state, "param_groups": param_groups})


def key_is_scalar(key: str, read: RowReader) -> bool:
    """True when the saved tensor ``key`` is 0-dim (AdamW's ``step``): not sharded."""
    shape = getattr(read, "shape", None)
    return shape is not None and len(shape(key)) == 0


# ----- ZeRO-1 (torch_xla ZeroRedundancyOptimizer): each rank's optimizer shard, never gathered --
#: (parameter name, the full replicated parameter, this rank's padded fp32 shard of it)
ZeroPair = tuple[str, torch.Tensor, torch.Tensor]


def zero1_rows_of(key: str, value: Any) -> bool:
    """Whether optimizer state entry ``key`` is sharded by rows like its ZeRO-1 parameter shard
    (Adam's moments; CAME's first moment, row statistics and unfactored second moments), as
    opposed to a scalar (``step``) or an entry every rank holds whole (CAME's column
    statistics: training/optim/came.py ``REPLICATED_STATE``). By name, not by shape: a column
    statistic can be as long as a shard is tall."""
    from training.optim.came import REPLICATED_STATE

    return torch.is_tensor(value) and value.dim() > 0 and key not in REPLICATED_STATE


def zero1_sharded_state(pairs: list[ZeroPair], base_state: Mapping[Any, Mapping[str, Any]], model: nn.Module,
                        param_groups: list[dict[str, Any]], rank: int, world: int, *,
                        master_weights: bool) -> ShardedState:
    """This rank's ``ShardedState`` under ZeRO-1: the moments of its own shard (the real rows
    ``chunk_rows`` of each padded ``shard``, no all-gather), the weights it owns (the same
    rows; from the fp32 master shard when ``master_weights``), buffers split as usual."""
    out = ShardedState()
    names = {name for name, _, _ in pairs}
    for name, t in _trainable(model).items():
        if name not in names and (piece := local_piece(t.detach(), rank, world)) is not None:
            out.pieces[f"model/{name}"] = piece  # buffers (and parameters outside the optimizer)
    for name, param, shard in pairs:
        n = param.shape[0]
        start, stop = chunk_rows(n, rank, world)
        shape = tuple(param.shape)
        if stop > start:
            src, lo = (shard, 0) if master_weights else (param, start)
            out.pieces[f"model/{name}"] = Piece(src.detach(), lo, lo + stop - start, start, shape)
        for key, value in (base_state.get(shard) or {}).items():
            if zero1_rows_of(key, value):
                if stop > start:
                    out.pieces[f"optim/{name}/{key}"] = Piece(value.detach(), 0, stop - start, start, shape)
            elif torch.is_tensor(value):
                if rank == 0:
                    out.pieces[f"optim/{name}/{key}"] = Piece(value.detach(), None, None, 0, tuple(value.shape))
            elif rank == 0:
                out.values[f"{name}/{key}"] = copy.deepcopy(value)
    out.param_groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                         "params": [param_names(model)[id(p)] for p in g["params"]]} for g in param_groups]
    return out


def zero1_rows(read: RowReader, key: str, n: int, rank: int, world: int) -> torch.Tensor:
    """Rows of ``key`` for this rank's ZeRO-1 shard: ``chunk_rows`` plus zero padding to
    ceil(n / world) rows, exactly what ``_shard_tensor`` of the full tensor gives."""
    start, stop = chunk_rows(n, rank, world)
    rows = read(key, start, stop)
    size = -(-n // world)
    if rows.shape[0] < size:
        rows = torch.cat([rows, rows.new_zeros((size - rows.shape[0], *rows.shape[1:]))])
    return rows


def zero1_load_sharded_state(pairs: list[ZeroPair], base_state: dict[Any, dict[str, Any]], model: nn.Module,
                             read: RowReader, rank: int, world: int, *, keys: set[str],
                             values: Mapping[str, Any], device: torch.device) -> None:
    """Inverse of ``zero1_sharded_state`` for any saved world size or format: full weights
    on every rank (they are replicated), this rank's padded rows of the master weights and
    of every moment into the base optimizer's state."""
    own = _trainable(model)
    saved = {k.removeprefix("model/") for k in keys if k.startswith("model/")}
    if saved != set(own):
        raise ValueError(f"model state does not match this model (missing {sorted(set(own) - saved)[:3]}, "
                         f"unexpected {sorted(saved - set(own))[:3]})")
    with torch.no_grad():
        for name, t in own.items():
            # Swap the device data instead of copy_(): a copy would be traced into the next graph.
            t.data = read(f"model/{name}", None, None).to(dtype=t.dtype).to(device)
        for name, param, shard in pairs:
            n = param.shape[0]
            shard.data = zero1_rows(read, f"model/{name}", n, rank, world).to(torch.float32).to(device)
            entry: dict[str, Any] = {}
            for key in sorted(k for k in keys if k.startswith(f"optim/{name}/")):
                sub = key.rsplit("/", 1)[1]
                if key_is_scalar(key, read):
                    entry[sub] = read(key, None, None)  # AdamW's / CAME's step: stays on the host
                elif not zero1_rows_of(sub, torch.empty(1)):
                    entry[sub] = read(key, None, None).to(torch.float32).to(device)  # whole on every rank
                else:
                    entry[sub] = zero1_rows(read, key, n, rank, world).to(torch.float32).to(device)
            for vkey, value in values.items():
                if vkey.rsplit("/", 1)[0] == name:
                    entry[vkey.rsplit("/", 1)[1]] = value
            if entry:
                base_state[shard] = entry


def full_from_reader(read: RowReader, keys: set[str], values: Mapping[str, Any],
                     param_groups: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model state, portable optimizer state), full, from a sharded checkpoint: for a
    backend whose every rank holds everything anyway (the XLA backend without ZeRO-1)."""
    model = {k.removeprefix("model/"): read(k, None, None) for k in sorted(keys) if k.startswith("model/")}
    state: dict[str, dict[str, Any]] = {}
    for key in sorted(k for k in keys if k.startswith("optim/")):
        name, sub = key.removeprefix("optim/").rsplit("/", 1)
        state.setdefault(name, {})[sub] = read(key, None, None)
    for key, value in values.items():
        name, sub = key.rsplit("/", 1)
        state.setdefault(name, {})[sub] = value
    return model, {"state": state, "param_groups": param_groups}
