"""Format ``sana-checkpoint/1`` (``checkpoint.format: full``): rank 0 gathers the full state
and writes every file itself; every rank reads the full files back.

The old single-writer path, kept because benchmarks compare it with the sharded format
(training/checkpoint/sharded.py) and because checkpoints written in it are still read
everywhere. The Checkpointer (training/checkpoint/checkpointer.py) runs the collectives
around these writes; this module owns the files: each one fsynced, the manifest last,
the directory renamed into place (training/checkpoint/layout.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from training.backends.base import Backend
from training.checkpoint.branch import Branch
from training.checkpoint.layout import (
    EMA_FILE,
    FORMAT,
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    commit_dir,
    fault_point,
    fsync_dir,
    fsync_file,
    log,
    sha256_file,
)
from training.errors import UserError
from training.files import honour_umask


def rng_file(rank: int) -> str:
    """Rank ``rank``'s RNG file in this format (rank 0's has the plain name)."""
    return RNG_FILE if rank == 0 else f"rng-rank-{rank:05d}.pt"


# ----- durable writes ----------------------------------------------------------------------
def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True, allow_nan=True)
        fh.flush()
        os.fsync(fh.fileno())


def torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses shared storage (tied weights): give each tensor its own."""
    seen: set[int] = set()
    own: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        value = value.detach().cpu().contiguous()
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen and value.numel():
            value = value.clone()
        seen.add(ptr)
        own[key] = value
    save_file(own, str(path))
    honour_umask(path)  # save_file writes 0600 whatever the umask (training/files)
    fsync_file(path)


# ----- state that is not a flat tensor dict --------------------------------------------------
def split_tensors(state: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Nested state -> (flat ``a/b`` keyed tensors for safetensors, JSON description of the rest).

    Keys are joined with "/" because parameter names already contain dots.
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"tensors": [], "nested": {}, "values": {}}
    for key, value in state.items():
        key = str(key)
        if isinstance(value, torch.Tensor):
            tensors[prefix + key] = value
            meta["tensors"].append(key)
        elif isinstance(value, Mapping):
            sub_t, sub_m = split_tensors(value, prefix + key + "/")
            tensors.update(sub_t)
            meta["nested"][key] = sub_m
        else:
            meta["values"][key] = value
    return tensors, meta


def join_tensors(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None,
                 prefix: str = "") -> dict[str, Any]:
    """Inverse of ``split_tensors`` (``meta`` None: the file holds a flat tensor dict)."""
    if meta is None:
        return dict(tensors)
    out: dict[str, Any] = dict(meta["values"])
    out.update({key: tensors[prefix + key] for key in meta["tensors"]})
    out.update({key: join_tensors(tensors, sub, prefix + key + "/") for key, sub in meta["nested"].items()})
    return out


# ----- write ---------------------------------------------------------------------------------
def write_main(tmp: Path, *, step: int, model_sd: Mapping[str, torch.Tensor], optim_sd: Any,
               ema_sd: Mapping[str, Any] | None, rng: Any,
               train_state: Callable[[dict[str, Any] | None], dict[str, Any]]) -> None:
    """Rank 0: every file except the manifest, each fsynced. ``train_state(ema_meta)`` gives
    the ``train_state.json`` record (it describes how the EMA file was flattened)."""
    fault_point(step, "start")
    save_tensors(model_sd, tmp / MODEL_FILE)
    fault_point(step, "after-model")
    torch_save(optim_sd, tmp / OPTIMIZER_FILE)
    ema_meta: dict[str, Any] | None = None
    if ema_sd is not None:
        ema_tensors, ema_meta = split_tensors(ema_sd)
        save_tensors(ema_tensors, tmp / EMA_FILE)
    write_json(tmp / STATE_FILE, train_state(ema_meta))
    torch_save(rng, tmp / rng_file(0))


def commit(tmp: Path, final: Path, *, step: int, world_size: int, branch: Branch) -> None:
    """Rank 0: manifest last, then rename into place."""
    fault_point(step, "before-manifest")
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
    write_json(tmp / MANIFEST, {"format": FORMAT, "step": step, "files": files,
                                "world_size": world_size, "branch": branch.to_json()})
    fsync_dir(tmp)
    fault_point(step, "before-rename")
    commit_dir(tmp, final)
    log.info("checkpoint saved: %s", final)


# ----- read ----------------------------------------------------------------------------------
def restore_full(backend: Backend, path: Path, meta: Mapping[str, Any], *, model: nn.Module,
              optimizer: torch.optim.Optimizer, ema: Any) -> None:
    """Every rank reads the full files (fine for old checkpoints) and loads them through the
    backend."""
    backend.load_model_state_dict(model, load_file(str(path / MODEL_FILE)))
    backend.load_optimizer_state_dict(model, optimizer,
                                      torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    if ema is not None:
        if not (path / EMA_FILE).exists():
            raise UserError(f"{path}: has no {EMA_FILE} but this run keeps an EMA; resume from a "
                            "checkpoint written with EMA on, or turn EMA off")
        ema.load_state_dict(join_tensors(load_file(str(path / EMA_FILE)), meta.get("ema_meta")))
