"""CUDA (and CPU) backend: torch.distributed with NCCL on GPUs, gloo on CPU.

Data parallelism is DDP by default; FSDP2 (``fully_shard`` per transformer block, then the
root) shards parameters, gradients and AdamW state for the 1.6B model, whose fp32 AdamW
state alone (~19 GiB) plus activations crowds an 80 GiB H100 under DDP.

Precision modes (TrainConfig.precision):
- ``fp32``: fp32 everywhere (TF32 matmuls on Ampere+ when ``gpu.tf32``).
- ``bf16-mixed``: fp32 master weights and optimizer state, bf16 compute via autocast
  (under FSDP too: its units gather fp32 parameters and cast no forward inputs, so FSDP
  computes exactly what DDP + autocast does; see ``_fully_shard``). What stays fp32 as in NVlabs Sana: the linear self-attention's
  matmuls and normaliser (training/model/attention.py), the timestep and its sinusoidal embedding,
  the adaLN modulation and residual stream, autocast's fp32 ops (norms, softmax), the loss.
- ``bf16``: refused here (``UserError``), on purpose. Pure bf16 weights and AdamW state
  with round-to-nearest lose every update below half a bf16 ulp (a norm weight at 1.0
  with lr 1e-4 never moves); Trainium makes that rounding unbiased with the runtime's
  stochastic rounding (training/backends/neuron_runtime.py), CUDA has no such switch. The fix, fp32
  master weights behind the bf16 model, *is* ``bf16-mixed`` with an extra bf16 copy: on
  GPU it would cost more memory than ``bf16-mixed`` (2 + 4 + 8 vs 4 + 8 bytes/parameter;
  FSDP's bf16 ``param_dtype`` already gathers and computes in bf16), so there is nothing
  to gain from a master-weight optimizer wrapper and one line names the mode to use.

State dicts leave this backend full, on CPU and name-keyed (training/optim/sharding.py);
they are complete on rank 0 and may be empty on other ranks (rank 0 writes checkpoints).
Loading accepts a full state on rank 0 and anything (e.g. ``{}``) elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.backends.base import Backend, Batch
from training.errors import UserError
from training.optim.sharding import from_named_optimizer_state, to_named_optimizer_state

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
DISTRIBUTED = ("ddp", "fsdp", "hsdp")
COMPILE_BACKENDS = ("inductor", "aot_eager")
#: the one line a GPU run with ``precision: bf16`` fails with (see the module docstring)
GPU_BF16_REFUSED = ("precision: 'bf16' (pure bf16 weights and AdamW state) is refused on the GPU backend: "
                    "without stochastic rounding updates below half a bf16 ulp are lost; use "
                    "precision: bf16-mixed (fp32 master weights, bf16 compute)")


@dataclasses.dataclass(kw_only=True)
class GpuConfig:
    """GPU-backend options (section ``gpu`` of the training config)."""

    #: "ddp" (replicated weights; 600M), "fsdp" (FSDP2 fully_shard over all ranks) or "hsdp"
    #: (FSDP2 on a 2-D mesh: shard within a group of ``shard_group_size`` ranks - a node -,
    #: replicate across groups; 1.6B on many nodes: only the gradient all-reduce crosses nodes)
    distributed: str = "ddp"
    #: hsdp: ranks per shard group; 0 = LOCAL_WORLD_SIZE (the GPUs of one node)
    shard_group_size: int = 0
    #: ddp: "bf16" all-reduces gradients in bf16 (torch's bf16_compress_hook: half the bytes,
    #: fp32 gradients again after the reduce) or "none" (fp32 all-reduce)
    ddp_grad_compression: str = "none"
    #: torch.compile each transformer block before wrapping (training/model/compile.py; first step
    #: compiles, later runs load kernels from ``compile_cache_dir``)
    compile: bool = False
    #: torch.compile backend: "inductor" (generated kernels; what training uses) or
    #: "aot_eager" (dynamo + AOTAutograd without code generation: the same graphs, breaks and
    #: recompiles in seconds on a CPU; gpu-check's dry run and tests)
    compile_backend: str = "inductor"
    #: inductor cache directory (per user; on FSx so every node and restart reuses it);
    #: skipped when the FSx root ($SANA_FSX, else /fsx) does not exist; "" = torch's default
    compile_cache_dir: str = "${SANA_FSX:-/fsx}/cache/inductor/${USER}"
    #: TF32 tensor-core matmuls for fp32 ops (Ampere+); no effect on CPU. This includes the
    #: fp32 linear attention (training/model/attention.py): NVlabs Sana never enables TF32, so the
    #: presets set false and those matmuls stay IEEE fp32 as in Sana
    tf32: bool = True
    #: FSDP2: keep parameters unsharded after forward (faster backward, more memory)
    fsdp_reshard_after_forward: bool = True
    #: read one batch ahead and copy it on a side CUDA stream while the step runs
    #: (training/data/input_pipeline.py): "auto" = on CUDA; "on" also on CPU (the read-ahead alone,
    #: for tests of the resume position); "off" = copy each batch when the step asks for it
    device_prefetch: str = "auto"
    #: before step 0, estimate memory per GPU (training/perf/memory.py) and refuse a config that
    #: cannot fit, naming the knob: "auto" = on CUDA (a CPU run has no device memory to
    #: protect, and the estimate costs seconds), "on" = always (80 GB assumed off CUDA), "off"
    memory_check: str = "auto"
    #: process-group timeout in minutes (large checkpoints and S3 waits need slack)
    timeout_minutes: int = 30

    def __post_init__(self) -> None:
        if self.distributed not in DISTRIBUTED:
            raise ValueError(f"gpu.distributed: {self.distributed!r} is not one of {', '.join(DISTRIBUTED)}")
        if self.shard_group_size < 0:
            raise ValueError("gpu.shard_group_size: must be >= 0 (0 = GPUs per node)")
        if self.ddp_grad_compression not in ("none", "bf16"):
            raise ValueError(f"gpu.ddp_grad_compression: {self.ddp_grad_compression!r} is not one of none, bf16")
        if self.timeout_minutes <= 0:
            raise ValueError("gpu.timeout_minutes: must be > 0")
        if self.memory_check not in ("auto", "on", "off"):
            raise ValueError(f"gpu.memory_check: {self.memory_check!r} is not one of auto, on, off")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"gpu.compile_backend: {self.compile_backend!r} is not one of {', '.join(COMPILE_BACKENDS)}")
        if self.device_prefetch not in ("auto", "on", "off"):
            raise ValueError(f"gpu.device_prefetch: {self.device_prefetch!r} is not one of auto, on, off")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cast_floats_to_bf16(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook casting the float inputs to bf16 - except the timestep, which stays
    fp32: bf16 resolves only ~4 units near t=1000, and the sinusoidal projection (diffusers
    ``Timesteps``; Sana's ``TimestepEmbedder.timestep_embedding`` computes ``t.float()``) must
    see the exact value; the embedding casts its output to the compute dtype itself.
    Used for pure-bf16 models (Trainium's precision "bf16")."""
    def cast(name: str, v: Any) -> Any:
        if torch.is_tensor(v) and v.is_floating_point() and name != "timestep":
            return v.to(torch.bfloat16)
        return v
    return tuple(cast("", a) for a in args), {k: cast(k, v) for k, v in kwargs.items()}


def _bf16_compress_hook(device: torch.device) -> Callable[..., Any]:
    """DDP comm hook all-reducing gradient buckets in bf16: each bucket is cast to bf16 and
    divided by the world size, all-reduced, and copied back into the fp32 bucket
    (https://docs.pytorch.org/docs/stable/ddp_comm_hooks.html ``bf16_compress_hook``).

    On CUDA that is torch's ``bf16_compress_hook``. DDP refuses it by name without NCCL
    ("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+"), so gloo (CPU
    tests) gets the function it is a one-line wrapper of, ``_compress_hook(torch.bfloat16, ...)``
    (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py): the same arithmetic.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if device.type == "cuda":
        return default_hooks.bf16_compress_hook

    # Unannotated on purpose: DDP checks a hook's annotations against dist.GradBucket, and
    # this module's postponed (string) annotations would not compare equal.
    def gloo_bf16_compress_hook(process_group, bucket):  # type: ignore[no-untyped-def]
        return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)

    return gloo_bf16_compress_hook


def _output_not_a_view(module: nn.Module, args: tuple, output: Any) -> Any:
    """Forward hook on the FSDP root: a ``sample`` that is a view becomes its own tensor.

    diffusers' ``SanaTransformer2DModel.forward`` unpatchifies with ``permute`` + ``reshape``,
    which for patch_size 1 returns a (channels-last) view. FSDP2 registers its pre-backward
    hook on the root's output, and an in-place op on a view would silently drop it
    (torch/distributed/fsdp/_fully_shard/_fsdp_state.py ``_register_pre_backward_hook``
    warns "returned a view tensor"). Nothing here modifies the output in place; the copy
    (B x C x H x W, ~1 MB for 1.6B at batch 8) makes that safe for any caller and silences
    the warning.
    """
    sample = getattr(output, "sample", output[0] if isinstance(output, tuple) else output)
    if not torch.is_tensor(sample) or sample._base is None:
        return output
    sample = sample.clone(memory_format=torch.contiguous_format)
    if isinstance(output, tuple):
        return (sample, *output[1:])
    if hasattr(output, "sample"):
        output.sample = sample
        return output
    return sample


def accelerator_key(device_name: str, memory_bytes: int) -> str:
    """torch's device name -> the training.model.flops accelerator key (its MFU peak), else the name.
    The table of names and peaks is training/model/flops.py's (``DEVICE_NAMES``, ``ACCELERATORS``)."""
    from training.model.flops import accelerator_for_device

    return accelerator_for_device(device_name, memory_bytes)


class GpuBackend(Backend):
    """torch.distributed backend for CUDA devices, or CPU processes in tests and the demo."""

    name = "gpu"
    trims_text = True  # eager / torch.compile: a few caption lengths are a few shapes

    def __init__(self, cfg: GpuConfig, *, precision: str = "bf16-mixed") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision: {precision!r} is not one of {PRECISIONS}")
        if precision == "bf16":
            raise UserError(GPU_BF16_REFUSED)
        self.cfg = cfg
        self.precision = precision
        self.device = torch.device("cpu")
        self._ddp: nn.Module | None = None
        self._fsdp_root: nn.Module | None = None
        self.mesh: Any = None  # the FSDP/HSDP DeviceMesh (None under DDP)
        self._owns_group = False
        self._host_group: Any = None  # gloo group for host-side agreement on CUDA (agree_max_async)
        self._threads_before: int | None = None  # torch's intra-op threads before init (restored by close)
        self._last_step_event: torch.cuda.Event | None = None

    # ----- lifecycle ---------------------------------------------------------
    def init(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            # "high" = TF32 tensor cores for fp32 matmuls (cuDNN convs use TF32 by default).
            torch.set_float32_matmul_precision("high" if self.cfg.tf32 else "highest")
        elif "OMP_NUM_THREADS" not in os.environ:
            # CPU runs are tests and the demo on tiny models: intra-op threads cost far more
            # than they give there (measured 15x slower with 2 threads on 2 busy cores).
            # OMP_NUM_THREADS overrides. A process-wide setting: close() puts it back. (On CPU
            # the thread count is part of the numerics: a run resumed with another count is not
            # bit-identical; describe() records it, a resume warns when it differs.)
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(1)
        needs_group = self.world_size > 1 or self.cfg.distributed != "ddp"
        if needs_group and not dist.is_initialized():
            kw: dict[str, Any] = {}
            if "MASTER_ADDR" not in os.environ:  # a lone process (FSDP on one device)
                kw = dict(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
            if self.device.type == "cuda":
                kw["device_id"] = self.device
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(minutes=self.cfg.timeout_minutes), **kw)
            self._owns_group = True
        if self.world_size > 1 and self.device.type == "cuda":
            # The stop-signal exchange runs on the host every step; over NCCL it would be a
            # device collective the host waits for. The CPU default group is gloo already.
            self._host_group = dist.new_group(backend="gloo")

    def close(self) -> None:
        self._host_group = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    # ----- model and optimizer ---------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Activation checkpointing (set by build_model) -> per-block compile -> FSDP/HSDP or
        DDP: torchtitan's order (parallelize.py: "turn on per-TransformerBlock compile after
        AC wrapping and before FSDP")."""
        model.to(self.device)
        if self.cfg.compile:
            from training.model.compile import compile_blocks, configure_cache

            configure_cache(self.cfg.compile_cache_dir)
            compile_blocks(model, backend=self.cfg.compile_backend)
        if self.cfg.distributed in ("fsdp", "hsdp"):
            model = self._fully_shard(model)
        elif self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            # gradient_as_bucket_view: gradients are views into DDP's all-reduce buckets, not a
            # second copy (~2.4 GB fp32 for 600M) that each backward copies into and out of
            # (https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html);
            # the loop sets gradients to None each step, which DDP supports with bucket views.
            model = self._ddp = DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True)
            if self.cfg.ddp_grad_compression == "bf16":
                model.register_comm_hook(None, _bf16_compress_hook(self.device))
        return model

    def shard_group_size(self) -> int:
        """Ranks per HSDP shard group (gpu.shard_group_size, else the ranks of one node)."""
        size = self.cfg.shard_group_size or int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if size < 1 or self.world_size % size:
            raise UserError(f"gpu.shard_group_size: {size} does not divide the world size {self.world_size}; "
                            "set it to the GPUs per node (or a divisor of the world size)")
        return size

    def build_mesh(self) -> Any:
        """1-D mesh over all ranks (fsdp) or the 2-D ("replicate", "shard") mesh (hsdp).

        ``fully_shard(mesh=2-D)`` is HSDP: "parameters are sharded across the 1st dim and
        replicated across the 0th dim" (https://docs.pytorch.org/docs/stable/distributed.fsdp
        .fully_shard.html, ``mesh``); init_device_mesh lays ranks out row-major, so shard
        groups are consecutive ranks - one node under torchrun's rank order.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if self.cfg.distributed == "hsdp":
            shard = self.shard_group_size()
            return init_device_mesh(self.device.type, (self.world_size // shard, shard),
                                    mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("shard",))

    def _fully_shard(self, model: nn.Module) -> nn.Module:
        """FSDP2 over ``build_mesh()``: one unit per transformer block, then the root.

        torchtitan's layout (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``: one
        ``fully_shard`` per TransformerBlock, after AC and per-block compile): a block's
        all-gather / reduce-scatter hooks run on ``block.__call__``, around its compiled
        forward, so nothing inside a compiled block calls into FSDP. FSDP2 runs its hooks
        with dynamo disabled (torch/distributed/fsdp/_fully_shard/_fsdp_common.py
        ``_dynamo_disable``): a unit nested inside a block would put a graph break inside
        the block's forward, and with activation checkpointing that break falls inside the
        checkpoint region, where dynamo cannot resume, so the whole block ran eagerly
        (tests/training/model/test_compile.py counts the graphs).

        Precision: every unit keeps its parameters in fp32 (no ``param_dtype``) and casts no
        forward inputs (``cast_forward_inputs=False``); in ``bf16-mixed`` autocast casts each
        op's inputs exactly as under DDP, so the timestep reaches its sinusoidal embedding in
        fp32 and the adaLN scale-shift tables and the residual stream stay fp32
        (benchmarks/bf16_numerics.py measured what bf16 copies of them cost). The price, on
        purpose: a block's all-gather moves fp32 (4 bytes per parameter instead of 2 with a
        bf16 ``param_dtype``); it overlaps the previous block's compute (FSDP2 prefetches one
        unit ahead), and under HSDP it stays on NVLink inside a node. A bf16 ``param_dtype``
        would need the tables in their own fp32 unit, i.e. nested units again.
        https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (MixedPrecisionPolicy)
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.mesh = self.build_mesh()
        kw = dict(mesh=mesh, reshard_after_forward=self.cfg.fsdp_reshard_after_forward,
                  mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False))
        for block in getattr(model, "transformer_blocks", []):
            fully_shard(block, **kw)
        # before the root's fully_shard, so it runs before FSDP's post-forward hook
        model.register_forward_hook(_output_not_a_view)
        fully_shard(model, **kw)
        self._fsdp_root = model
        return model

    def compile_stats(self) -> dict[str, Any] | None:
        """dynamo's counts so far (training/model/compile.py ``compile_stats``), None when
        ``gpu.compile`` is off (nothing is compiled, so nothing to count)."""
        if not self.cfg.compile:
            return None
        from training.model.compile import compile_stats

        return compile_stats()

    def unwrap(self, model: nn.Module) -> nn.Module:
        model = getattr(model, "_orig_mod", model)  # torch.compile
        return getattr(model, "module", model)  # DDP (FSDP2 shards in place)

    def build_optimizer(self, model: nn.Module, make: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
                        ) -> torch.optim.Optimizer:
        return make([p for p in self.unwrap(model).parameters() if p.requires_grad])

    # ----- the step -----------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision == "bf16-mixed":
            # cache_enabled=False: autocast's cache would keep the bf16 cast of every weight
            # used in the forward alive until the context exits; under FSDP those are the
            # gathered blocks, i.e. a bf16 copy of the whole model per rank (3.2 GB for 1.6B)
            # that resharding cannot free. Each weight is used once per forward, so no cast is
            # repeated; compiled blocks cast inside their graphs either way.
            return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _fsdp_no_sync(self, root: nn.Module) -> Iterator[None]:
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        if self._ddp is not None:
            return self._ddp.no_sync()
        if self._fsdp_root is not None and self.world_size > 1:
            return self._fsdp_no_sync(self._fsdp_root)
        return contextlib.nullcontext()

    def device_batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """One batch ahead on a side stream (training/data/input_pipeline.py); captions travel in
        their host dtype (bf16 when the loader keeps the stored dtype) and reach the step as
        fp32, as before. NOTE: reading ahead moves the loader past the batch in use; the loop
        checkpoints ``LoaderPosition`` (the position after the last batch a step used)."""
        from training.data.input_pipeline import StreamCopy, cast_text, read_ahead

        cuda = self.device.type == "cuda"
        ahead = self.cfg.device_prefetch == "on" or (self.cfg.device_prefetch == "auto" and cuda)
        if ahead and cuda:
            copy = StreamCopy(self.device, text_dtype=torch.float32)
            yield from read_ahead(batches, copy.start, copy.finish)
        elif ahead:
            yield from read_ahead(batches, lambda b: b, lambda b: cast_text(b, torch.float32))
        else:
            for batch in batches:
                yield cast_text({k: (v.pin_memory().to(self.device, non_blocking=True) if cuda else v)
                                 for k, v in batch.items()}, torch.float32)

    def sync(self) -> None:
        """Let the host run at most one optimizer step ahead of the GPU.

        Eager CUDA queues kernels asynchronously; without a bound the host races several
        steps ahead and only stalls at the next loss read, so per-step host times (bench's
        p50/p90) would be meaningless. Waiting for the *previous* step's event keeps the
        queue one step deep: the GPU never idles and step times equal device step times.
        """
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        if self._last_step_event is not None:
            self._last_step_event.synchronize()
        self._last_step_event = event

    def clip_and_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
                      ) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # FSDP2: DTensor norm over the shards
            norm = norm.full_tensor()
        optimizer.step()
        return norm.float()

    # ----- collectives / state ------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return dist.is_initialized() and self.world_size > 1

    def barrier(self) -> None:
        if self._distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree_max_async(self, value: int) -> Callable[[], int]:
        if not self._distributed:
            return lambda: value
        from training.backends.base import gloo_max_async

        return gloo_max_async(value, self._host_group)

    def _all_have(self, state: Mapping[str, Any]) -> bool:
        """True when every rank was handed a non-empty state (else rank 0's is broadcast)."""
        flag = torch.tensor([1 if len(state) else 0], device=self.device)
        if self._distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _full_options(self, **kw: Any):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **kw)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self._fsdp_root is not None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.unwrap(model), options=self._full_options(cpu_offload=True))
        if not self.is_main:
            return {}
        return {k: v.detach().cpu().clone() for k, v in self.unwrap(model).state_dict().items()}

    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
        inner = self.unwrap(model)
        if self._fsdp_root is not None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(inner, dict(state), options=self._full_options(broadcast_from_rank0=True))
            return
        if self._all_have(state):
            inner.load_state_dict(state)
            return
        if self.is_main:
            inner.load_state_dict(state)
        for t in inner.state_dict().values():
            dist.broadcast(t, src=0)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._fsdp_root is not None:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.unwrap(model), optimizer,
                                            options=self._full_options(cpu_offload=True))
        if not self.is_main:
            return {}
        return to_named_optimizer_state(self.unwrap(model), optimizer)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: Mapping[str, Any]) -> None:
        if self._fsdp_root is not None:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self.unwrap(model), optimizer, dict(state),
                                     options=self._full_options(broadcast_from_rank0=True))
            return
        if not self._all_have(state):
            state = self.broadcast_object(state if self.is_main else None)
        from_named_optimizer_state(self.unwrap(model), optimizer, state)

    def rng_state(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            return {"cuda": torch.cuda.get_rng_state(self.device)}
        return {}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def peak_memory_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None

    def describe(self) -> dict[str, Any]:
        cuda = self.device.type == "cuda"
        name = torch.cuda.get_device_name(self.device) if cuda else "cpu"
        return {
            **super().describe(),
            "accelerator": accelerator_key(name, torch.cuda.get_device_properties(self.device).total_memory
                                           if cuda else 0),
            "device_name": name,
            "per_node": int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            "precision": self.precision,
            "distributed": self.cfg.distributed,
            "mesh": None if self.mesh is None else dict(zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True)),
            "ddp_grad_compression": self.cfg.ddp_grad_compression,
            "compile": self.cfg.compile,
            # CPU: the intra-op thread count changes reduction order, i.e. the bits
            **({} if cuda else {"intra_op_threads": torch.get_num_threads()}),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        }
