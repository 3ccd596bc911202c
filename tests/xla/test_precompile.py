"""``python -m training.trainium --precompile``: traces a few steps, writes no checkpoint,
resumes from none and reads no tensor value."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from xla_helpers import tiny_tree

from training.checkpoint.layout import list_complete
from training.trainium import main


def test_precompile_traces_steps_and_writes_no_checkpoint(xla_run, features, tmp_path, capsys):
    out = tmp_path / "run"
    # a complete checkpoint where --resume auto would find it: precompile must not load it
    shutil.copytree(xla_run["out"] / "checkpoints", out / "checkpoints")
    assert list_complete(out / "checkpoints")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_tree(features, out)))

    main(["--config", str(config), "--precompile", "--resume", "auto", "--max-steps", "50"])

    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["precompile"] is True
    assert report["steps"] == 3  # trainium.precompile_steps, from step 0 (nothing resumed)
    assert report["final_loss"] is None  # no tensor was read
    assert report["checkpoint"] is None
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000012"]  # only the copy
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or not any("loss" in json.loads(line) for line in metrics.read_text().splitlines())


def test_help_lists_precompile(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "--precompile" in capsys.readouterr().out


def _entry(config, cache, *extra: str, **env: str) -> dict:
    """``python -m training.trainium`` in its own process (a fresh in-memory compile cache) on
    torch-xla's on-disk cache ``cache``; returns its one-line summary."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    run_env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(repo), "XLA_PERSISTENT_CACHE_PATH": str(cache),
               "OMP_NUM_THREADS": "1", **env}
    if "NEURON_EXTRACT_GRAPHS_ONLY" not in env:
        run_env.pop("NEURON_EXTRACT_GRAPHS_ONLY", None)
    proc = subprocess.run([sys.executable, "-m", "training.trainium", "--config", str(config), *extra],
                          cwd=repo, env=run_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_training_run_after_the_precompile_finds_every_graph_in_the_cache(features, tmp_path):
    """The precompile run (detected from NEURON_EXTRACT_GRAPHS_ONLY, as neuron_parallel_compile
    sets it; no --precompile flag) fills the on-disk cache; the training run after it, from
    the same cache directory, looks every graph up by hash and misses none.

    On PJRT CPU torch-xla finds the entries but cannot deserialize CPU executables
    (PersistentCacheDeserializeFailure) and compiles again; the lookup by graph hash, which
    decides whether neuronx-cc runs on a trn node, is what is asserted here.
    """
    cache = tmp_path / "compile-cache"
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_tree(features, tmp_path / "run")))

    pre = _entry(config, cache, NEURON_EXTRACT_GRAPHS_ONLY="1")
    assert pre["precompile"] is True and pre["checkpoint"] is None and pre["steps"] == 3
    assert pre["persistent_cache_misses"] >= 1  # it compiled (and stored) the run's graphs
    stored = sorted(p.name for p in cache.iterdir())
    assert stored

    run = _entry(config, cache, "--max-steps", "4")
    assert run["precompile"] is False and run["steps"] == 4 and run["checkpoint"]  # a real run
    assert run["persistent_cache_misses"] == 0, run  # zero graphs the precompile did not have
    assert run["persistent_cache_loads"] >= 1
    assert sorted(p.name for p in cache.iterdir()) == stored  # and nothing new was written
