"""tests/xla: the Trainium backend on torch-xla's CPU device, in .venv-xla (torch 2.9 + torch-xla 2.9).

PJRT_DEVICE=CPU is set before anything imports torch_xla. Every test here runs in ONE
process on purpose: torch-xla's compile cache is per process and keyed by the graph, so
tests that train the same tiny configuration reuse one compiled step graph (~30-60 s of
XLA CPU compile on the shared 2-core machine) instead of compiling it again. Fixtures
that train are therefore session-scoped and configured identically where they can be.

What these tests do NOT prove (XLA collectives across processes return wrong values on
PJRT CPU, pytorch/xla#5005): cross-rank gradient all-reduce, ZeRO-1 with more than one
shard, rendezvous/broadcast between processes. scripts/trn-smoke.py proves those on a trn node.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
# What NeuronBackend.init() sets; set here too so an XLA op that runs before the first
# backend (torch-xla reads it once) sees the same graphs.
os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

if importlib.util.find_spec("torch_xla") is None:  # e.g. run from .venv by mistake
    collect_ignore_glob = ["test_*.py"]
    print("tests/xla: torch_xla not installed in this interpreter; run `make test-xla` (.venv-xla)")
else:
    # NOTE: bring up the XLA device before any test runs a backward pass (the GPU backend on CPU
    # does): autograd sizes its per-device queues at the first backward, and torch_xla's
    # (reentrant) activation checkpointing later needs the XLA device's queue. The entrypoint
    # creates the device in backend.init(), before any backward; only a mixed process cares.
    import torch_xla

    torch_xla.device()

from xla_helpers import LATENT_SHAPE, MAX_TEXT_TOKENS, TEXT_DIM  # noqa: E402


@pytest.fixture(scope="session")
def features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 synthetic samples in the real shard format, shaped for the tiny preset."""
    from training.data.shards import write_synthetic_features

    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=64, latent_shape=LATENT_SHAPE, text_dim=TEXT_DIM,
                             max_text_tokens=MAX_TEXT_TOKENS, text_tokens=(2, MAX_TEXT_TOKENS), seed=0)
    return out


@pytest.fixture(scope="session")
def xla_run(features: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny preset trained 12 steps on the XLA device through the shared loop.

    Records torch-xla's counters after every optimizer step (a recording subclass of the
    real backend, no mocks) and counts real graph launches by wrapping the C++ step marker.
    Ends with the loop's forced checkpoint at step 12, which the cross-backend tests load.
    """
    import torch_xla
    from xla_helpers import tiny_config

    from training.backends.neuron import NeuronBackend
    from training.loop import train

    out = tmp_path_factory.mktemp("xla-run")
    cfg = tiny_config(features, out)
    markers = []
    real_marker = torch_xla._XLAC._xla_step_marker

    def counting_marker(*args, **kwargs):
        markers.append(1)
        return real_marker(*args, **kwargs)

    class Recording(NeuronBackend):
        trace: list[dict] = []

        def sync(self) -> None:
            before = len(markers)
            super().sync()
            self.trace.append({**self.compile_stats(), "markers_this_step": len(markers) - before,
                               "markers_total": len(markers)})

    backend = Recording(cfg.trainium, precision=cfg.precision)
    backend.init()
    torch_xla._XLAC._xla_step_marker = counting_marker
    try:
        result = train(cfg, backend)
    finally:
        torch_xla._XLAC._xla_step_marker = real_marker
        backend.close()
    return {"cfg": cfg, "result": result, "trace": backend.trace, "out": out, "backend": backend}
