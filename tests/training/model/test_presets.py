"""The 1024/2048 presets and their configs: shapes on the meta device, Sana's settings, FLOPs.

Sources: NVlabs Sana configs/sana_config/1024ms/Sana_600M_img1024.yaml and
2048ms/Sana_1600M_img2048_bf16.yaml (flow_shift 4.0 / 3.0, use_pe false / true,
train_batch_size 64 / 4, grad_checkpointing true, gradient_clip 0.1, CAMEWrapper lr 1e-4,
model_max_length 300); diffusers scripts/convert_sana_to_diffusers.py (sample_size =
image_size // 32, interpolation_scale {1024: None, 2048: 1.0}).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from training.config import config_from_dict, load_yaml
from training.model import flops
from training.model.build import PRESETS, ModelConfig, build_model, count_parameters

REPO = Path(__file__).resolve().parents[3]
SANA = {
    # preset: (parameters in M, latent side, positional embedding, config file, flow shift, batch)
    "sana-600m-1024": (591.7, 32, False, "sana-600m-1024.yaml", 4.0, 64),
    "sana-1600m-2048": (1604.5, 64, True, "sana-1600m-2048.yaml", 3.0, 4),
}


@pytest.mark.parametrize("preset", sorted(SANA))
def test_preset_on_the_meta_device(preset):
    millions, side, use_pe, *_ = SANA[preset]
    model = build_model(ModelConfig(preset=preset), device="meta")
    assert round(count_parameters(model) / 1e6, 1) == millions  # same shapes as the 512/1024 models
    assert model.config.sample_size == side
    assert (getattr(model.patch_embed, "pos_embed", None) is not None) == use_pe


@pytest.mark.parametrize("preset", sorted(SANA))
def test_config_carries_sanas_settings(preset):
    *_, file, shift, batch = SANA[preset]
    cfg = config_from_dict(load_yaml(REPO / "training/configs" / file))
    assert cfg.model.preset == preset
    assert cfg.objective.flow_shift == shift and cfg.data.batch_size == batch
    assert cfg.model.activation_checkpointing != "none"
    assert cfg.optim.name == "came" and cfg.optim.lr == 1e-4 and cfg.optim.max_grad_norm == 0.1
    assert cfg.precision == "bf16-mixed"
    assert cfg.gpu.distributed == ("fsdp" if "1600m" in preset else "ddp")


@pytest.mark.parametrize("preset", sorted(SANA))
def test_flop_model_covers_the_preset(preset):
    side = SANA[preset][1]
    analytic = flops.train_flops_per_sample(PRESETS[preset], 300, (side, side))
    counted = flops.counted_train_flops_per_sample(PRESETS[preset], 300, (side, side), device="meta")
    assert abs(analytic / counted - 1) <= 0.05
    # 4x the image tokens of the lower-resolution sibling: more than 2.5x the FLOPs (linear
    # attention and FFN scale with tokens; only the text terms do not)
    lower = {"sana-600m-1024": ("sana-600m-512", 16), "sana-1600m-2048": ("sana-1600m-1024", 32)}[preset]
    assert analytic > 2.5 * flops.train_flops_per_sample(PRESETS[lower[0]], 300, (lower[1], lower[1]))


#: NVlabs Sana configs/sana_config/*: the recipe keys every preset trains with, per Sana config
#: (train.optimizer, lr_schedule(_args), gradient_clip, save_model_steps, scheduler.flow_shift /
#: weighting_scheme / vis_sampler, model.class_dropout_prob / multi_scale / aspect_ratio_type)
SANA_RECIPE = {
    "512ms/Sana_600M_img512.yaml": dict(flow_shift=3.0, table="512"),
    "1024ms/Sana_600M_img1024.yaml": dict(flow_shift=4.0, table="1024"),
    "1024ms/Sana_1600M_img1024.yaml": dict(flow_shift=3.0, table="1024"),
    "2048ms/Sana_1600M_img2048_bf16.yaml": dict(flow_shift=3.0, table="2048"),
}
PRESET_SOURCE = {
    "sana-600m-512.yaml": "512ms/Sana_600M_img512.yaml", "trn-sana-600m-512.yaml": "512ms/Sana_600M_img512.yaml",
    "sana-600m-1024.yaml": "1024ms/Sana_600M_img1024.yaml",
    "sana-1600m-1024.yaml": "1024ms/Sana_1600M_img1024.yaml",
    "trn-sana-1600m-1024.yaml": "1024ms/Sana_1600M_img1024.yaml",
    "sana-1600m-2048.yaml": "2048ms/Sana_1600M_img2048_bf16.yaml",
}


@pytest.mark.parametrize("file", sorted(PRESET_SOURCE))
def test_every_preset_trains_sanas_recipe_and_cites_its_config(file):
    source = PRESET_SOURCE[file]
    text = (REPO / "training/configs" / file).read_text()
    assert f"configs/sana_config/{source}" in text
    cfg = config_from_dict(load_yaml(REPO / "training/configs" / file))
    o = cfg.optim  # CAMEWrapper, betas [0.9, 0.999, 0.9999], eps [1e-30, 1e-16], lr 1e-4, wd 0.0
    assert (o.name, o.betas, o.eps, o.lr, o.weight_decay) == ("came", (0.9, 0.999, 0.9999), (1e-30, 1e-16), 1e-4, 0.0)
    assert (o.warmup_steps, o.schedule, o.max_grad_norm) == (2000, "constant", 0.1)
    recipe = SANA_RECIPE[source]
    assert cfg.objective.flow_shift == recipe["flow_shift"] and cfg.objective.caption_dropout == 0.1
    assert (cfg.objective.logit_mean, cfg.objective.logit_std) == (0.0, 1.0)
    assert cfg.data.multi_scale  # multi_scale: true; the features come from precompute --buckets <table>
    assert cfg.validation.sampler == "flow_dpm-solver"
    assert cfg.checkpoint.every_steps == 500 and cfg.log_every == 20
    if not file.startswith("trn-"):
        assert not cfg.gpu.tf32  # the fp32 linear attention stays IEEE fp32, as in Sana
        assert cfg.validation.every_steps == 500 and cfg.validation.guidance_scale == 4.5
