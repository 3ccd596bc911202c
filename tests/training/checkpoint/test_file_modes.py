"""What the package writes for others to read takes its mode from the user's umask, as a file
``open()`` creates would: 0644 under 022, 0640 under 027 (training/files). safetensors'
``save_file`` alone writes 0600 whatever the umask, so without this a colleague in the
cluster group cannot read an exported model, a checkpoint or a feature directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.training.cpu_run import train_on_cpu
from training.checkpoint.export import main as export_main
from training.config import config_from_dict
from training.data.precompute import main as precompute
from training.data.shards import write_synthetic_features
from training.model.tiny import TINY_RESOLUTION, build_tiny_components, write_image_caption_folder


@pytest.fixture(params=[0o022, 0o027], ids=["umask-022", "umask-027"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


def test_safetensors_alone_ignores_the_umask(tmp_path, umask):
    """The premise, on the pinned safetensors: save_file makes 0600 whatever the umask."""
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o600


def _train(features: Path, out: Path, **top) -> Path:
    tree = {"model": {"preset": "tiny"}, "data": {"path": str(features), "batch_size": 2, "prefetch": 0},
            "checkpoint": {"every_steps": 0, "format": "full"}, "max_steps": 1, "output_dir": str(out),
            "tensorboard": False, **top}
    return train_on_cpu(config_from_dict(tree)).checkpoint


def test_checkpoints_and_exports_follow_the_umask(tmp_path, umask):
    want = 0o666 & ~umask
    write_synthetic_features(tmp_path / "features", num_samples=4, latent_shape=(4, 8, 8), text_dim=8,
                             max_text_tokens=8)
    full = _train(tmp_path / "features", tmp_path / "full")  # sana-checkpoint/1: model.safetensors via save_file
    lora = _train(tmp_path / "features", tmp_path / "lora", lora={"rank": 2})
    export_main([str(full), "--out", str(tmp_path / "export")])
    export_main([str(lora), "--out", str(tmp_path / "export-lora"), "--lora-merge"])
    files = {**{f"full/{k}": v for k, v in modes(full).items()},
             **{f"export/{k}": v for k, v in modes(tmp_path / "export").items()},
             **{f"export-lora/{k}": v for k, v in modes(tmp_path / "export-lora").items()}}
    for name in ("full/model.safetensors", "export/diffusion_pytorch_model.safetensors",
                 "export-lora/pytorch_lora_weights.safetensors",
                 "export-lora/transformer/diffusion_pytorch_model.safetensors"):
        assert name in files
    assert {k: v for k, v in files.items() if v != want} == {}, oct(want)


def test_precomputed_validation_prompts_follow_the_umask(tmp_path, umask):
    models = build_tiny_components(tmp_path / "models")
    write_image_caption_folder(tmp_path / "raw", num=2, seed=1)
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    precompute(["--input", str(tmp_path / "raw"), "--out", str(tmp_path / "features"), "--vae", str(models["vae"]),
                "--text-encoder", str(models["text_encoder"]), "--tokenizer", str(models["tokenizer"]),
                "--resolution", str(TINY_RESOLUTION), "--max-text-tokens", "8", "--device", "cpu",
                "--dtype", "fp32", "--validation-prompts", str(tmp_path / "prompts.txt")])
    files = modes(tmp_path / "features")
    assert "validation_prompts.safetensors" in files
    assert {k: v for k, v in files.items() if v != 0o666 & ~umask} == {}
