"""python -m training.bench on the GPU backend (CPU here), and the loop-overhead benchmark."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from training.model import flops
from training.model.build import PRESETS
from training.perf import bench, measure, overhead, synthetic_features
from training.perf.bench_result import BenchResult

REPO = Path(__file__).resolve().parents[3]


def test_percentile_matches_numpy():
    values = [0.31, 0.2, 0.5, 0.45, 0.33, 0.29, 1.7]
    for q in (0, 10, 50, 90, 100):
        assert measure.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


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
    # issue 17: FLOPs of the real caption tokens; the computed (here untrimmed: 16 < 64) length beside them
    assert r.text_tokens_computed == 16 and r.train_flops_per_sample_computed == flops.train_flops_per_sample(
        PRESETS["tiny"], 16, (32, 32))
    assert r.train_flops_per_sample == pytest.approx(flops.train_flops_per_sample(
        PRESETS["tiny"], 16, (32, 32), real_text_tokens=r.text_tokens_real))
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

    cfg = load_config(["--config", str(overhead.OVERHEAD_CONFIG), "--output-dir", str(tmp_path / "run")])
    cfg = overhead.prepare_overhead_run(cfg, tmp_path)  # doubles the batch on a CPU fast enough to need it
    result = overhead.measure_overhead(cfg, work_dir=tmp_path)
    print("\n" + result.line())
    assert result.pairs == 10
    assert result.bare_step_s >= overhead.MIN_BARE_STEP_S, f"bare step {result.bare_step_s:.3f} s: model too small for the check"
    assert result.ratio <= overhead.OVERHEAD_LIMIT, result.line()
    assert statistics.median([result.loop_wall_s, result.bare_wall_s]) > 0


def _lengths(tmp_path: Path, lengths: list[int]) -> str:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"source": "test captions", "lengths": lengths}))
    return str(path)


def test_bench_records_mfu_on_real_tokens_and_trimmed_text(tmp_path):
    out = tmp_path / "trim.json"
    bench.main(["--backend", "gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
                "--set", "tensorboard=false", "--set", "text_trim.lengths=[8, 16, 32]", "--steps", "2",
                "--warmup", "1", "--synthetic", "--text-tokens", "40", "--work-dir", str(tmp_path / "work"),
                "--caption-lengths", _lengths(tmp_path, list(range(2, 17))), "--out", str(out)])
    r = BenchResult.load(out)
    assert r.caption_lengths.startswith("test captions (via lengths.json): 15 captions")
    assert r.text_tokens == 40 and 8 <= r.text_tokens_computed <= 16  # synthetic captions: 2..16 real tokens
    assert 2 <= r.text_tokens_real <= 16 and r.text_tokens_real <= r.text_tokens_computed
    assert r.train_flops_per_sample < r.train_flops_per_sample_computed < flops.train_flops_per_sample(
        PRESETS["tiny"], 40, (32, 32))
    assert r.memory_estimate is not None and r.memory_estimate["mesh"] == "ddp"


def test_compare_reference_runs_both_steps_interleaved_and_writes_both(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    bench.main(["--backend", "gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
                "--set", "tensorboard=false", "--set", "text_trim.lengths=[8, 16, 32]", "--compare-reference",
                "--set", "precision=bf16-mixed",  # what gpu-check.sh compares (autocast on both sides)
                "--steps", "2", "--warmup", "1", "--repetitions", "3", "--synthetic", "--text-tokens", "40",
                "--caption-lengths", _lengths(tmp_path, list(range(2, 17))),
                "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("compare-reference (both eager):")]
    assert len(line) == 1 and "ratio" in line[0] and "3 interleaved repetitions x 2 steps" in line[0]
    r = BenchResult.load(out)  # validates the reference block (ratio = ours / reference)
    ref = r.reference
    assert ref is not None and len(ref["seconds_ours"]) == len(ref["seconds_reference"]) == 3
    assert r.steps_timed == 6 and math.isclose(r.timed_seconds, sum(ref["seconds_ours"]))
    assert math.isclose(ref["samples_per_s_total"], 4 * 6 / sum(ref["seconds_reference"]))
    assert math.isclose(ref["ratio"], r.samples_per_s_total / ref["samples_per_s_total"])
    assert ref["text_tokens_computed"] == 40 and r.text_tokens_computed < 40  # reference: padded captions
    assert ref["text_tokens_real"] == r.text_tokens_real  # the same batches, the same real captions
    assert ref["compiled"] is False and len(ref["ratios"]) == 3 and min(ref["ratios"]) <= ref["ratio_median"]
    assert "fused" in ref["description"] and "eager" in ref["description"]
    assert ref["weight_update_norm"] > 0 and ref["weight_update_norm_ours"] > 0  # both really trained
    assert math.isfinite(ref["final_loss"]) and math.isfinite(r.final_loss) and r.precision == "bf16-mixed"


def test_reference_step_is_the_diffusers_recipe():
    """ReferenceStep trains diffusers' own model (no fp32 linear-attention processor, default
    init) with fused AdamW (CPU has the fused kernel since torch 2.4), and its on-device sigma
    lookup gives what the script's per-sample ``(schedule == t).nonzero().item()`` gives, for
    every index of the schedule."""
    import torch

    from training.perf.reference_step import ReferenceStep

    torch.manual_seed(0)
    step = ReferenceStep(PRESETS["tiny"], device=torch.device("cpu"), precision="bf16-mixed", lr=1e-3,
                         flow_shift=3.0)
    assert type(step.optimizer) is torch.optim.AdamW and step.optimizer.defaults.get("fused") is True
    procs = {type(m.processor).__name__ for m in step.inner.modules() if hasattr(m, "processor")}
    assert "SanaLinearAttnProcessor2_0" in procs
    indices = torch.arange(len(step.scheduler.timesteps))
    sched = step.scheduler.timesteps
    script = step.scheduler.sigmas[[(sched == t).nonzero().item() for t in sched[indices]]]
    assert torch.equal(step._sigmas(indices, 1), script.float())
    gen = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(2, 4, 8, 8, generator=gen), "text": torch.randn(2, 6, 8, generator=gen),
             "text_mask": torch.ones(2, 6, dtype=torch.long)}
    before = [p.detach().clone() for p in step.inner.parameters()]
    loss = step(batch)
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    assert any(not torch.equal(a, b) for a, b in zip(before, step.inner.parameters(), strict=True))


def test_memory_table_covers_every_gpu_config_mesh_and_mode(capsys):
    bench.main(["--memory-table", "--config", str(REPO / "training/configs/sana-600m-512.yaml")])
    out = capsys.readouterr().out
    assert "**sana-600m-512**" in out and "| checkpointing | ddp | fsdp | hsdp |" in out
    for mode in ("none", "full", "every_n", "selective"):
        assert f"| {mode} " in out


def test_gpu_dry_run_refuses_a_config_that_cannot_fit_naming_the_knob(capsys):
    config = str(REPO / "training/configs/sana-600m-512.yaml")
    bench.main(["--dry-run", "--backend", "gpu", "--config", config])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory_gib"]["total"] < 80
    with pytest.raises(SystemExit) as exc:
        bench.main(["--dry-run", "--backend", "gpu", "--config", config, "--set", "data.batch_size=64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds its 80 GiB" in err[0] and "model.activation_checkpointing: selective" in err[0]


def test_a_result_written_before_issue_17_still_loads(tmp_path):
    """Older files have no mfu_padded / text_tokens_* / memory_estimate / reference: still valid."""
    out = tmp_path / "new.json"
    bench.main(["--backend", "gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"), "--set",
                "tensorboard=false", "--steps", "1", "--warmup", "1", "--synthetic", "--text-tokens", "16",
                "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    data = json.loads(out.read_text())
    for key in ("mfu_padded", "train_flops_per_sample_computed", "text_tokens_real", "text_tokens_computed",
                "memory_estimate", "reference"):
        data.pop(key)
    old = BenchResult.from_dict(data)
    assert old.mfu_padded is None and old.reference is None
    data["reference"] = {"samples_per_s_total": 1.0, "ratio": 99.0}
    with pytest.raises(ValueError, match="reference: ratio disagrees"):
        BenchResult.from_dict(data)


@pytest.mark.slow
def test_compare_reference_compiles_both_sides_and_counts_graphs(tmp_path, capsys):
    """gpu.compile=true: ours per block (training/model/compile.py) and the reference per block
    (diffusers' regional compilation), aot_eager here (inductor takes minutes on this CPU).
    The JSON records dynamo's counts: graphs compiled, none in the timed window, no break."""
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    out = tmp_path / "cmp.json"
    bench.main(["--backend", "gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
                "--set", "tensorboard=false", "--set", "gpu.compile=true", "--set", "gpu.compile_backend=aot_eager",
                "--set", "gpu.compile_cache_dir=''",
                "--set", "precision=bf16-mixed", "--compare-reference", "--steps", "2", "--warmup", "2",
                "--repetitions", "2", "--synthetic", "--text-tokens", "16", "--caption-lengths", "full",
                "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert "compare-reference (both compiled):" in capsys.readouterr().out
    r = BenchResult.load(out)
    assert r.reference["compiled"] is True and "per-block compile" in r.reference["description"]
    assert r.compile_count >= 2 and r.compiles_in_timed_steps == 0 and r.graph_breaks == 0, r.graph_break_reasons
    assert r.caption_lengths == "full (every caption at the padded length)"
    assert r.text_tokens_real == r.text_tokens_computed == 16 == r.reference["text_tokens_real"]


def test_caption_lengths_come_from_the_stored_captions(tmp_path, capsys):
    """A feature directory's stored caption rows (read from the safetensors headers only), a
    JSON saved from them, and what synthetic features drawn from them hold."""
    from training.data import caption_lengths as cl
    from training.data.loader import FeatureLoader
    from training.data.shards import write_synthetic_features

    real = [3, 3, 7, 12, 40]  # 40 > max_text_tokens: a long caption, stored cut to 20
    write_synthetic_features(tmp_path / "real", num_samples=24, max_text_tokens=20, text_lengths=real,
                             samples_per_shard=10)
    lengths = cl.stored_lengths(tmp_path / "real")
    assert len(lengths) == 24 and set(lengths) <= {3, 7, 12, 20} and len(set(lengths)) >= 3
    loader = FeatureLoader(tmp_path / "real", batch_size=24, prefetch=0)
    masks = next(loader)["text_mask"].sum(dim=1).tolist()
    loader.close()
    assert sorted(masks) == sorted(lengths)  # what the headers say is what training reads
    cl.main([str(tmp_path / "real"), "--out", str(tmp_path / "lengths.json")])
    assert "24 captions" in capsys.readouterr().out
    saved = cl.load(str(tmp_path / "lengths.json"))
    assert list(saved.lengths) == lengths and "stored caption tokens of" in saved.source
    assert cl.load("full").lengths is None
    with pytest.raises(cl.UserError, match="--caption-lengths nowhere: neither"):
        cl.load("nowhere")
    spec = synthetic_features.synthetic_spec(PRESETS["tiny"], 10, saved)
    assert max(spec["text_lengths"]) == 10 and "text_tokens" not in spec  # clipped to the padded length


def test_bench_auto_caption_lengths_use_the_config_features(tmp_path):
    from training.config import load_config
    from training.data.shards import write_synthetic_features

    write_synthetic_features(tmp_path / "feats", num_samples=8, max_text_tokens=16, text_lengths=[5])
    cfg = load_config(["--config", str(REPO / "training/configs/tiny-cpu.yaml"), "--set",
                       f"data.path={tmp_path / 'feats'}"])
    assert synthetic_features.resolve_caption_lengths("auto", cfg).lengths == (5,) * 8
    cfg.data.path = str(tmp_path / "absent")
    assert synthetic_features.resolve_caption_lengths("auto", cfg).lengths is None  # full
