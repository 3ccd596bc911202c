"""Aspect-ratio buckets on the XLA device: one graph per bucket, all of them traced by
``--precompile``, and no recompile when training switches between buckets."""

from __future__ import annotations

import json

import pytest
import yaml
from xla_helpers import BATCH, LATENT_SHAPE, MAX_TEXT_TOKENS, TEXT_DIM, tiny_config, tiny_tree

#: the shared tiny shape (its graph is already compiled by the other tests) plus a tall one
BUCKETS = {"1.0": LATENT_SHAPE, "2.0": (4, 12, 6)}
STEPS = 10


@pytest.fixture(scope="module")
def bucket_features(tmp_path_factory):
    from training.data.shards import write_synthetic_features

    out = tmp_path_factory.mktemp("bucket-features")
    write_synthetic_features(out, num_samples=48, buckets=BUCKETS, text_dim=TEXT_DIM, max_text_tokens=MAX_TEXT_TOKENS,
                             text_tokens=(2, MAX_TEXT_TOKENS), seed=0)
    return out


@pytest.mark.slow
def test_precompile_traces_every_bucket_and_training_then_never_recompiles(bucket_features, tmp_path, capsys):
    """The precompile run steps through each bucket; the training run after it, in the same
    process (torch-xla's in-memory compile cache is keyed by graph hash, as the on-disk one
    neuron_parallel_compile fills), switches buckets several times and compiles no step graph."""
    from training.backends.neuron import NeuronBackend
    from training.data.loader import FeatureLoader
    from training.loop import train
    from training.trainium import main

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_tree(bucket_features, tmp_path / "pre")))
    at_start = compile_count()
    main(["--config", str(config), "--precompile"])
    precompile_compiles = compile_count() - at_start
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["precompile"] is True and report["steps"] == 3 * len(BUCKETS)  # precompile_steps per bucket

    cfg = tiny_config(bucket_features, tmp_path / "run", max_steps=STEPS)
    order = [FeatureLoader(bucket_features, batch_size=BATCH, seed=cfg.data.seed, prefetch=0).bucket_at(0, s).name
             for s in range(STEPS)]
    assert set(order) == set(BUCKETS) and sum(a != b for a, b in zip(order, order[1:], strict=False)) >= 2, order

    class Recording(NeuronBackend):
        trace: list[dict] = []

        def sync(self) -> None:
            super().sync()
            self.trace.append(self.compile_stats())

    backend = Recording(cfg.trainium, precision=cfg.precision)
    backend.init()
    try:
        before = backend.compile_stats()["compiles"]
        train(cfg, backend)
    finally:
        backend.close()
    compiles = [s["compiles"] for s in backend.trace]
    assert len(compiles) == STEPS
    # steady state across bucket switches: no compile once every bucket has been seen ...
    both_seen = max(order.index(name) for name in BUCKETS)
    assert len(set(compiles[both_seen:])) == 1, f"recompiled after all buckets were seen: {compiles} ({order})"
    # ... and none at all: the precompile run had traced each bucket's step graph, one graph each
    # (fewer if another test of this session already compiled the shared tiny shape's graph)
    assert compiles[-1] == before, f"a graph the precompile did not trace: {before} -> {compiles} ({order})"
    assert 1 <= precompile_compiles <= len(BUCKETS), precompile_compiles


def compile_count() -> int:
    """XLA graph compilations so far in this process (torch-xla's CompileTime metric, as
    NeuronBackend.compile_stats counts them)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0
