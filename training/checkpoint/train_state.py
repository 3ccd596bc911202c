"""What a resume needs besides weights and optimizer moments to continue bit-identically:
the loop's counters (``TrainState``), every RNG stream, the data loader's position, and the
JSON record (``train_state.json``) that carries them with the run's config and provenance.

Apart from the Checkpointer (training/checkpoint/checkpointer.py) because both formats use
it, and because each piece is a rule of its own: which RNG streams a step draws from, how a
loader position maps onto another world size, what may go into the JSON record.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from training.backends.base import Backend
from training.errors import UserError


class Stateful(Protocol):
    """What the Checkpointer saves of a scheduler, an EMA or a loader."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass(kw_only=True)
class TrainState:
    """Counters the loop advances; saved under the fixed key ``train_state``."""

    step: int = 0
    samples_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state.get("samples_seen", 0))
        self.extra = dict(state.get("extra", {}))


# ----- RNG -----------------------------------------------------------------------------
def capture_rng(backend: Backend | None = None) -> dict[str, Any]:
    """Every RNG stream the step can draw from (numpy state as a tensor: loads with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "backend": backend.rng_state() if backend is not None else {},
    }


def restore_rng(state: Mapping[str, Any], backend: Backend | None = None) -> None:
    """Inverse of ``capture_rng``."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["gauss"]))
    torch.set_rng_state(state["torch"])
    if backend is not None:
        backend.set_rng_state(state.get("backend", {}))


# ----- data position -------------------------------------------------------------------
def map_data_position(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The loader position of a checkpoint, for a loader with another global batch (world size).

    Relies on the loader's ``state_dict`` fields ``epoch``, ``step`` (loader batches done this
    epoch) and ``global_batch`` (samples per loader batch over all ranks), and on its order
    being one global permutation per epoch that ranks split (so it does not depend on the
    world size). The position is ``step * global_batch`` samples into ``epoch``; when the new
    global batch divides it, the loader continues at exactly that sample (its own
    ``step * old // new``), else no whole step lands there and we refuse rather than skip or
    repeat samples.
    """
    old, new = int(saved["global_batch"]), int(current["global_batch"])
    if old == new:
        return dict(saved)
    offset = int(saved["step"]) * old
    if offset % new:
        raise UserError(f"checkpoint.resume: the data position ({offset} samples into epoch {saved['epoch']}, "
                        f"global batch {old}) is not a whole number of steps of the new global batch {new}; "
                        f"resume with a data.batch_size x world size that divides {offset}, or from another step")
    return {**saved, "samples_in_epoch": offset}


# ----- the JSON record (train_state.json) ------------------------------------------------
def model_config(model: nn.Module) -> dict[str, Any] | None:
    """The diffusers config of the model (what export needs to rebuild it), if it has one."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        # ``_use_default_values`` comes from a set: its order changes from process to process.
        return jsonable({k: v for k, v in dict(config).items()
                         if not k.startswith("_") or k in ("_class_name", "_diffusers_version")})
    except TypeError:
        return None


def jsonable(obj: Any) -> Any:
    """JSON-safe copy: tuples -> lists, Paths -> str; a tensor here is a bug in the caller."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 1:
            return obj.item()
        raise TypeError("train_state.json: a tensor in a scheduler/loader/config state; keep those small")
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    raise TypeError(f"train_state.json: cannot store {type(obj).__name__}")
