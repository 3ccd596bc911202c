"""Caption trimming (training/data/text_trim.py): trimmed batches train exactly like padded ones,
the trim rounds up to the configured lengths and keeps the null caption, and the loop logs
MFU on real tokens next to the padded figure."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.training.cpu_run import train_on_cpu
from training.data.loader import FeatureLoader
from training.data.shards import write_synthetic_features
from training.data.text_trim import BatchTokens, TextTrimConfig, TokenMeter, count_step, trim_length, trimmed
from training.model import flops
from training.model.build import PRESETS, ModelConfig, build_model
from training.objective import ObjectiveConfig, RectifiedFlow

B, C, H, N, D = 4, 4, 8, 40, 8
LENGTHS = [8, 16, 24]


def _batch(real=(2, 5, 7, 3)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    mask = torch.zeros(B, N, dtype=torch.int64)
    for i, n in enumerate(real):
        mask[i, :n] = 1
    return {
        "latents": torch.randn(B, C, H, H, generator=gen),
        "text": torch.randn(B, N, D, generator=gen) * mask[..., None],
        "text_mask": mask,
    }


def _null(n_real: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    text = torch.zeros(N, D)
    text[:n_real] = torch.randn(n_real, D, generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(N, dtype=torch.int64)
    mask[:n_real] = 1
    return text, mask


def test_trim_length_rounds_up_to_the_configured_lengths() -> None:
    assert [trim_length(n, LENGTHS, N) for n in (1, 8, 9, 16, 24, 25, 40)] == [8, 8, 16, 16, 24, 40, 40]
    assert trim_length(5, [64, 128], 32) == 32  # never longer than the padded length
    with pytest.raises(ValueError, match="text_trim.lengths"):
        TextTrimConfig(lengths=[128, 64])


def test_trimmed_cuts_to_the_longest_caption_and_never_below_the_floor() -> None:
    batch = _batch()
    out = next(trimmed([batch], lengths=LENGTHS))
    assert out["text"].shape == (B, 8, D) and out["text_mask"].shape == (B, 8)
    assert out["text"].is_contiguous()
    assert torch.equal(out["text_mask"].sum(1), batch["text_mask"].sum(1))  # every real token kept
    assert torch.equal(out["latents"], batch["latents"])
    floored = next(trimmed([batch], lengths=LENGTHS, floor=12))  # e.g. a 12-token null caption
    assert floored["text"].shape[1] == 16
    assert next(trimmed([batch], lengths=None))["text"].shape[1] == N  # off: untouched


def _loss_and_grads(
    batch: dict[str, torch.Tensor], *, autocast: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"))
    null_text, null_mask = _null()
    objective = RectifiedFlow(
        ObjectiveConfig(caption_dropout=0.5),
        vae_scaling_factor=0.41407,
        null_text=null_text,
        null_mask=null_mask,
    )
    torch.manual_seed(7)  # the objective's draw: same sigmas, noise and dropout for both batches
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = objective(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-mixed"])
def test_trimmed_batch_gives_the_untrimmed_loss_and_gradients(autocast: bool) -> None:
    """Padding is masked out of the cross-attention and the caption projection is per token,
    so cutting it changes nothing (module docstring). Caption dropout is on (p=0.5: this seed
    drops some rows to the null caption, which is cut to the same length)."""
    batch = _batch()
    full_loss, full_grads = _loss_and_grads(batch, autocast=autocast)
    cut = next(trimmed([batch], lengths=LENGTHS, floor=2))
    assert cut["text"].shape[1] == 8
    cut_loss, cut_grads = _loss_and_grads(cut, autocast=autocast)
    tol = dict(rtol=1e-2, atol=1e-4) if autocast else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cut_loss, full_loss, **tol)
    for a, b in zip(cut_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_caption_dropout_really_happens_in_the_equivalence_test() -> None:
    """Guard for the test above: with its seed, some but not all rows take the null caption."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(7)
    torch.randn(B)
    torch.randn(B, C, H, H)
    drop = torch.rand(B) < 0.5
    torch.random.set_rng_state(gen_state)
    assert 0 < int(drop.sum()) < B


def test_trimming_is_exact_for_dropped_captions_whatever_the_null_captions_length() -> None:
    """A batch of 2-token captions with a 12-token null caption: Sana's dropout keeps each
    caption's own mask (training/objective.py), so a dropped caption attends its first 2 null
    rows only and cutting at 8 columns changes nothing, with or without ``floor``."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"))
    null_text, null_mask = _null(12)
    objective = RectifiedFlow(
        ObjectiveConfig(caption_dropout=1.0), vae_scaling_factor=1.0, null_text=null_text, null_mask=null_mask
    )
    batch = _batch(real=(2, 2, 2, 2))
    losses = []
    for lengths, floor in ((None, 1), (LENGTHS, int(null_mask.sum())), (LENGTHS, 1)):
        torch.manual_seed(7)
        losses.append(objective(model, next(trimmed([batch], lengths=lengths, floor=floor))))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(losses[2], losses[0], rtol=1e-5, atol=1e-7)  # 8 columns: nothing attended is cut


def test_trimming_leaves_the_loader_position_alone(tmp_path) -> None:
    write_synthetic_features(
        tmp_path, num_samples=16, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=40, text_tokens=(2, 12)
    )
    plain, wrapped = (FeatureLoader(tmp_path, batch_size=4, prefetch=0) for _ in range(2))
    it = trimmed(wrapped, lengths=LENGTHS)
    for _ in range(3):
        a, b = next(plain), next(it)
        n = b["text"].shape[1]
        assert (
            n in LENGTHS
            and n >= int(a["text_mask"].sum(1).max())
            and torch.equal(a["text"][:, :n], b["text"])
        )
    assert plain.state_dict() == wrapped.state_dict()
    plain.close()
    wrapped.close()


def test_meter_and_step_counts_follow_the_batches_not_the_read_ahead() -> None:
    meter = TokenMeter()
    batches = [_batch(), _batch(real=(40, 1, 1, 1))]
    it = trimmed(iter(batches), lengths=LENGTHS, meter=meter)
    next(it), next(it)  # a backend reading one batch ahead
    first = meter.take(1)
    assert first == [BatchTokens(samples=4, latent_hw=(8, 8), real_tokens=17 / 4, computed_tokens=8)]
    kw = PRESETS["tiny"]

    def per_sample(hw, computed, real):
        return flops.train_flops_per_sample(kw, computed, hw, real_text_tokens=real)

    step = count_step(first, per_sample)
    assert step.samples == 4 and step.computed_text_tokens == 32 and step.image_tokens == 4 * 64
    assert step.useful_flops == pytest.approx(4 * per_sample((8, 8), 8, 17 / 4))
    assert step.computed_flops == pytest.approx(4 * per_sample((8, 8), 8, None))
    assert step.useful_flops < step.computed_flops
    second = count_step(meter.take(5), per_sample)  # only what was seen
    assert second.computed_text_tokens == 4 * 40 and second.real_text_tokens == 43


def _tiny_cfg(tmp_path, features, **sets):
    from tests.training.perf.test_bench import REPO
    from training.config import load_config

    argv = [
        "--config",
        str(REPO / "training/configs/tiny-cpu.yaml"),
        "--output-dir",
        str(tmp_path / "run"),
        "--set",
        f"data.path={features}",
        "--set",
        "tensorboard=false",
        "--set",
        "log_every=2",
        "--set",
        "max_steps=4",
        "--set",
        "checkpoint.enabled=false",
        "--set",
        "checkpoint.resume=none",
        "--set",
        "data.prefetch=0",
        "--set",
        "objective.caption_dropout=0.5",
    ]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    return load_config(argv, prog="test")


def test_loop_trims_on_the_gpu_backend_and_trains_the_same_weights(tmp_path) -> None:
    write_synthetic_features(
        tmp_path / "features",
        num_samples=32,
        latent_shape=(4, 8, 8),
        text_dim=8,
        max_text_tokens=40,
        text_tokens=(2, 12),
    )
    on = train_on_cpu(_tiny_cfg(tmp_path / "on", tmp_path / "features", **{"text_trim.lengths": "[8, 16]"}))
    off = train_on_cpu(_tiny_cfg(tmp_path / "off", tmp_path / "features", **{"text_trim.enabled": "false"}))
    assert {t.computed_text_tokens / t.samples for t in on.step_tokens} == {16.0}  # 12-token max -> 16
    assert {t.computed_text_tokens / t.samples for t in off.step_tokens} == {40.0}
    for t_on, t_off in zip(on.step_tokens, off.step_tokens, strict=True):
        assert t_on.real_text_tokens == t_off.real_text_tokens  # same batches, nothing real cut
        assert t_on.computed_flops < t_off.computed_flops and t_on.useful_flops == pytest.approx(
            t_off.useful_flops
        )
    for a, b in zip(on.model.parameters(), off.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "on/run/metrics.jsonl").read_text().splitlines()]
    assert rows and all(
        {"mfu", "mfu_padded", "text_tokens_real", "text_tokens_computed"} <= set(r) for r in rows
    )
    assert all(r["text_tokens_computed"] == 16 and 2 <= r["text_tokens_real"] <= 12 for r in rows)


def test_mfu_counts_real_tokens_and_mfu_padded_the_computed_ones(monkeypatch) -> None:
    from training.backends.gpu import GpuBackend, GpuConfig
    from training.config import TrainConfig
    from training.loop import _throughput_fn

    backend = GpuBackend(GpuConfig(), precision="bf16-mixed")
    monkeypatch.setattr(backend, "describe", lambda: {"accelerator": "H100-SXM"})
    model = build_model(ModelConfig(preset="tiny"))
    count, rates = _throughput_fn(dataclasses.replace(TrainConfig(), precision="bf16-mixed"), backend, model)
    step = count([BatchTokens(samples=4, latent_hw=(8, 8), real_tokens=5.0, computed_tokens=16)])
    r = rates(step, 1000.0)
    assert r["mfu"] == pytest.approx(flops.mfu(step.useful_flops / 4, 1000.0, "H100-SXM", "bf16-mixed"))
    assert r["mfu_padded"] == pytest.approx(
        flops.mfu(step.computed_flops / 4, 1000.0, "H100-SXM", "bf16-mixed")
    )
    assert 0 < r["mfu"] < r["mfu_padded"]
    assert r["tokens_per_sample"] == 64 + 16 and r["text_tokens_real"] == 5.0


@pytest.mark.slow
def test_two_ranks_trimming_their_own_batches_train_the_same_weights(tmp_path) -> None:
    """DDP over 2 gloo ranks: each rank cuts its own batch to its own longest caption (shapes
    may differ between ranks; only gradients are all-reduced), ending where the padded run ends."""
    from tests.training.backends.test_gpu_distributed import ZERO_GRAD, launch

    write_synthetic_features(
        tmp_path / "features",
        num_samples=32,
        latent_shape=(4, 8, 8),
        text_dim=8,
        max_text_tokens=24,
        text_tokens=(1, 10),
        samples_per_shard=16,
    )
    on = launch(tmp_path, "on", 2, 2, "--set", "text_trim.lengths=[4, 8, 12, 16]")
    off = launch(tmp_path, "off", 2, 2, "--set", "text_trim.enabled=false")
    for key, value in off[0]["full"].items():
        atol = 1e-3 * 4 if key in ZERO_GRAD else 1e-5  # rounding-noise-only gradient: see that module
        torch.testing.assert_close(on[0]["full"][key], value, rtol=1e-4, atol=atol, msg=key)
    assert on[0]["loss"] == pytest.approx(off[0]["loss"], rel=1e-4)
