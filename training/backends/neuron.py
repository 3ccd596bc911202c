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
fp32 in pure bf16 (``_cast_floats_to_bf16``). CAME (``optim.name: came``, NVlabs Sana's
optimizer) runs with ZeRO-1 too: its factored statistics shard by rows, and the sums over
rows it needs are all-reduced over the ZeRO group (training/optim/came.py ``CAME.shard``). ZeRO-1
reduce-scatters the gradients in fp32 (``higher_cc_precision``), whatever the weights' dtype:
a bf16 sum over 32+ ranks loses the low bits of every gradient, where Sana's GPU training
all-reduces fp32 gradients (its AMP keeps fp32 master weights).

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
from training.errors import UserError
from training.optim.sharding import (
    from_named_optimizer_state,
    param_names,
    to_named_optimizer_state,
    zero1_rows_of,
)

log = logging.getLogger(__name__)

#: set by the backend in precision "bf16"; see the module docstring
STOCHASTIC_ROUNDING_ENV = "NEURON_RT_STOCHASTIC_ROUNDING_EN"
COMPILE_CACHE_ENV = "NEURON_COMPILE_CACHE_URL"
NO_SPECIAL_SCALARS_ENV = "XLA_NO_SPECIAL_SCALARS"
ALLREDUCE_BUCKET_ENV = "ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB"


def neuron_status() -> tuple[bool, str]:
    """Whether the Neuron pieces (torch-neuronx, its compiler) are importable, and why not.

    They exist only on the Neuron pip repository (PyPI holds empty placeholders), so the
    CPU test path runs without them; the answer goes into ``describe()`` and the log.
    """
    try:
        import torch_neuronx  # noqa: F401
    except ImportError as exc:
        return False, (f"torch-neuronx not importable ({exc}); running torch-xla on PJRT_DEVICE="
                       f"{os.environ.get('PJRT_DEVICE', '<unset>')}. On a trn node install "
                       "training/requirements-neuron.txt with the Neuron pip index.")
    return True, "torch-neuronx " + getattr(torch_neuronx, "__version__", "?")


def neuron_accelerator(product_name: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """What one rank drives, named as in training/model/flops.py ACCELERATORS (for MFU).

    trn1/trn1n: a NeuronCore-v2. trn2: a logical NeuronCore of 2 physical v3 cores at the
    default NEURON_LOGICAL_NC_CONFIG=2 (one v3 core with 1). The instance family comes from
    the DMI product name EC2 exposes (e.g. "trn1.32xlarge").
    """
    env = os.environ if env is None else env
    if product_name is None:
        try:
            with open("/sys/devices/virtual/dmi/id/product_name") as fh:
                product_name = fh.read().strip()
        except OSError:
            product_name = ""
    if product_name.startswith("trn2") or product_name.startswith("trn3"):
        return "NeuronCore-v3-LNC2" if env.get("NEURON_LOGICAL_NC_CONFIG", "2") == "2" else "NeuronCore-v3"
    return "NeuronCore-v2"


def apply_neuron_env(cfg: NeuronConfig, precision: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the environment the Neuron runtime/compiler read at start-up; returns what it set.

    Must run before the first XLA device is created: the runtime reads these once.

    Args:
        cfg: the trainium section.
        precision: the run's precision mode.
        env: the environment to edit (``os.environ`` by default; tests pass a dict).
    """
    env = os.environ if env is None else env
    changed: dict[str, str] = {}

    def put(key: str, value: str) -> None:
        env[key] = value
        changed[key] = value

    if precision == "bf16" and cfg.stochastic_rounding:
        current = env.get(STOCHASTIC_ROUNDING_ENV)
        if current is None:
            put(STOCHASTIC_ROUNDING_ENV, "1")
        elif current != "1":
            raise UserError(f"{STOCHASTIC_ROUNDING_ENV}={current}: precision 'bf16' keeps bf16 weights and "
                            "needs stochastic rounding or small updates round away; unset it (the backend "
                            "sets 1), use precision 'bf16-mixed', or set trainium.stochastic_rounding=false")
    if NO_SPECIAL_SCALARS_ENV not in env:
        # torch-xla bakes the Python scalars 0 and 1 into the graph as constants (any other
        # value is a graph input). A learning rate that lands on exactly 0.0 (cosine at its end,
        # a resumed run whose max_steps changed, warm-up from 0) would compile a new graph
        # (minutes for 600M on Neuron). Measured in tests/xla/test_checkpoint_cross.py.
        put(NO_SPECIAL_SCALARS_ENV, "1")
    if cfg.compile_cache_url:
        put(COMPILE_CACHE_ENV, cfg.compile_cache_url)
    if cfg.cc_flags:
        flags = env.get("NEURON_CC_FLAGS", "")
        missing = [f for f in cfg.cc_flags.split() if f not in flags.split()]
        if missing:
            put("NEURON_CC_FLAGS", " ".join([*flags.split(), *missing]))
    # Always, 0 included: torch-xla's Neuron start-up only setdefault()s 50 (torch_xla/_internal/
    # neuron.py set_envvar_defaults), so an explicit value is the only way the config decides.
    put(ALLREDUCE_BUCKET_ENV, str(cfg.allreduce_bucket_mb))
    return changed


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW (or CAME) state now, as zeros on the device, exactly as its first
    step would.

    Without this, step 0 traces a different graph (it creates the moments) from every later
    step: two neuronx-cc compiles of the full training graph instead of one (minutes each for
    600M). Filling the state up front makes step 0 run the steady graph. Other optimizers are
    left alone (they compile twice, correctly).
    """
    from training.optim.came import CAME

    if isinstance(optimizer, CAME):
        optimizer.init_state()
        return
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam in torch >= 2.6
        return
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused"):
            return  # their step counter lives on the device: let torch create it
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            # Host zeros + one transfer: device data, not a traced fill op in the first graph.
            state = {"step": torch.tensor(0.0, dtype=scalar),
                     "exp_avg": torch.zeros(p.shape, dtype=p.dtype).to(p.device),
                     "exp_avg_sq": torch.zeros(p.shape, dtype=p.dtype).to(p.device)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=p.dtype).to(p.device)
            optimizer.state[p] = state


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
        self._zero: Any = None  # the ZeroRedundancyOptimizer, when cfg.zero1
        self._zero_model: nn.Module | None = None
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
        from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

        # ZeRO-1 takes an optimizer *class*; ``make`` gives an instance. Its param_groups carry
        # every hyper-parameter (lr, betas, eps, weight_decay, ...), so passing them as groups
        # rebuilds the same optimizer over the shards. It holds no state yet, so nothing is lost.
        # grad_clipping stays on so the wrapper computes the global norm over the reduced shards;
        # clip_and_step sets max_norm per call (inf = measure only).
        # Collectives as NxD configures its NeuronZero1Optimizer (a subclass of this one):
        # pin_layout=False (neuronx-distributed docs, api_guide "Neuron Zero1 Optimizer"), and
        # coalesced reduce-scatter / all-gather in trainium.zero1_bucket_mb buckets instead of
        # one collective per parameter (torch_xla zero_redundancy_optimizer.py: a cap > 0
        # turns on coalesce_cc_reduce_scatter / coalesce_cc_all_gather).
        # higher_cc_precision: the reduce-scatter runs in optimizer_dtype (fp32), not in the
        # gradients' bf16 (zero_redundancy_optimizer.py _reduce_gradients casts the padded
        # gradient before the collective); see the module docstring.
        bucket = self.cfg.zero1_bucket_mb
        zero = ZeroRedundancyOptimizer(
            [dict(group) for group in optimizer.param_groups], type(optimizer),
            optimizer_dtype=torch.float32, grad_clipping=True, max_norm=float("inf"),
            pin_layout=False, save_master_weights=False, higher_cc_precision=True,
            bucket_cap_mb_all_gather=bucket, bucket_cap_mb_reduce_scatter=bucket)
        self._zero, self._zero_model = zero, self.unwrap(model)
        from training.optim.came import CAME

        if isinstance(zero.base_optimizer, CAME):
            self._shard_came(zero)
        init_adam_state(zero.base_optimizer)
        return zero

    def _shard_came(self, zero: Any) -> None:
        """Tell ZeRO's base CAME which rows of which full parameter each shard holds (real-row
        masks as graph inputs) and how to sum over the ZeRO group: one all-reduce per phase."""
        import torch_xla.core.xla_model as xm

        from training.optim.came import flat_reduce, row_shards

        groups = zero.sharding_groups
        shards = row_shards(((param, shard) for _n, param, shard in self._zero_pairs(self._zero_model)),
                            zero._shard_tensor, self.device)
        zero.base_optimizer.shard(shards, flat_reduce(
            lambda flat: xm.all_reduce(xm.REDUCE_SUM, flat, groups=groups, pin_layout=False)))

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
        if optimizer is self._zero:
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
        masters = self._gathered_masters(inner) if self._zero is not None and self.precision == "bf16" else {}
        state: dict[str, torch.Tensor] = {}
        if self.is_main:
            state = {k: masters[k] if k in masters else v.detach().cpu().clone()
                     for k, v in inner.state_dict().items()}
        self.barrier()
        return state

    def _gathered_masters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """ZeRO-1 with bf16 weights keeps an fp32 master copy, sharded; a checkpoint gets that
        (full, on rank 0) instead of the bf16 weights, so a resume restores the master shards
        exactly (``_reshard_zero``) and a bf16 model loading it just casts. Collective."""
        import torch_xla.core.xla_model as xm

        pieces = [(name, param, xm.all_gather(shard.detach(), dim=0) if self.world_size > 1 else shard.detach())
                  for name, param, shard in self._zero_pairs(model)]
        self._flush()
        if not self.is_main:
            return {}
        # slice the zero-padding off on the host: a device slice would be one more graph
        return {name: full.cpu()[: param.shape[0]].clone() for name, param, full in pieces}

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
            state = {k: v.detach().cpu() for k, v in inner.state_dict().items()} if self._zero else {}
        if self._zero is not None and self._zero_model is inner:
            self._reshard_zero(inner, state)
        self._flush()

    # ZeRO-1: each rank's optimizer holds an fp32 shard (rows [r*n/N, (r+1)*n/N) of the
    # zero-padded first dimension) of every parameter, and AdamW state of that shard.
    def _zero_pairs(self, model: nn.Module) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        names = param_names(model)
        zero = self._zero
        return [(names[id(p)], p, s)
                for group, sgroup in zip(zero.param_groups, zero.base_optimizer.param_groups, strict=True)
                for p, s in zip(group["params"], sgroup["params"], strict=True)]

    def _reshard_zero(self, model: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
        """Refresh the optimizer's fp32 master shards from a loaded full state (else the next
        step would all-gather the stale shards over the loaded weights)."""
        for name, _param, shard in self._zero_pairs(model):
            piece = self._zero._shard_tensor(full[name].detach().to(torch.float32))
            shard.data = piece.to(self.device)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        inner = self.unwrap(model)
        self.barrier()
        if optimizer is not self._zero:
            out = to_named_optimizer_state(inner, optimizer) if self.is_main else {}
            self.barrier()
            return out
        import torch_xla.core.xla_model as xm

        # Gather every shard's state into full tensors (collective), then keep them on rank 0.
        base = self._zero.base_optimizer
        state: dict[str, dict[str, Any]] = {}
        for name, param, shard in self._zero_pairs(inner):
            entry = base.state.get(shard)
            if not entry:
                continue
            full_entry: dict[str, Any] = {}
            for key, value in entry.items():
                if zero1_rows_of(key, value):
                    gathered = xm.all_gather(value, dim=0) if self.world_size > 1 else value
                    value = gathered[: param.shape[0]]
                full_entry[key] = value
            state[name] = full_entry
        self._flush()
        out: dict[str, Any] = {}
        if self.is_main:
            names = param_names(inner)
            out = {"state": {n: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                 for k, v in e.items()} for n, e in state.items()},
                   "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                     "params": [names[id(p)] for p in g["params"]]}
                                    for g in self._zero.param_groups]}
        self.barrier()
        return out

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, Any]) -> None:
        inner = self.unwrap(model)
        if not self._all_ranks_have(state):
            # Pickled through a rendezvous: fine for tests, slow for 1.6B (the Checkpointer
            # hands every rank the full state, so training never takes this path).
            state = self.broadcast_object(dict(state) if self.is_main else None)
        if optimizer is not self._zero:
            from_named_optimizer_state(inner, optimizer, state)
            init_adam_state(optimizer)  # parameters the checkpoint had no state for
            self._flush()
            return
        # Hyper-parameters go to the wrapper (the scheduler drives its param_groups); each rank
        # slices its own rows of every full moment tensor into the base optimizer's state.
        zero = self._zero
        for group, saved in zip(zero.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        base = zero.base_optimizer
        for name, _param, shard in self._zero_pairs(inner):
            saved = state["state"].get(name)
            if not saved:
                continue
            entry: dict[str, Any] = {}
            for key, value in saved.items():
                if zero1_rows_of(key, value):
                    value = zero._shard_tensor(value.to(torch.float32)).to(self.device)
                elif torch.is_tensor(value) and value.dim() > 0:  # CAME's column statistics: whole
                    value = value.to(torch.float32).to(self.device)
                entry[key] = value
            base.state[shard] = entry
        init_adam_state(base)
        zero._sync_param_groups(zero.param_groups, base.param_groups)
        self._flush()

    # Sharded checkpoints (training/checkpoint/sharded.py): under ZeRO-1 each rank writes its
    # own optimizer shard, never all-gathered; the layout logic is in backends/state.py.
    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        if optimizer is not self._zero:
            return super().sharded_state(model, optimizer)
        from training.optim.sharding import zero1_sharded_state

        self._flush()  # materialise the step's pending updates before the host copies
        inner = self.unwrap(model)
        return zero1_sharded_state(self._zero_pairs(inner), self._zero.base_optimizer.state, inner,
                                   self._zero.param_groups, self.rank, self.world_size,
                                   master_weights=self.precision == "bf16")

    def load_sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, read: Any, *,
                           keys: set[str], values: Mapping[str, Any], param_groups: list[dict[str, Any]]) -> None:
        inner = self.unwrap(model)
        if optimizer is not self._zero:
            # Every rank holds everything without ZeRO-1: read it all and load it the usual way
            # (``.data`` swaps, no copy traced into the next step's graph).
            from training.optim.sharding import full_from_reader

            model_sd, optim_sd = full_from_reader(read, keys, values, param_groups)
            self.load_model_state_dict(model, model_sd)
            self.load_optimizer_state_dict(model, optimizer, optim_sd)
            return
        from training.optim.sharding import zero1_load_sharded_state

        zero = self._zero
        # Hyper-parameters from the checkpoint; the implementation keys (fused, foreach) stay this
        # process's: a GPU checkpoint saved with fused AdamW must not ask XLA for a fused kernel.
        from training.optim.factory import IMPLEMENTATION_KEYS

        for group, saved in zip(zero.param_groups, param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params" and k not in IMPLEMENTATION_KEYS})
        zero1_load_sharded_state(self._zero_pairs(inner), zero.base_optimizer.state, inner, read, self.rank,
                                 self.world_size, keys=keys, values=values, device=self.device)
        init_adam_state(zero.base_optimizer)
        zero._sync_param_groups(zero.param_groups, zero.base_optimizer.param_groups)
        self._flush()

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
        """XLA compile count/seconds and host transfers so far in this process.

        ``compiles`` counts graph compilations (on Neuron: neuronx-cc runs or compile-cache
        loads); a number that still grows after warm-up means a recompiling step.
        ``transfers_from_device`` counts device->host copies; ``local_scalar_dense`` counts
        ``.item()``-style reads (each one stalls the step it happens in).
        """
        import torch_xla.debug.metrics as met

        def metric(name: str) -> tuple[int, float]:
            data = met.metric_data(name)
            return (int(data[0]), float(data[1]) / 1e9) if data else (0, 0.0)

        compiles, compile_s = metric("CompileTime")
        # On-disk cache lookups by graph hash (torch-xla's persistent cache; on Neuron the
        # compile cache neuron_parallel_compile fills). A miss is a graph nobody compiled before.
        cache = {"persistent_cache_misses": int(met.counter_value("PersistentCacheMiss") or 0),
                 "persistent_cache_loads": int(met.metric_data("PersistentCacheLoad")[0])
                 if met.metric_data("PersistentCacheLoad") else 0}
        transfers, transfer_s = metric("TransferFromDeviceTime")
        executes, execute_s = metric("ExecuteTime")
        return {"compiles": compiles, "compile_seconds": round(compile_s, 3),
                "executions": executes, "execute_seconds": round(execute_s, 3),
                "transfers_from_device": transfers, "transfer_seconds": round(transfer_s, 3),
                "local_scalar_dense": int(met.counter_value("aten::_local_scalar_dense") or 0),
                "syncs": self.syncs, **cache}

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
