"""Trainium backend: torch-xla on NeuronCores (``PJRT_DEVICE=NEURON``), or on torch-xla's
CPU device in tests (``PJRT_DEVICE=CPU``).

What makes XLA different from the eager GPU backend, and how this file handles it:

- **One graph per optimizer step.** Every op is traced lazily; ``sync()`` (``torch_xla.sync``)
  cuts the trace and launches it, once per step. Nothing else here cuts a graph inside a
  step: no ``.item()``, no ``print`` of a tensor, no branch on a tensor value. Loss and
  grad-norm reach the host through ``on_host`` -> ``xm.add_step_closure``, which runs after
  the step's graph executed, and only when the loop asks (its logging interval).
- **Static shapes.** The loader gives fixed shapes (padding + drop_last). A new shape or a
  new Python constant in the graph means a new neuronx-cc compile (minutes for 600M).
  ``compile_stats()`` exposes the compile count/seconds so tests and bench can prove the
  graph stayed the same.
- **No DDP wrapper.** Data parallelism is an explicit gradient all-reduce in
  ``clip_and_step`` (``xm.reduce_gradients``, the same call ``xm.optimizer_step`` makes),
  or the reduce-scatter inside torch_xla's ``ZeroRedundancyOptimizer`` (ZeRO-1).
- **Host batches are transferred without a background reader.** torch-xla's
  ``MpDeviceLoader`` is NOT used on purpose: (1) it calls ``torch_xla.sync()`` on every
  ``next()``, which with gradient accumulation would cut one graph per micro-batch instead
  of one per optimizer step, and (2) its thread reads the loader ahead, so the loader's
  ``state_dict()`` at checkpoint time would be ahead of training by the prefetch depth and
  a resume would skip samples. The FeatureLoader already prefetches host batches in its
  own thread with exact position tracking, and ``torch_xla.sync()`` returns before the
  device finishes, so the next batch's host read and transfer overlap the running step.

Precision modes (``TrainConfig.precision``), and the trade-off:

- ``fp32``: fp32 weights and compute. Reference numerics; slowest on NeuronCores
  (the matmul engines are bf16-native; fp32 runs at a fraction of the rate).
- ``bf16-mixed``: fp32 master weights and AdamW state, forward under
  ``torch.autocast("xla", dtype=torch.bfloat16)``. Accurate updates without special
  runtime settings; weights + states cost 16 bytes/parameter (with ZeRO-1: 4 + 12/N).
- ``bf16``: pure bf16 weights, gradients and AdamW state: 8 bytes/parameter and the
  fastest step, but an update smaller than half a bf16 ulp of the weight rounds away
  under round-to-nearest, so training stalls silently. The Neuron runtime's stochastic
  rounding (``NEURON_RT_STOCHASTIC_ROUNDING_EN=1``) makes that rounding unbiased; this
  backend sets it and refuses an explicit ``0``. With ZeRO-1 the optimizer keeps an fp32
  copy of its own shard (``optimizer_dtype=float32``), i.e. bf16 compute with sharded fp32
  master weights - the usual large-model recipe on Trainium.

In every mode the linear self-attention's matmuls and normaliser run in fp32, as NVlabs Sana
trains: the model's processor (training/model/attention.py) disables ``torch.autocast("xla")``
around them and casts q/k/v to fp32 (tests/xla/test_numerics_xla.py), and the timestep stays
fp32 in pure bf16 (``_cast_floats_to_bf16``). ZeRO-1 (with AdamW or CAME) reduce-scatters
the gradients in fp32 whatever the weights' dtype: training/backends/neuron_zero1.py.

The pieces around this class, each with one job:

- training/backends/neuron_runtime.py: the environment the runtime reads at start-up, what
  is installed, which accelerator a rank drives, the compile counters;
- training/backends/neuron_zero1.py: optimizer state before step 0, ZeRO-1 and its state in
  checkpoints;
- training/backends/neuron_config.py: the ``trainium:`` config section.

State dicts leave this backend as the GPU backend's do (training/optim/sharding.py): full,
CPU, name-keyed, complete on rank 0 and empty on the others; a device->host copy of every
tensor is made on rank 0 only, between ``barrier()`` fences (``xm.save`` would make one
CPU copy per rank and exhaust host RAM for 1.6B on 32 ranks).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from training.backends.base import Backend, Batch

# The precision modes and the pure-bf16 input rule are the GPU backend's, shared so the two
# cannot drift apart (gpu.py imports only torch, which this environment has).
from training.backends.gpu import PRECISIONS, _cast_floats_to_bf16
from training.backends.neuron_config import NeuronConfig
from training.backends.neuron_runtime import (
    apply_neuron_env,
    neuron_accelerator,
    neuron_status,
    xla_compile_stats,
)
from training.backends.neuron_zero1 import Zero1, init_adam_state
from training.errors import UserError
from training.optim.sharding import from_named_optimizer_state, to_named_optimizer_state

log = logging.getLogger(__name__)

class NeuronBackend(Backend):
    """torch-xla backend for NeuronCores (one process per core under torchrun)."""

    name = "trainium"

    def __init__(self, cfg: NeuronConfig, *, precision: str = "bf16-mixed") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision: {precision!r} is not one of {PRECISIONS}")
        self.cfg = cfg
        self.precision = precision
        self.device = torch.device("cpu")  # until init()
        self.neuron_available, self.neuron_note = False, "not initialised"
        self._owns_group = False
        self._host_group: Any = None  # gloo group for host-side agreement (see barrier)
        self._zero1: Zero1 | None = None  # when cfg.zero1: the ZeroRedundancyOptimizer and its state
        self.syncs = 0  # torch_xla.sync() calls made through sync(): one per optimizer step

    # ----- lifecycle ---------------------------------------------------------
    def init(self) -> None:
        apply_neuron_env(self.cfg, self.precision)
        self.neuron_available, self.neuron_note = neuron_status()
        log.info("trainium backend: %s", self.neuron_note)
        import torch_xla
        import torch_xla.runtime as xr

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist
            import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend

            if not dist.is_initialized():
                # torchrun's env (RANK, WORLD_SIZE, MASTER_ADDR) through the xla:// init method
                dist.init_process_group("xla", init_method="xla://")
                self._owns_group = True
            # Host-side agreement (barrier, broadcast_object, "does every rank have a state")
            # goes over gloo on the CPU, never through XLA: xm.rendezvous is an XLA all-gather
            # plus .item() (pytorch/xla v2.9 torch_xla/core/xla_model.py xla_rendezvous), i.e.
            # one more graph per payload size, and under neuron_parallel_compile's graph
            # extraction (NEURON_EXTRACT_GRAPHS_ONLY) its outputs are zeros, so a broadcast
            # would hand pickle.loads an empty payload. Same store as the default group.
            self._host_group = dist.new_group(backend="gloo")
        self.device = torch_xla.device()
        self.rank = xr.global_ordinal()
        self.world_size = xr.world_size()
        self.local_rank = xr.local_ordinal()
        launched = os.environ.get("WORLD_SIZE")
        if launched is not None and int(launched) != self.world_size:
            # e.g. a NEURON_RT_VISIBLE_CORES / --nproc_per_node mismatch: ranks would shard data
            # for one world size and reduce gradients over another.
            raise RuntimeError(f"torchrun started WORLD_SIZE={launched} processes but the XLA runtime sees "
                               f"{self.world_size} devices in total; check --nproc_per_node against "
                               "the NeuronCores per node (neuron-ls) and NEURON_RT_VISIBLE_CORES")

    def close(self) -> None:
        self._host_group = None
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self._owns_group = False

    # ----- model and optimizer ---------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        from training.model.activation_checkpointing import (
            apply_activation_checkpointing,
            mode_of,
            refuse_unsupported,
        )

        mode = mode_of(model)
        if mode != "none":
            # "selective" needs per-op eager dispatch (training/model/activation_checkpointing.py).
            refuse_unsupported(mode, ("none", "full", "every_n"), "trainium")
            # torch.utils.checkpoint fails on XLA ("module 'torch' has no attribute 'xla'");
            # torch_xla's version adds the optimization barrier that stops XLA's CSE from
            # undoing the recomputation.
            from torch_xla.utils.checkpoint import checkpoint

            apply_activation_checkpointing(model, mode, every_n=getattr(model, "_checkpoint_every_n", 1),
                                           checkpoint_fn=checkpoint)
        if self.precision == "bf16":
            model.to(torch.bfloat16)
            model.register_forward_pre_hook(_cast_floats_to_bf16, with_kwargs=True)
        model.to(self.device)
        if self.world_size > 1:
            # Same seed on every rank should already give the same init; broadcasting rank 0's
            # parameters makes it a guarantee (and covers a pretrained load on rank 0 only).
            import torch_xla
            import torch_xla.core.xla_model as xm

            xm.broadcast_master_param(model)
            torch_xla.sync()
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # no wrapper: the all-reduce is explicit in clip_and_step

    def build_optimizer(self, model: nn.Module, make: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        params = [p for p in self.unwrap(model).parameters() if p.requires_grad]
        optimizer = make(params)
        if not self.cfg.zero1:
            init_adam_state(optimizer)
            return optimizer
        self._zero1 = Zero1(optimizer, self.unwrap(model), bucket_mb=self.cfg.zero1_bucket_mb,
                            device=self.device, world_size=self.world_size)
        return self._zero1.optimizer

    def _zero1_of(self, optimizer: torch.optim.Optimizer) -> Zero1 | None:
        """The ZeRO-1 state when ``optimizer`` is the wrapper this backend built, else None."""
        return self._zero1 if self._zero1 is not None and optimizer is self._zero1.optimizer else None

    # ----- the step -----------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "bf16-mixed":
            return torch.autocast("xla", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        # See the module docstring for why this is not MpDeviceLoader.
        import torch_xla.core.xla_model as xm

        from training.data.input_pipeline import cast_text

        for batch in batches:
            # Captions reach the step graph as fp32 whatever data.text_dtype is (cast on the
            # host: the graph, and so the compile cache, stay the same).
            yield xm.send_cpu_data_to_device(cast_text(batch, torch.float32), self.device)

    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
                      ) -> torch.Tensor:
        limit = float(max_norm) if max_norm > 0 else float("inf")
        if self._zero1_of(optimizer) is not None:
            # The wrapper reduce-scatters the gradients, computes the global norm over the
            # shards (one extra all-reduce of a scalar), clips, steps and all-gathers weights.
            optimizer.max_norm = limit
            optimizer.step()
            return optimizer.grad_norm.float()
        import torch_xla.core.xla_model as xm

        xm.reduce_gradients(optimizer)  # all-reduce (mean) across ranks; no-op on one device
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads)
        if max_norm > 0:
            # On device: coefficient clamp, no host branch on the norm.
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        optimizer.step()
        return norm.float()

    def sync(self) -> None:
        import torch_xla

        torch_xla.sync()
        self.syncs += 1

    def on_host(self, fn: Callable[..., None], *tensors: torch.Tensor) -> None:
        """Defer ``fn`` to a step closure: it runs inside the NEXT ``torch_xla.sync()`` (the loop
        calls this right after a step's sync), i.e. after the following step's graph is already
        launched, so reading the values never makes the host wait for the device. The loop's
        closing ``barrier()`` runs the last one."""
        if self.cfg.precompile:
            # neuron_parallel_compile's graphs return zeros: reading them would log garbage
            # (or trip a NaN/divergence check); the step's graph is traced all the same.
            return
        import torch_xla.core.xla_model as xm

        def closure(*values: torch.Tensor) -> None:
            fn(*(float(v.detach().float().cpu()) for v in values))

        xm.add_step_closure(closure, args=tuple(t.detach() for t in tensors))

    # ----- collectives / state ------------------------------------------------
    def barrier(self) -> None:
        import torch_xla

        torch_xla.sync()  # pending device work is launched before anyone passes the barrier
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self._host_group)

    def broadcast_object(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self._host_group)
        return box[0]

    def agree_max_async(self, value: int) -> Callable[[], int]:
        if self.world_size == 1:
            return lambda: value
        from training.backends.base import gloo_max_async

        return gloo_max_async(value, self._host_group)  # gloo on the host: no XLA graph, no sync

    def _flush(self) -> None:
        """Materialise pending work before reading tensors (not counted as a step sync)."""
        import torch_xla

        torch_xla.sync()

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        inner = self.unwrap(model)
        self.barrier()
        masters = (self._zero1.gathered_masters(inner, is_main=self.is_main)
                   if self._zero1 is not None and self.precision == "bf16" else {})
        state: dict[str, torch.Tensor] = {}
        if self.is_main:
            state = {k: masters[k] if k in masters else v.detach().cpu().clone()
                     for k, v in inner.state_dict().items()}
        self.barrier()
        return state

    def _all_ranks_have(self, state: Mapping[str, Any]) -> bool:
        """True when every rank was handed a non-empty state (the Checkpointer reads the files on
        every rank; a caller may also hand the full state to rank 0 only, as on the GPU backend)."""
        if self.world_size == 1:
            return True
        import torch.distributed as dist

        flags: list[Any] = [None] * self.world_size
        dist.all_gather_object(flags, bool(state), group=self._host_group)
        return all(flags)

    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        inner = self.unwrap(model)
        everyone = self._all_ranks_have(state)
        if everyone or self.is_main:
            own = inner.state_dict(keep_vars=True)  # the Parameter/buffer objects themselves
            missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            if missing or unexpected:
                raise UserError(f"model state: does not match this model (missing {missing[:3]}, "
                                f"unexpected {unexpected[:3]}); resume with the same model preset/overrides")
            with torch.no_grad():
                for name, tensor in own.items():
                    # Swap the device data instead of copy_(): a copy would be an op traced into
                    # the first training step's graph, i.e. one more compile of a one-off graph.
                    tensor.data = state[name].to(dtype=tensor.dtype).to(self.device)
        if not everyone:
            import torch_xla.core.xla_model as xm

            xm.broadcast_master_param(inner)  # rank 0's weights to every rank, on device
            self._flush()
            state = {k: v.detach().cpu() for k, v in inner.state_dict().items()} if self._zero1 is not None else {}
        if self._zero1 is not None and self._zero1.model is inner:
            self._zero1.reshard(inner, state)
        self._flush()

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        inner = self.unwrap(model)
        self.barrier()
        zero1 = self._zero1_of(optimizer)
        if zero1 is None:
            out = to_named_optimizer_state(inner, optimizer) if self.is_main else {}
        else:  # every shard's state gathered into full tensors (collective), kept on rank 0
            out = zero1.gathered_state(inner, is_main=self.is_main)
        self.barrier()
        return out

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, Any]) -> None:
        inner = self.unwrap(model)
        if not self._all_ranks_have(state):
            # Pickled through a rendezvous: fine for tests, slow for 1.6B (the Checkpointer
            # hands every rank the full state, so training never takes this path).
            state = self.broadcast_object(dict(state) if self.is_main else None)
        zero1 = self._zero1_of(optimizer)
        if zero1 is None:
            from_named_optimizer_state(inner, optimizer, state)
            init_adam_state(optimizer)  # parameters the checkpoint had no state for
            self._flush()
            return
        zero1.load_full_state(inner, state)

    # Sharded checkpoints (training/checkpoint/sharded.py): under ZeRO-1 each rank writes its
    # own optimizer shard, never all-gathered (training/backends/neuron_zero1.py).
    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        zero1 = self._zero1_of(optimizer)
        if zero1 is None:
            return super().sharded_state(model, optimizer)
        return zero1.sharded_state(self.unwrap(model), rank=self.rank, master_weights=self.precision == "bf16")

    def load_sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, read: Any, *,
                           keys: set[str], values: Mapping[str, Any], param_groups: list[dict[str, Any]]) -> None:
        inner = self.unwrap(model)
        zero1 = self._zero1_of(optimizer)
        if zero1 is None:
            # Every rank holds everything without ZeRO-1: read it all and load it the usual way
            # (``.data`` swaps, no copy traced into the next step's graph).
            from training.optim.sharding import full_from_reader

            model_sd, optim_sd = full_from_reader(read, keys, values, param_groups)
            self.load_model_state_dict(model, model_sd)
            self.load_optimizer_state_dict(model, optimizer, optim_sd)
            return
        zero1.load_sharded_state(inner, read, rank=self.rank, keys=keys, values=values, param_groups=param_groups)

    def rng_state(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        return {"xla_seed": int(xm.get_rng_state())}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        if "xla_seed" in state:
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(int(state["xla_seed"]))

    def peak_memory_bytes(self) -> int | None:
        try:
            import torch_xla.core.xla_model as xm

            info = xm.get_memory_info(self.device)
        except Exception:  # PJRT CPU and older runtimes do not report memory
            return None
        peak = info.get("peak_bytes_used") or info.get("bytes_used")
        return int(peak) if peak is not None else None

    # ----- observability ------------------------------------------------------
    def compile_stats(self) -> dict[str, Any]:
        """XLA compile, execution and transfer counts so far in this process, and this
        backend's step syncs (training/backends/neuron_runtime.py ``xla_compile_stats``)."""
        return xla_compile_stats(self.syncs)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {**super().describe(), "precision": self.precision,
                                "zero1": self.cfg.zero1, "torch": torch.__version__,
                                "neuron": self.neuron_available, "neuron_note": self.neuron_note,
                                "per_node": int(os.environ.get("LOCAL_WORLD_SIZE", 1))}
        try:
            import torch_xla
            import torch_xla.runtime as xr

            info["torch_xla"] = torch_xla.__version__
            info["pjrt_device"] = xr.device_type()
            info["accelerator"] = (neuron_accelerator() if xr.device_type() == "NEURON"
                                   else f"xla-{xr.device_type().lower()}")
        except ImportError:
            pass
        if self.device.type == "xla":
            info["compile"] = self.compile_stats()
        return info
