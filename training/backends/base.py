"""The seam between the shared training loop and an accelerator.

The loop (training/loop.py) never asks which backend it runs on; everything that
differs between CUDA/CPU (torch.distributed) and Trainium (torch-xla) lives behind
this interface. A feature a backend does not have is a no-op (``nullcontext()``
for autocast, an immediate call for ``on_host``), never an ``if xla:`` in the loop.

All state dicts crossing this seam are *full, unsharded, CPU* tensors keyed by the
unwrapped model's parameter names, so a checkpoint written by one backend resumes
under the other. The exception is the sharded-checkpoint seam (``sharded_state`` /
``load_sharded_state``): each rank's own rows, never gathered (training/checkpoint/).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

Batch = dict[str, torch.Tensor]


class Backend(abc.ABC):
    """One accelerator family. Lifecycle: ``init()`` once, use, ``close()`` once."""

    #: short name written to logs, checkpoints and bench JSON ("gpu", "trainium")
    name: str
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    #: True when batches may change their caption length from step to step (training/data/text_trim.py):
    #: eager backends; False keeps the padded length (XLA: a new shape is a new graph)
    trims_text: bool = False

    @property
    def is_main(self) -> bool:
        """True on the one process that writes files (rank 0)."""
        return self.rank == 0

    # ----- lifecycle -------------------------------------------------------
    @abc.abstractmethod
    def init(self) -> None:
        """Join the process group (torchrun env: RANK, WORLD_SIZE, LOCAL_RANK) and pick the device."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the process group. Safe to call after a failed ``init``."""

    # ----- model and optimizer --------------------------------------------
    @abc.abstractmethod
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move to the device, cast for the precision mode and wrap for data parallelism.

        Returns the module the loop calls forward on; ``unwrap(prepared)`` gives back
        the plain model whose ``state_dict`` keys the checkpoints use.
        """

    @abc.abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside whatever ``prepare_model`` wrapped it in."""

    @abc.abstractmethod
    def build_optimizer(self, model: nn.Module, make: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        """Build the optimizer over ``model``'s parameters with ``make`` (AdamW or CAME with the
        configured hyper-parameters, training/optim/factory.py); a backend may wrap it (ZeRO-1 on
        Trainium). Hand ``make`` the model's own parameter objects as they are after
        ``prepare_model`` (DTensors under FSDP2, XLA tensors): ``make`` splits them into
        weight-decay groups by looking their names up on the model by identity."""

    # ----- the step ---------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Precision context for forward (bf16 autocast, or ``nullcontext``)."""
        return contextlib.nullcontext()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for micro-batches that must not all-reduce yet (grad accumulation)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """Host batches -> device batches (pinned async copy on CUDA, MpDeviceLoader on XLA)."""

    @abc.abstractmethod
    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
                      ) -> torch.Tensor:
        """Reduce gradients across ranks where the wrapper has not, clip to ``max_norm``
        (0 = no clipping) and step the optimizer. Returns the pre-clip global grad norm as a
        *device* tensor: reading it is the caller's choice (see ``on_host``)."""

    def sync(self) -> None:
        """End of an optimizer step: XLA cuts and launches the graph here; eager backends do nothing."""
        return None

    def on_host(self, fn: Callable[..., None], *tensors: torch.Tensor) -> None:
        """Call ``fn`` with these tensors as Python floats, without stalling the device.

        Eager backends call it now. XLA defers it with ``xm.add_step_closure`` so the values
        are read after the step's graph ran: no host transfer inside the step.
        """
        fn(*(float(t.detach().float().cpu()) for t in tensors))

    # ----- collectives / state ----------------------------------------------
    @abc.abstractmethod
    def barrier(self) -> None:
        """Every rank reaches this point before any continues (``xm.rendezvous`` on XLA)."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small Python objects: a resume path, a step)."""

    def agree_max_async(self, value: int) -> Callable[[], int]:
        """Start the max of a small int over all ranks; the returned callable waits for it.

        Host-side (a gloo all-reduce of one CPU int on a CPU process group): no device work,
        no op in an XLA step graph, nothing the device queue waits for, so the loop can start
        one every step and read it one step later for free (training/failure/preemption.py). Every
        rank must start the same sequence. One process: ``value``."""
        return lambda: value

    @abc.abstractmethod
    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full CPU state dict of the unwrapped model. Collective: call on every rank."""

    @abc.abstractmethod
    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        """Load a full CPU state dict into the prepared model on every rank."""

    @abc.abstractmethod
    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full, unsharded CPU optimizer state keyed by parameter *name* (portable across
        backends and world sizes). Collective: call on every rank. The format and helpers
        that produce/consume it: training/optim/sharding.py."""

    @abc.abstractmethod
    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, Any]) -> None:
        """Inverse of ``optimizer_state_dict``; each rank keeps only its shard if sharded."""

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """This rank's rows of the trainable weights, buffers and optimizer state, nothing
        gathered (a ``training.optim.sharding.ShardedState``; sharded checkpoints). Not a
        collective. The default covers plain, DDP and FSDP2/HSDP (DTensor) models."""
        from training.optim.sharding import sharded_state

        return sharded_state(self.unwrap(model), optimizer, self.rank, self.world_size)

    def load_sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, read: Any, *,
                           keys: set[str], values: Mapping[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """Inverse of ``sharded_state`` under any world size: each rank reads only its rows
        through ``read`` (training/optim/sharding.py ``load_sharded_state``)."""
        from training.optim.sharding import load_sharded_state

        load_sharded_state(self.unwrap(model), optimizer, read, keys=keys, values=values, param_groups=param_groups)

    def rng_state(self) -> dict[str, Any]:
        """Device RNG state to checkpoint (CUDA / XLA generator); CPU/python/numpy RNG is
        saved by the checkpoint module itself."""
        return {}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        """Restore what ``rng_state`` returned (ignores keys of another backend)."""
        return None

    def peak_memory_bytes(self) -> int | None:
        """Peak accelerator memory of this process, or None where the backend cannot tell."""
        return None

    def describe(self) -> dict[str, Any]:
        """Facts for logs and bench JSON: accelerator name, count per node, versions."""
        return {"backend": self.name, "world_size": self.world_size, "device": str(self.device)}


def gloo_max_async(value: int, group: Any) -> Callable[[], int]:
    """``agree_max_async`` over a gloo process group (``group`` None: the default group, when
    that is gloo). Issued from the calling (main) thread, so every rank issues its collectives
    on the group in the same order, as gloo pairs them (by sequence number)."""
    import torch.distributed as dist

    box = torch.tensor([int(value)], dtype=torch.int64)
    work = dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def result() -> int:
        work.wait()
        return int(box.item())

    return result
