"""Configuration of the Trainium (torch-xla / Neuron) backend.

Kept free of any ``torch_xla`` import so ``training/config.py`` can compose it (as the
``trainium`` section of TrainConfig) in the GPU environment, where torch-xla is absent.
The precision mode itself ("fp32" | "bf16-mixed" | "bf16") is the shared top-level
``TrainConfig.precision``; this section only holds what is Trainium-specific.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(kw_only=True)
class NeuronConfig:
    """The ``trainium:`` section of a training config."""

    #: Shard AdamW state (and, with bf16 weights, the fp32 master copy) across data-parallel
    #: ranks with torch_xla's ZeroRedundancyOptimizer (ZeRO-1). Needed for 1.6B on 16 GiB
    #: NeuronCore-v2s: fp32 weights + AdamW moments are 19 GB there.
    zero1: bool = False
    #: Persistent compile cache: an absolute path (on /fsx so every node shares it) or an
    #: s3:// prefix. Exported as NEURON_COMPILE_CACHE_URL before the first graph compiles.
    #: None keeps the Neuron default (/var/tmp/neuron-compile-cache, per node, lost on
    #: node replacement).
    compile_cache_url: str | None = None
    #: Precompile mode (run under ``neuron_parallel_compile``): run ``precompile_steps``
    #: optimizer steps so every graph of the run is traced and compiled, write no
    #: checkpoints, and never read tensor values (the tool's graphs return zeros).
    precompile: bool = False
    #: Steps traced in precompile mode. Three covers the distinct graphs: step 0 (no
    #: optimizer state yet), step 1 (AdamW state exists) and one steady step.
    precompile_steps: int = 3
    #: In precision "bf16" (pure bf16 weights) require stochastic rounding in the Neuron
    #: runtime (NEURON_RT_STOCHASTIC_ROUNDING_EN=1). The backend sets it when unset and
    #: refuses an explicit 0, because round-to-nearest bf16 updates silently stall
    #: training (small updates round back to the old weight).
    stochastic_rounding: bool = True
    #: Extra neuronx-cc flags appended to NEURON_CC_FLAGS. "--model-type=transformer"
    #: enables the compiler's transformer-specific scheduling for this DiT;
    #: "--retry_failed_compilation" recompiles a graph whose cache entry records a failure
    #: instead of failing on it (a compile killed with its job, on the shared cache, would
    #: otherwise fail every later job): both as the Neuron training samples set them
    #: (aws-neuron/aws-neuron-samples torch-neuronx/training scripts' NEURON_CC_FLAGS).
    cc_flags: str = "--model-type=transformer --retry_failed_compilation"
    #: Gradient all-reduce bucket size in MiB (0 = one all-reduce over all grads). Always
    #: exported as ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB, which xm.reduce_gradients reads: left
    #: unset, torch-xla itself sets 50 on Neuron (pytorch/xla v2.9 torch_xla/_internal/
    #: neuron.py set_envvar_defaults, a setdefault), so "0" would not mean what it says.
    allreduce_bucket_mb: int = 50
    #: ZeRO-1 reduce-scatter and all-gather bucket size in MiB (0 = one collective per
    #: parameter): ZeroRedundancyOptimizer's bucket_cap_mb_reduce_scatter/_all_gather.
    zero1_bucket_mb: int = 50

    def __post_init__(self) -> None:
        url = self.compile_cache_url
        if url is not None and not (url.startswith("s3://") or os.path.isabs(url)):
            raise ValueError(f"trainium.compile_cache_url: {url!r} is neither an absolute path nor an "
                             "s3:// prefix; use e.g. /fsx/neuron-cache or s3://bucket/neuron-cache")
        if url is not None and url.startswith("s3://") and len(url) <= len("s3://"):
            raise ValueError("trainium.compile_cache_url: 's3://' names no bucket; use s3://bucket/prefix")
        if self.precompile_steps < 1:
            raise ValueError(f"trainium.precompile_steps: {self.precompile_steps} < 1; it must trace at "
                             "least one step (3 covers warm-up and steady graphs)")
        if self.zero1_bucket_mb < 0:
            raise ValueError(f"trainium.zero1_bucket_mb: {self.zero1_bucket_mb} < 0; use 0 "
                             "(one collective per parameter) or a size in MiB")
        if self.allreduce_bucket_mb < 0:
            raise ValueError(f"trainium.allreduce_bucket_mb: {self.allreduce_bucket_mb} < 0; use 0 "
                             "(single all-reduce) or a size in MiB")
