"""LoRA fine-tuning (training/model/lora.py) through the real loop, PEFT and diffusers' own LoRA API.

The run: the tiny preset, 4 steps with adapters of rank 2, alpha 4 (scale 2, so a loader
that dropped alpha would compute a different model), EMA on, checkpoints at steps 2 and 4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.training.cpu_run import train_on_cpu
from training.checkpoint.export import main as export_main
from training.config import config_from_dict, load_yaml
from training.data.shards import write_synthetic_features
from training.errors import UserError
from training.model.build import ModelConfig, build_model
from training.model.lora import (
    LORA_FILE,
    MERGED_DIR,
    LoraConfig,
    apply_lora,
    is_adapter_key,
    merged_state_dict,
    to_diffusers_keys,
)

REPO = Path(__file__).resolve().parents[3]
RANK, ALPHA = 2, 4.0
GEN = dict(
    prompt="a red square on a white background",
    num_inference_steps=1,
    height=32,
    width=32,
    max_sequence_length=8,
    complex_human_instruction=None,
    use_resolution_binning=False,
    output_type="pt",
)


def lora_tree(base: Path, name: str, **top) -> dict:
    tree = load_yaml(REPO / "training/configs/tiny-cpu.yaml")
    tree.update({"max_steps": 4, "output_dir": str(base / name), "tensorboard": False, "log_every": 2, **top})
    tree["data"].update(path=str(base / "features"), prefetch=1)
    tree["optim"].update(warmup_steps=0, schedule="constant")  # cosine's horizon is max_steps
    tree["checkpoint"].update(every_steps=2, keep_last=3)
    tree["ema"] = {"decay": 0.5}
    tree["lora"] = {"rank": RANK, "alpha": ALPHA}
    tree["model"]["pretrained"] = str(base / "pretrained")
    return tree


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    write_synthetic_features(
        base / "features",
        num_samples=16,
        latent_shape=(4, 8, 8),
        text_dim=8,
        max_text_tokens=8,
        text_tokens=(1, 8),
    )
    # the "released" model the fine-tune starts from (sample_size = the features' 8x8 latents)
    torch.manual_seed(7)
    build_model(ModelConfig(preset="tiny", overrides={"sample_size": 8})).save_pretrained(base / "pretrained")
    result = train_on_cpu(config_from_dict(lora_tree(base, "run")))
    return base, result


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory) -> dict[str, Path]:
    """Tiny DC-AE, Gemma-2 and offline tokenizer directories (training/model/tiny.py)."""
    from training.model.tiny import build_tiny_components

    return build_tiny_components(tmp_path_factory.mktemp("parts"))


def tiny_pipeline(parts: dict[str, Path], transformer_dir: Path):
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import AutoTokenizer, Gemma2Model

    pipe = SanaPipeline(
        tokenizer=AutoTokenizer.from_pretrained(parts["tokenizer"]),
        text_encoder=Gemma2Model.from_pretrained(parts["text_encoder"]),
        vae=AutoencoderDC.from_pretrained(parts["vae"]),
        transformer=SanaTransformer2DModel.from_pretrained(transformer_dir),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pretrained_base(base: Path) -> torch.nn.Module:
    return build_model(ModelConfig(pretrained=str(base / "pretrained")))


def seeded_base() -> torch.nn.Module:
    """The base ``train`` builds for seed 0 (torch.manual_seed(seed), then build_model)."""
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny"))


def test_apply_lora_freezes_the_base_and_adapts_the_attention_projections():
    model = apply_lora(seeded_base(), LoraConfig(rank=RANK, alpha=ALPHA))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    adapted = {n.split(".lora_")[0] for n in trainable}
    # diffusers' Sana script default: to_q/to_k/to_v of self- (attn1) and cross-attention (attn2)
    assert adapted == {
        f"transformer_blocks.0.{a}.{m}" for a in ("attn1", "attn2") for m in ("to_q", "to_k", "to_v")
    }
    # PEFT scale alpha / r; B starts at zero so the model is unchanged at step 0
    assert model.transformer_blocks[0].attn1.to_q.scaling["default"] == ALPHA / RANK
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if ".lora_B." in n)
    untouched = apply_lora(seeded_base(), LoraConfig())  # rank 0: full fine-tuning
    assert all(p.requires_grad for p in untouched.parameters()) and not any(
        is_adapter_key(n) for n, _ in untouched.named_parameters()
    )


def test_lora_config_errors_name_the_key():
    tree = {"lora": {"rank": -1}}
    with pytest.raises(UserError, match="lora.rank"):
        config_from_dict(tree)
    with pytest.raises(UserError, match="lora.target_modules"):
        config_from_dict({"lora": {"rank": 2, "target_modules": []}})
    with pytest.raises(UserError, match="lora.target_modules"):
        apply_lora(seeded_base(), LoraConfig(rank=2, target_modules=["no_such_linear"]))


def test_only_adapters_train_and_reach_the_optimizer(lora_run):
    from training.backends.gpu import GpuBackend, GpuConfig
    from training.optim.factory import OptimConfig, optimizer_factory

    base, result = lora_run
    model = result.model
    before = pretrained_base(base).state_dict()
    for name, value in model.state_dict().items():
        if is_adapter_key(name):
            continue
        # every base weight (wrapped as ...base_layer.weight by PEFT) is bit-identical to the init
        assert torch.equal(value, before[name.replace(".base_layer.", ".")]), name
    lora_b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert all(torch.count_nonzero(p) > 0 for p in lora_b)  # the adapters did train
    backend = GpuBackend(GpuConfig())
    opt = backend.build_optimizer(model, optimizer_factory(OptimConfig(weight_decay=0.01), model))
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in model.named_parameters() if is_adapter_key(n)}


@pytest.mark.cpu_stress
def test_resume_is_bit_identical(lora_run):
    """2 steps, stop, resume to 4 == 4 straight steps, bit for bit (the adapters)."""
    base, straight = lora_run
    train_on_cpu(config_from_dict(lora_tree(base, "split", max_steps=2)))
    tree = lora_tree(base, "split")
    tree["checkpoint"]["resume"] = "auto"
    resumed = train_on_cpu(config_from_dict(tree))
    assert resumed.steps == 2
    # the checkpoint contract (training/checkpoint): trainable parameters only, no frozen base
    from training.checkpoint.consolidate import iter_full

    saved = [name for name, _ in iter_full(base / "split" / "checkpoints" / "step-00000002", "model")]
    assert saved and all(is_adapter_key(n) for n in saved)
    want = {n: p for n, p in straight.model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_export_writes_the_file_diffusers_loads(lora_run, tmp_path):
    from peft.utils import get_peft_model_state_dict

    base, result = lora_run
    export_main([str(base / "run"), "--out", str(tmp_path / "lora")])
    path = tmp_path / "lora" / LORA_FILE
    saved = load_file(path)
    # diffusers' layout: "transformer." + get_peft_model_state_dict's keys
    peft_sd = get_peft_model_state_dict(result.model)
    assert saved.keys() == {f"transformer.{k}" for k in peft_sd}
    for key, value in peft_sd.items():
        assert torch.equal(saved[f"transformer.{key}"], value), key
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert meta["transformer.r"] == RANK and meta["transformer.lora_alpha"] == ALPHA
    assert not (tmp_path / "lora" / MERGED_DIR).exists()
    assert json.loads((tmp_path / "lora" / "training_provenance.json").read_text())["lora"]["rank"] == RANK


def test_pipeline_with_the_exported_lora_changes_and_merged_equals_base_plus_adapter(
    lora_run, tiny_parts, tmp_path
):
    base, _ = lora_run
    export_main(
        [
            str(base / "run" / "checkpoints" / "step-00000004"),
            "--out",
            str(tmp_path / "exp"),
            "--lora-merge",
            "--ema",
        ]
    )
    pipe = tiny_pipeline(tiny_parts, base / "pretrained")
    plain = pipe(**GEN, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(tmp_path / "exp")
    assert pipe.transformer.transformer_blocks[0].attn1.to_q.scaling["default_0"] == ALPHA / RANK
    with_lora = pipe(**GEN, generator=torch.Generator().manual_seed(0)).images
    assert (tmp_path / "exp" / MERGED_DIR / "text_conditioning.json").exists()  # warn_if_unexpected reads it
    merged_pipe = tiny_pipeline(tiny_parts, tmp_path / "exp" / MERGED_DIR)
    merged = merged_pipe(**GEN, generator=torch.Generator().manual_seed(0)).images
    change = (with_lora - plain).abs().max().item()
    assert change > 1e-3  # the adapter does something
    assert (merged - with_lora).abs().max().item() < change * 1e-3  # fused weights == base + scaled adapter
    # and on the transformer alone, where nothing downstream can hide a difference
    torch.manual_seed(1)
    x, text, t = torch.randn(2, 4, 8, 8), torch.randn(2, 8, 8), torch.rand(2) * 1000
    with torch.no_grad():
        a = pipe.transformer(x, text, t).sample
        b = merged_pipe.transformer(x, text, t).sample
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_adapter_keys_and_merge_helpers():
    model = apply_lora(seeded_base(), LoraConfig(rank=RANK, alpha=ALPHA, init="default"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_()
    keys = to_diffusers_keys(model.state_dict())
    assert keys and all(".default." not in k for k in keys)
    merged = merged_state_dict(model)
    plain = seeded_base().state_dict()
    assert merged.keys() == plain.keys()
    q = model.transformer_blocks[0].attn1.to_q
    want = plain["transformer_blocks.0.attn1.to_q.weight"] + (ALPHA / RANK) * (
        q.lora_B["default"].weight @ q.lora_A["default"].weight
    )
    torch.testing.assert_close(merged["transformer_blocks.0.attn1.to_q.weight"], want)
    assert torch.equal(merged["proj_out.weight"], plain["proj_out.weight"])


def test_export_refuses_a_busy_out_dir(lora_run, tmp_path, capsys):
    base, _ = lora_run
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(SystemExit):
        export_main([str(base / "run"), "--out", str(tmp_path / "busy")])
    assert "--out" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "busy")


def test_bf16_mixed_fsdp_lora_step(lora_run, monkeypatch):
    """bf16-mixed under FSDP2 (one process) with full activation checkpointing, on a
    from-scratch base: the adapters compute in bf16 (autocast casts them
    as DDP does; FSDP gathers fp32), stay fp32 master weights and train; the frozen
    base stays the seeded init ``train`` builds."""
    import training.model.lora
    from training.model.lora import apply_lora as real_apply

    base, _ = lora_run
    seen: list[torch.dtype] = []

    def instrumented(model, cfg):
        model = real_apply(model, cfg)
        for name, module in model.named_modules():
            if name.endswith("lora_A.default"):
                module.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        return model

    monkeypatch.setattr(training.model.lora, "apply_lora", instrumented)
    tree = lora_tree(base, "bf16", max_steps=2, precision="bf16-mixed")
    tree["gpu"] = {"distributed": "fsdp"}
    del tree["model"]["pretrained"]
    tree["model"]["activation_checkpointing"] = "full"  # recomputed blocks still train the adapters
    tree["checkpoint"]["every_steps"] = 0
    result = train_on_cpu(config_from_dict(tree))
    assert seen and set(seen) == {torch.bfloat16}
    assert result.final_loss is not None and torch.isfinite(torch.tensor(result.final_loss))
    init = seeded_base().state_dict()
    for name, p in result.model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        assert local.dtype == torch.float32, name
        if is_adapter_key(name):
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(full.detach(), init[name.replace(".base_layer.", ".")]), name
    moved = [
        n for n, p in result.model.named_parameters() if ".lora_B." in n and p.full_tensor().abs().max() > 0
    ]
    assert len(moved) == 6


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_param_groups_drop_frozen_parameters(weight_decay):
    from training.optim.factory import OptimConfig, param_groups

    model = apply_lora(seeded_base(), LoraConfig(rank=RANK))
    groups = param_groups(model.parameters(), OptimConfig(weight_decay=weight_decay), model)
    grouped = {id(p) for g in groups for p in g["params"]}
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}


MID = dict(
    in_channels=16,
    out_channels=16,
    num_layers=2,
    num_attention_heads=8,
    attention_head_dim=32,
    num_cross_attention_heads=4,
    cross_attention_head_dim=64,
    cross_attention_dim=256,
    caption_channels=128,
    patch_size=2,
    sample_size=16,
)  # tests/training/model/test_flops.py's MID


def counted_lora_train_flops(kwargs: dict, text_tokens: int, hw: tuple[int, int], cfg: LoraConfig) -> float:
    """fwd+bwd FLOPs of a real LoRA-adapted SanaTransformer2DModel under FlopCounterMode, with
    the two corrections training/model/flops.py ``counted_train_flops_per_sample`` documents (math
    SDPA; a groups-aware convolution backward that honours output_mask)."""
    from diffusers import SanaTransformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

    def conv_backward(
        grad_out_shape, x_shape, w_shape, _b, _s, _p, _d, _t, _op, _g, output_mask, out_shape=None, **_kw
    ) -> int:
        return conv_flop_count(x_shape, w_shape, grad_out_shape) * (int(output_mask[0]) + int(output_mask[1]))

    torch.manual_seed(0)
    model = apply_lora(SanaTransformer2DModel(**kwargs), cfg)
    latents = torch.randn(1, kwargs["in_channels"], *hw)
    text = torch.randn(1, text_tokens, kwargs["caption_channels"])
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten.convolution_backward: conv_backward}
    )
    with sdpa_kernel(SDPBackend.MATH), counter:
        out = model(
            latents, text, torch.rand(1) * 1000, encoder_attention_mask=torch.ones(1, text_tokens)
        ).sample
        out.pow(2).mean().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("kwargs", "text_tokens", "hw"), [(MID, 40, (16, 16)), ({**MID, "num_layers": 4}, 24, (32, 32))]
)
def test_lora_flop_model_matches_the_counter(kwargs, text_tokens, hw):
    from training.model import flops
    from training.model.lora import train_flops_per_sample
    cfg = LoraConfig(rank=4)
    analytic = train_flops_per_sample(kwargs, text_tokens, hw, cfg=cfg)
    counted = counted_lora_train_flops(kwargs, text_tokens, hw, cfg)
    assert abs(analytic / counted - 1) <= 0.02, (analytic, counted)
    full = flops.train_flops_per_sample(kwargs, text_tokens, hw)
    assert analytic < 0.8 * full  # the 3x-forward count would overstate LoRA's MFU


def test_loop_counts_lora_flops(lora_run):
    """The loop's MFU numerator for a LoRA run is the LoRA FLOP model, not 3x the forward."""
    from training.model import flops
    from training.model.lora import train_flops_per_sample
    base, result = lora_run
    kwargs = dict(result.model.config)
    step = result.step_tokens[0]
    tokens = round(step.computed_text_tokens / step.samples)
    want = train_flops_per_sample(kwargs, tokens, (8, 8), cfg=LoraConfig(rank=RANK, alpha=ALPHA))
    assert step.computed_flops / step.samples == pytest.approx(want, rel=1e-9)
    assert want < 0.8 * flops.train_flops_per_sample(kwargs, tokens, (8, 8))


@pytest.mark.parametrize("targets", [["to_k", "to_q", "to_v"], ["to_q", "to_out.0"]])
def test_adapter_parameter_count_matches_peft(targets):
    from diffusers import SanaTransformer2DModel

    from training.model.lora import adapter_parameter_count

    cfg = LoraConfig(rank=3, target_modules=targets)
    model = apply_lora(SanaTransformer2DModel(**MID), cfg)
    assert adapter_parameter_count(MID, cfg) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_lora_merge_on_a_full_run_is_one_line(tmp_path, capsys):
    from training.checkpoint.lora_export import run_config

    base = tmp_path
    write_synthetic_features(
        base / "features", num_samples=8, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8
    )
    tree = lora_tree(base, "full", max_steps=1)
    del tree["lora"], tree["model"]["pretrained"]
    train_on_cpu(config_from_dict(tree))
    ckpt = base / "full" / "checkpoints" / "step-00000001"
    assert run_config(ckpt)["lora"]["rank"] == 0
    with pytest.raises(SystemExit) as exc:
        export_main([str(ckpt), "--out", str(tmp_path / "out"), "--lora-merge"])
    assert exc.value.code == 2 and "--lora-merge" in capsys.readouterr().err
