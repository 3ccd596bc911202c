"""Full tensors out of a checkpoint of either format, one tensor at a time (export, tests).

A sharded checkpoint is consolidated offline in one process: ``iter_full`` assembles each
tensor from the rank files that hold its rows (mmap'd, training/checkpoint/shards.py) and
yields it before reading the next, so peak memory is one full tensor plus what the caller
keeps, never the whole optimizer state.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from training.checkpoint.layout import (
    EMA_FILE,
    FORMAT_SHARDED,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    read_manifest,
)
from training.checkpoint.sharded import shard_files
from training.checkpoint.shards import ShardReader

PARTS = ("model", "ema", "optim")


def is_sharded(ckpt: Path) -> bool:
    return (read_manifest(ckpt) or {}).get("format") == FORMAT_SHARDED


def has_part(ckpt: Path, part: str) -> bool:
    """Whether ``ckpt`` holds ``part`` ("model", "ema", "optim")."""
    if is_sharded(ckpt):
        with ShardReader(shard_files(ckpt)) as reader:
            return any(k.startswith(f"{part}/") for k in reader.keys())  # noqa: SIM118 - a set, not a dict
    return (ckpt / {"model": MODEL_FILE, "ema": EMA_FILE, "optim": OPTIMIZER_FILE}[part]).exists()


def iter_full(ckpt: Path, part: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full CPU tensor)`` of ``part`` ("model" or "ema"), one at a time."""
    if part not in ("model", "ema"):
        raise ValueError(f"iter_full: part must be 'model' or 'ema', got {part!r}")
    if not is_sharded(ckpt):
        yield from load_file(str(ckpt / (MODEL_FILE if part == "model" else EMA_FILE))).items()
        return
    with ShardReader(shard_files(ckpt)) as reader:
        for key in sorted(reader.keys()):
            if key.startswith(f"{part}/"):
                yield key.removeprefix(f"{part}/"), reader(key).clone()


def load_full(ckpt: Path) -> dict[str, Any]:
    """Everything as full tensors: {"model", "ema" (None without EMA), "optimizer" (the
    portable name-keyed format of training/optim/sharding.py)}. Holds it all: tests and
    small models only; export streams with ``iter_full``."""
    if not is_sharded(ckpt):
        ema = dict(load_file(str(ckpt / EMA_FILE))) if (ckpt / EMA_FILE).exists() else None
        return {"model": dict(load_file(str(ckpt / MODEL_FILE))), "ema": ema,
                "optimizer": torch.load(ckpt / OPTIMIZER_FILE, map_location="cpu", weights_only=True)}
    meta = json.loads((ckpt / STATE_FILE).read_text())
    out: dict[str, Any] = {"model": {}, "ema": {}, "optimizer": {"state": {}, "param_groups": meta["param_groups"]}}
    with ShardReader(shard_files(ckpt)) as reader:
        for key in sorted(reader.keys()):
            part, rest = key.split("/", 1)
            if part == "optim":
                name, sub = rest.rsplit("/", 1)
                out["optimizer"]["state"].setdefault(name, {})[sub] = reader(key).clone()
            else:
                out[part][rest] = reader(key).clone()
    for key, value in (meta.get("optim_values") or {}).items():
        name, sub = key.rsplit("/", 1)
        out["optimizer"]["state"].setdefault(name, {})[sub] = value
    if not meta.get("has_ema"):
        out["ema"] = None
    return out
