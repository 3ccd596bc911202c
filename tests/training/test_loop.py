"""The shared loop on the CPU GPU-backend: a real tiny run end to end, accumulation, schedule."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.training.cpu_run import train_on_cpu
from training.backends.gpu import GpuBackend
from training.checkpoint.consolidate import has_part
from training.config import TrainConfig, config_from_dict
from training.data.shards import write_synthetic_features
from training.errors import UserError
from training.loop import forward_backward, train_step
from training.model.build import ModelConfig, build_model
from training.objective import ObjectiveConfig, RectifiedFlow
from training.optim.factory import OptimConfig, build_scheduler, lr_multiplier

LATENT = (4, 8, 8)
TEXT_DIM, TOKENS = 8, 8


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=16, latent_shape=LATENT, text_dim=TEXT_DIM,
                             max_text_tokens=TOKENS, text_tokens=(1, TOKENS), samples_per_shard=8)
    return out


def tiny_config(features: Path, out: Path, **over) -> TrainConfig:
    tree = {
        "model": {"preset": "tiny"},
        "data": {"path": str(features), "batch_size": 2, "prefetch": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "cosine", "grad_accum_steps": 2},
        "ema": {"decay": 0.9},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "precision": "fp32", "max_steps": 6, "output_dir": str(out), "log_every": 2, "tensorboard": True,
    }
    for key, value in over.items():
        node = tree
        *path, last = key.split("__")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return config_from_dict(tree)


def run(cfg: TrainConfig):
    return train_on_cpu(cfg)


def test_tiny_run_logs_saves_and_resumes(features: Path, tmp_path: Path) -> None:
    cfg = tiny_config(features, tmp_path)
    result = run(cfg)
    assert result.steps == 6 and len(result.step_times) == 6
    assert result.samples_per_step == 2 * 1 * 2
    assert result.final_loss is not None and math.isfinite(result.final_loss)
    assert result.checkpoint == tmp_path / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    assert has_part(result.checkpoint, "ema")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        assert {"loss", "grad_norm", "lr", "samples_per_s", "tokens_per_s", "mfu", "step_time_s"} <= r.keys()
        assert r["samples_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * (8 * 8 + TOKENS))
        assert r["mfu"] is None  # a CPU has no published peak
    assert records[-1]["loss"] == pytest.approx(result.final_loss)
    assert records[0]["lr"] == pytest.approx(1e-3 * lr_multiplier(1, cfg=cfg.optim, max_steps=6))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    more = run(tiny_config(features, tmp_path, max_steps=8))  # --resume auto is the default
    assert more.steps == 2 and more.checkpoint == tmp_path / "checkpoints" / "step-00000008"
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1] == 8


def test_features_must_fit_the_model(tmp_path: Path) -> None:
    write_synthetic_features(tmp_path / "f", num_samples=4, latent_shape=(32, 4, 4), text_dim=TEXT_DIM,
                             max_text_tokens=TOKENS)
    with pytest.raises(UserError, match="model.preset: tiny takes 4 latent channels"):
        run(tiny_config(tmp_path / "f", tmp_path / "run"))


def test_grad_accumulation_is_the_mean_of_micro_batches() -> None:
    """train_step with 2 micro-batches == one backward of (loss1 + loss2) / 2, same RNG stream."""
    backend = GpuBackend(tiny_config(Path("."), Path(".")).gpu, precision="fp32")
    objective_cfg = ObjectiveConfig(caption_dropout=0.3)
    null = (torch.zeros(TOKENS, TEXT_DIM), torch.ones(TOKENS, dtype=torch.int64))
    gen = torch.Generator().manual_seed(0)
    batches = [{"latents": torch.randn(2, *LATENT, generator=gen),
                "text": torch.randn(2, TOKENS, TEXT_DIM, generator=gen),
                "text_mask": torch.ones(2, TOKENS, dtype=torch.int64)} for _ in range(2)]

    def fresh():
        torch.manual_seed(0)
        model = build_model(ModelConfig(preset="tiny"))
        objective = RectifiedFlow(objective_cfg, vae_scaling_factor=0.5, null_text=null[0], null_mask=null[1])
        return model, objective

    model, objective = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = build_scheduler(opt, OptimConfig(), max_steps=10)
    torch.manual_seed(7)
    loss, norm = train_step(model, opt, sched, objective, iter(batches), backend,
                            OptimConfig(grad_accum_steps=2, max_grad_norm=0.0))

    ref, ref_objective = fresh()
    torch.manual_seed(7)
    losses = [ref_objective(ref, b) for b in batches]
    (sum(losses) / 2).backward()
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert loss.item() == pytest.approx((losses[0].item() + losses[1].item()) / 2, rel=1e-6)
    assert norm.item() == pytest.approx(want_norm.item(), rel=1e-5)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_lr_schedule() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    got = [lr_multiplier(s, cfg=cfg, max_steps=14) for s in range(15)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]
    assert got[4] == pytest.approx(1.0) and got[9] == pytest.approx(0.55) and got[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(got[3:], got[4:], strict=False))
    const = OptimConfig(warmup_steps=2)
    assert [lr_multiplier(s, cfg=const, max_steps=9) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


# precision "bf16" is refused on the GPU backend (tests/training/model/test_numerics.py); its
# pure-bf16 path lives on Trainium (tests/xla).
@pytest.mark.parametrize("precision", ["bf16-mixed"])
def test_bf16_paths_on_tiny(features: Path, tmp_path: Path, precision: str) -> None:
    cfg = tiny_config(features, tmp_path, precision=precision, max_steps=2, ema__decay=0.0,
                      optim__grad_accum_steps=1, tensorboard=False)
    result = run(cfg)
    assert result.steps == 2 and math.isfinite(result.final_loss)
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for p in result.model.parameters()} == {want}


def test_forward_backward_scales_the_gradient() -> None:
    backend = GpuBackend(tiny_config(Path("."), Path(".")).gpu, precision="fp32")
    null = (torch.zeros(TOKENS, TEXT_DIM), torch.ones(TOKENS, dtype=torch.int64))
    batch = {"latents": torch.randn(2, *LATENT), "text": torch.randn(2, TOKENS, TEXT_DIM),
             "text_mask": torch.ones(2, TOKENS, dtype=torch.int64)}
    grads = []
    for scale in (1.0, 0.25):
        torch.manual_seed(0)
        model = build_model(ModelConfig(preset="tiny"))
        objective = RectifiedFlow(ObjectiveConfig(), vae_scaling_factor=1.0, null_text=null[0], null_mask=null[1])
        forward_backward(model, objective, batch, backend, scale)
        grads.append(model.proj_out.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] * 0.25)


def test_a_resume_from_an_earlier_checkpoint_logs_every_step_once(features: Path, tmp_path: Path) -> None:
    """Steps 4-6 ran (and were logged) after the checkpoint at 3; a run resumed from step 3 logs
    them again: metrics.jsonl and TensorBoard keep one record per step, the superseded lines
    move to metrics-abandoned.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tiny_config(features, tmp_path, log_every=1))
    first = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = run(tiny_config(features, tmp_path, log_every=1,
                              checkpoint__resume=str(tmp_path / "checkpoints" / "step-00000003")))
    assert resumed.steps == 3
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[:3] == first[:3]  # what the resumed-from trajectory logged up to its checkpoint stays
    assert records[5]["loss"] == pytest.approx(first[5]["loss"])  # and the resume recomputed the rest
    abandoned = [json.loads(x)["step"] for x in (tmp_path / "metrics-abandoned.jsonl").read_text().splitlines()]
    assert abandoned == [4, 5, 6]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
