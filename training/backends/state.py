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
from collections.abc import Mapping
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
