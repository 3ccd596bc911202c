"""Export a real checkpoint (the loop on the tiny preset) to diffusers, load it with
``SanaTransformer2DModel.from_pretrained`` and generate an image with it in a ``SanaPipeline``
built offline: tiny AutoencoderDC, tiny Gemma2Model, WordLevel tokenizer trained here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.training.cpu_run import train_on_cpu
from training.checkpoint.consolidate import iter_full
from training.checkpoint.export import main
from training.config import config_from_dict, load_yaml
from training.data.shards import write_synthetic_features

REPO = Path(__file__).resolve().parents[3]
CAPTIONS = ["a red square on a white background", "a blue circle in the sky", "a green tree by a lake",
            "a small yellow house", "an empty grey room"]


def _train(tmp_path_factory, fmt: str) -> Path:
    base = tmp_path_factory.mktemp(f"export-{fmt}")
    write_synthetic_features(base / "features", num_samples=8, latent_shape=(4, 8, 8), text_dim=8,
                             max_text_tokens=8, text_tokens=(1, 8))
    tree = load_yaml(REPO / "training/configs/tiny-cpu.yaml")
    tree.update(max_steps=4, output_dir=str(base / "run"), tensorboard=False, log_every=2)
    tree["data"].update(path=str(base / "features"), prefetch=1)
    tree["checkpoint"].update(every_steps=2, format=fmt)
    tree["ema"] = {"decay": 0.5}
    cfg = config_from_dict(tree)
    train_on_cpu(cfg)
    return base / "run"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Four steps of the real loop with EMA, checkpointed (sharded) at 2 and 4."""
    return _train(tmp_path_factory, "sharded")


def test_export_reads_the_old_single_file_format_too(run_dir, tmp_path_factory, tmp_path):
    """The same run saved as sana-checkpoint/1 exports to the same diffusers weights."""
    old_run = _train(tmp_path_factory, "full")
    assert (old_run / "checkpoints" / "step-00000004" / "model.safetensors").exists()
    for args, name in (([], "raw"), (["--ema"], "ema")):
        main([str(old_run), "--out", str(tmp_path / f"old-{name}"), *args])
        main([str(run_dir), "--out", str(tmp_path / f"new-{name}"), *args])
        old = load_file(tmp_path / f"old-{name}" / "diffusion_pytorch_model.safetensors")
        new = load_file(tmp_path / f"new-{name}" / "diffusion_pytorch_model.safetensors")
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old), name


def test_export_loads_with_from_pretrained_and_matches_the_checkpoint(run_dir, tmp_path, capsys):
    from diffusers import SanaTransformer2DModel

    main([str(run_dir), "--out", str(tmp_path / "raw")])  # a run dir: its newest checkpoint
    assert json.loads(capsys.readouterr().out)["checkpoint"].endswith("step-00000004")
    main([str(run_dir / "checkpoints" / "step-00000004"), "--out", str(tmp_path / "ema"), "--ema"])
    ckpt = run_dir / "checkpoints" / "step-00000004"
    for name, source in (("raw", "model"), ("ema", "ema")):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [
            "config.json", "diffusion_pytorch_model.safetensors", "text_conditioning.json",
            "training_provenance.json"]
        model = SanaTransformer2DModel.from_pretrained(tmp_path / name)
        want = dict(iter_full(ckpt, source))  # consolidated from the rank shards
        got = model.state_dict()
        assert want.keys() <= got.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value), key
        provenance = json.loads((tmp_path / name / "training_provenance.json").read_text())
        assert provenance["step"] == 4 and provenance["weights"] == ("ema" if name == "ema" else "model")
        # the run's provenance comes along; synthetic features record no text conditioning
        assert provenance["provenance"]["text_conditioning"]["chi"] == "unknown"
        assert json.loads((tmp_path / name / "text_conditioning.json").read_text())["chi"] == "unknown"
    raw = load_file(tmp_path / "raw" / "diffusion_pytorch_model.safetensors")
    ema = load_file(tmp_path / "ema" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(raw[k], ema[k]) for k in raw)  # really two different weight sets

    main([str(ckpt), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"])
    bf16 = load_file(tmp_path / "bf16" / "diffusion_pytorch_model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def tiny_pipeline(transformer_dir: Path):
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Gemma2Config, Gemma2Model, PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CAPTIONS, trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<bos>", eos_token="<eos>")
    torch.manual_seed(0)
    text_encoder = Gemma2Model(Gemma2Config(
        head_dim=16, hidden_size=8, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1,
        num_key_value_heads=2, vocab_size=tokenizer.vocab_size, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, attn_implementation="eager"))
    # diffusers' own SanaPipeline test VAE: 2 blocks of 8 channels fit 4 latent channels, /2 spatially.
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"), decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407)
    transformer = SanaTransformer2DModel.from_pretrained(transformer_dir)
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def test_exported_transformer_drops_into_sana_pipeline_and_makes_an_image(run_dir, tmp_path):
    main([str(run_dir), "--out", str(tmp_path / "transformer"), "--ema"])
    pipe = tiny_pipeline(tmp_path / "transformer")
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a red square in the sky", negative_prompt="", num_inference_steps=2, guidance_scale=4.5,
               height=32, width=32, max_sequence_length=8, complex_human_instruction=None,
               use_resolution_binning=False, output_type="pt", generator=torch.Generator().manual_seed(0))
    image = out.images
    assert image.shape == (1, 3, 32, 32)
    assert torch.isfinite(image).all() and image.min() >= 0.0 and image.max() <= 1.0
    assert image.std() > 0  # not a constant frame
    pil = pipe(prompt=CAPTIONS[0], num_inference_steps=1, height=32, width=32, max_sequence_length=8,
               complex_human_instruction=None, use_resolution_binning=False,
               generator=torch.Generator().manual_seed(0)).images[0]
    assert pil.size == (32, 32)
    # And the whole pipeline round-trips through save_pretrained / from_pretrained offline.
    pipe.save_pretrained(tmp_path / "pipeline")
    from diffusers import SanaPipeline

    again = SanaPipeline.from_pretrained(tmp_path / "pipeline")
    assert again.transformer.config.num_layers == 1


def test_export_errors_are_one_line(run_dir, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_dir / "checkpoints" / "step-00000004", ckpt)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main([str(ckpt), "--out", str(tmp_path / "busy")])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
    (ckpt / "shard-rank-00000.safetensors").unlink()
    with pytest.raises(SystemExit):
        main([str(ckpt), "--out", str(tmp_path / "x")])  # manifest lists the shard
    assert "do not match manifest.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing"), "--out", str(tmp_path / "y")])
    assert "no complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
