"""Presets build the intended SanaTransformer2DModel; pretrained dirs load from disk and S3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training import s3
from training.errors import UserError
from training.model.build import PRESETS, ModelConfig, build_model, count_parameters


@pytest.mark.parametrize(("preset", "millions"), [("sana-600m-512", 591.7), ("sana-1600m-1024", 1604.5)])
def test_big_presets_parameter_count_on_meta(preset: str, millions: float) -> None:
    model = build_model(ModelConfig(preset=preset), device="meta")
    n = count_parameters(model) / 1e6
    assert abs(n - millions) / millions < 0.005, n
    assert next(model.parameters()).device.type == "meta"


def test_preset_shapes_match_issue() -> None:
    kw = PRESETS["sana-600m-512"]
    assert (kw["num_layers"], kw["num_attention_heads"], kw["attention_head_dim"]) == (28, 36, 32)
    assert (kw["num_cross_attention_heads"], kw["cross_attention_head_dim"], kw["cross_attention_dim"]) == (16, 72, 1152)
    assert (kw["caption_channels"], kw["in_channels"], kw["patch_size"], kw["sample_size"]) == (2304, 32, 1, 16)
    kw = PRESETS["sana-1600m-1024"]
    assert (kw["num_layers"], kw["num_attention_heads"], kw["attention_head_dim"]) == (20, 70, 32)
    assert (kw["num_cross_attention_heads"], kw["cross_attention_head_dim"], kw["cross_attention_dim"]) == (20, 112, 2240)
    assert kw["sample_size"] == 32


def test_tiny_forward_and_overrides() -> None:
    model = build_model(ModelConfig(preset="tiny", overrides={"num_layers": 2}, gradient_checkpointing=True))
    assert len(model.transformer_blocks) == 2 and model.gradient_checkpointing and model.training
    out = model(torch.randn(2, 4, 8, 8), torch.randn(2, 5, 8), torch.tensor([10.0, 900.0]),
                encoder_attention_mask=torch.ones(2, 5), return_dict=False)[0]
    assert out.shape == (2, 4, 8, 8)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_override_is_user_error() -> None:
    with pytest.raises(UserError, match="model.overrides"):
        build_model(ModelConfig(preset="tiny", overrides={"num_heads": 3}))


def _saved_tiny(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = build_model(ModelConfig(preset="tiny"))
    model.save_pretrained(path)
    return model.state_dict()


def test_pretrained_local_dir(tmp_path: Path) -> None:
    want = _saved_tiny(tmp_path / "transformer")
    got = build_model(ModelConfig(pretrained=str(tmp_path / "transformer"))).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(UserError, match="model.pretrained"):
        build_model(ModelConfig(pretrained=str(tmp_path)))


def test_pretrained_from_s3(tmp_path: Path, s3_bucket: str) -> None:
    want = _saved_tiny(tmp_path / "transformer")
    for f in (tmp_path / "transformer").iterdir():
        s3.upload_file(f, f"s3://{s3_bucket}/models/tiny/{f.name}")
    cfg = ModelConfig(pretrained=f"s3://{s3_bucket}/models/tiny", pretrained_cache=str(tmp_path / "cache"))
    got = build_model(cfg).state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(preset="tiny", overrides={"num_layers": 2},
                                        gradient_checkpointing=checkpointing))
        torch.manual_seed(1)
        out = model(torch.randn(2, 4, 8, 8), torch.randn(2, 5, 8), torch.tensor([10.0, 900.0]),
                    encoder_attention_mask=torch.ones(2, 5), return_dict=False)[0]
        out.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


# ----- latents vs the transformer's sample_size (training/loop.py check_compatible) ----------
def _index(tmp_path: Path, latent_shape: tuple[int, int, int], text_dim: int = 8):
    from training.data.index import FeatureIndex
    from training.data.shards import write_synthetic_features

    write_synthetic_features(tmp_path, num_samples=2, latent_shape=latent_shape, text_dim=text_dim,
                             max_text_tokens=4)
    return FeatureIndex.load(tmp_path)


def test_latents_must_match_the_sample_size_sanapipeline_bins_by(tmp_path: Path) -> None:
    from training.loop import check_compatible

    cfg = ModelConfig(preset="sana-600m-512", overrides=dict(num_layers=1))
    model = build_model(cfg, device="meta")
    check_compatible(cfg, model, _index(tmp_path / "ok", (32, 16, 16), 2304))  # 512px: sample_size 16
    check_compatible(cfg, model, _index(tmp_path / "wide", (32, 12, 20), 2304))  # an aspect bucket, same area
    with pytest.raises(UserError) as err:
        check_compatible(cfg, model, _index(tmp_path / "big", (32, 32, 32), 2304))  # 1024px features
    msg = str(err.value)
    assert "\n" not in msg and "32x32 latents" in msg and "sample_size is 16" in msg
    assert "model.overrides.sample_size" in msg
    fixed = ModelConfig(preset="sana-600m-512", overrides=dict(num_layers=1, sample_size=32))
    check_compatible(fixed, build_model(fixed, device="meta"), _index(tmp_path / "big", (32, 32, 32), 2304))


def test_pretrained_mismatch_is_refused_and_tiny_only_warns(tmp_path: Path, caplog) -> None:
    from training.loop import check_compatible

    _saved_tiny(tmp_path / "transformer")
    index = _index(tmp_path / "f", (4, 8, 8))
    pretrained = ModelConfig(pretrained=str(tmp_path / "transformer"))
    with pytest.raises(UserError, match="sample_size is 32"):
        check_compatible(pretrained, build_model(pretrained), index)
    tiny = ModelConfig(preset="tiny")
    check_compatible(tiny, build_model(tiny), index)
    assert "8x8 latents but the model's sample_size is 32" in caplog.text
