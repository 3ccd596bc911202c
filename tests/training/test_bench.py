"""python -m training.bench on the GPU backend (CPU here), and the loop-overhead benchmark."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from training import bench, flops
from training.bench_result import BenchResult
from training.model import PRESETS

REPO = Path(__file__).resolve().parents[2]


def test_percentile_matches_numpy():
    values = [0.31, 0.2, 0.5, 0.45, 0.33, 0.29, 1.7]
    for q in (0, 10, 50, 90, 100):
        assert bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_bench_gpu_backend_on_cpu_writes_a_valid_result(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    bench.main(["--backend", "gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
                "--set", "tensorboard=false", "--steps", "3", "--warmup", "1", "--synthetic",
                "--text-tokens", "16", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert '"samples_per_s_total"' in capsys.readouterr().out
    r = BenchResult.load(out)  # validates every field and identity
    assert (r.backend, r.device_kind, r.instance_type, r.accelerator) == ("gpu", "cpu", "local", "cpu")
    assert (r.world_size, r.nodes, r.accelerators_per_node, r.global_batch) == (1, 1, 1, 4)
    assert (r.steps_timed, r.warmup_steps, r.data, r.precision) == (3, 1, "synthetic", "fp32")
    assert r.latent_hw == [32, 32] and r.resolution_px == 1024 and r.text_tokens == 16
    assert math.isclose(r.samples_per_s_total, 4 * 3 / r.timed_seconds)
    assert r.step_time_p50_s <= r.step_time_p90_s
    assert r.train_flops_per_sample == flops.train_flops_per_sample(PRESETS["tiny"], 16, (32, 32))
    assert r.mfu is None and r.peak_tflops_per_accelerator is None  # no published CPU peak
    assert r.compile_count is None and r.final_loss is not None and math.isfinite(r.final_loss)
    assert r.versions["torch"].startswith("2.") and r.command.startswith("python -m training.bench")
    assert not list((tmp_path / "work").glob("run-*")), "scratch run dir left behind"


def test_bench_refuses_zero_warmup(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--config", str(REPO / "training/configs/tiny-cpu.yaml"), "--steps", "2", "--warmup", "0",
                    "--synthetic", "--text-tokens", "16", "--work-dir", str(tmp_path), "--out",
                    str(tmp_path / "x.json")])
    assert exc.value.code == 2
    assert "--warmup" in capsys.readouterr().err


@pytest.mark.benchmark
@pytest.mark.slow
def test_loop_step_costs_at_most_110_percent_of_a_bare_step(tmp_path):
    """Issue 4 part 8: CPU fp32, a model whose bare step takes >= 0.2 s; one run, ratio printed."""
    from training.config import load_config

    cfg = load_config(["--config", str(bench.OVERHEAD_CONFIG), "--output-dir", str(tmp_path / "run")])
    cfg = bench.prepare_overhead_run(cfg, tmp_path)  # doubles the batch on a CPU fast enough to need it
    result = bench.measure_overhead(cfg, work_dir=tmp_path)
    print("\n" + result.line())
    assert result.pairs == 10
    assert result.bare_step_s >= bench.MIN_BARE_STEP_S, f"bare step {result.bare_step_s:.3f} s: model too small for the check"
    assert result.ratio <= bench.OVERHEAD_LIMIT, result.line()
    assert statistics.median([result.loop_wall_s, result.bare_wall_s]) > 0
