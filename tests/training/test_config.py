"""TrainConfig: the shipped YAML files load, overrides apply, mistakes are one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from training.config import TrainConfig, config_from_dict, load_config
from training.errors import UserError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "training" / "configs").glob("*.yaml"))


def test_shipped_configs_load() -> None:
    names = {p.stem for p in CONFIGS}
    assert {"tiny-cpu", "sana-600m-512", "sana-1600m-1024"} <= names
    for path in CONFIGS:
        cfg = load_config(["--config", str(path)])
        assert isinstance(cfg, TrainConfig)
    big = load_config(["--config", str(REPO / "training/configs/sana-1600m-1024.yaml")])
    assert big.gpu.distributed == "fsdp" and big.precision == "bf16-mixed"


def test_overrides_and_common_flags() -> None:
    cfg = load_config(["--config", str(REPO / "training/configs/tiny-cpu.yaml"),
                       "--set", "optim.lr=2e-4", "--set", "optim.betas=[0.8, 0.9]",
                       "--set", "model.overrides={num_layers: 2}", "--set", "gpu.distributed=fsdp",
                       "--resume", "none", "--max-steps", "7", "--output-dir", "/tmp/x"])
    assert cfg.optim.lr == 2e-4 and cfg.optim.betas == (0.8, 0.9)
    assert cfg.model.model_kwargs()["num_layers"] == 2
    assert cfg.gpu.distributed == "fsdp"
    assert (cfg.checkpoint.resume, cfg.max_steps, cfg.output_dir) == ("none", 7, "/tmp/x")
    assert isinstance(config_from_dict({"optim": {"lr": 1}}).optim.lr, float)  # YAML int -> float


@pytest.mark.parametrize(("tree", "key"), [
    ({"optim": {"lrr": 1.0}}, "optim.lrr"),
    ({"optim": {"lr": -1.0}}, "optim.lr"),
    ({"optim": {"lr": "fast"}}, "optim.lr"),
    ({"optim": {"schedule": "linear"}}, "optim.schedule"),
    ({"model": {"preset": "sana-9b"}}, "model.preset"),
    ({"precision": "fp16"}, "precision"),
    ({"gpu": {"distributed": "zero3"}}, "gpu.distributed"),
    ({"objective": {"caption_dropout": 2.0}}, "objective.caption_dropout"),
    ({"ema": {"decay": 1.5}}, "ema.decay"),
    ({"data": {"batch_size": 0}}, "data.batch_size"),
    ({"max_steps": 0}, "max_steps"),
    ({"tensorboard": "yes"}, "tensorboard"),
    ({"optim": 3}, "optim"),
])
def test_bad_config_names_the_key(tree: dict, key: str) -> None:
    with pytest.raises(UserError) as info:
        config_from_dict(tree)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"config key {key}"), message


def test_cli_bad_key_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "training.gpu", "--config",
                           str(REPO / "training/configs/tiny-cpu.yaml"), "--set", "optim.warmup=5"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # exactly one line
    assert proc.stderr.startswith("error: config key optim.warmup: unknown"), proc.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--config"):
        load_config(["--config", str(tmp_path / "nope.yaml")])
