"""The Neuron runtime around the Trainium backend: what it must be told before start-up,
what is installed, which accelerator a rank drives, and what XLA compiled and transferred.

Kept apart from the backend class (training/backends/neuron.py) because none of it traces
a graph: the environment is read once by the Neuron runtime and neuronx-cc before the first
XLA device exists, the status and accelerator name go into the run's description and MFU
(training/perf/memory.py), and the counters are how tests, the smoke job and bench prove
the step graph stayed the same. Only torch-xla's metrics are imported, and only when asked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from training.backends.neuron_config import NeuronConfig
from training.errors import UserError

#: set by the backend in precision "bf16": unbiased rounding of pure-bf16 updates (see the
#: precision modes in training/backends/neuron.py's docstring)
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


def xla_compile_stats(syncs: int) -> dict[str, Any]:
    """XLA compile count/seconds and host transfers so far in this process.

    ``compiles`` counts graph compilations (on Neuron: neuronx-cc runs or compile-cache
    loads); a number that still grows after warm-up means a recompiling step.
    ``transfers_from_device`` counts device->host copies; ``local_scalar_dense`` counts
    ``.item()``-style reads (each one stalls the step it happens in). ``syncs`` is the
    backend's own count of step syncs.
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
            "syncs": syncs, **cache}
