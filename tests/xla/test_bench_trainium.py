"""``python -m training.bench --backend trainium`` on the XLA device: the same JSON schema as
the GPU bench plus compile count / seconds, and no compile inside the timed steps."""

from __future__ import annotations

import math

import yaml
from xla_helpers import tiny_tree

from training.perf.bench import main
from training.perf.bench_result import BenchResult


def test_bench_reports_compiles_and_a_steady_timed_window(features, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_tree(features, tmp_path / "unused")))
    out = tmp_path / "bench.json"
    main(["--backend", "trainium", "--config", str(config), "--steps", "4", "--warmup", "2",
          "--out", str(out), "--work-dir", str(tmp_path / "work")])
    result = BenchResult.load(out)
    assert result.backend == "trainium" and result.device_kind == "xla-cpu"
    assert result.compile_count is not None and result.compile_count >= 1
    assert result.compile_seconds is not None and result.compile_seconds > 0
    assert result.compiles_in_timed_steps == 0
    assert result.steps_timed == 4 and result.samples_per_s_total > 0
    assert result.final_loss is not None and math.isfinite(result.final_loss)  # step 6's, via the closing barrier
    assert "torch_xla" in result.versions
