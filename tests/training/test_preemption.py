"""SIGTERM (what scancel, a time limit and HyperPod's restarts send) makes a real
``python -m training.gpu`` run save a checkpoint at the next logging step and exit 143; the
resumed run ends bit-identical to one that was never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from training.checkpoint import find_latest, step_dir_name, verify
from training.checkpoint.consolidate import load_full
from training.data import write_synthetic_features

REPO = Path(__file__).resolve().parents[2]
LOG_EVERY = 5

pytestmark = pytest.mark.slow


def command(features: Path, out: Path, max_steps: int) -> list[str]:
    # Constant LR: the schedule must not depend on max_steps, which differs between the runs.
    return [sys.executable, "-m", "training.gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
            "--set", f"data.path={features}", "--set", "checkpoint.every_steps=100000",
            "--set", "optim.schedule=constant", "--set", "tensorboard=false", "--set", f"log_every={LOG_EVERY}",
            "--max-steps", str(max_steps), "--output-dir", str(out)]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    full = load_full(ckpt)
    optim = full["optimizer"]
    return {**{f"model/{k}": v for k, v in full["model"].items()},
            **{f"optim/{name}/{k}": torch.as_tensor(v) for name, st in optim["state"].items()
               for k, v in st.items()}}


def test_sigterm_saves_at_the_next_logging_step_and_resume_is_bit_identical(tmp_path: Path) -> None:
    features = tmp_path / "features"
    write_synthetic_features(features, num_samples=24, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8,
                             text_tokens=(1, 8))
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(command(features, stopped, 100_000), cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not any(step >= 2 * LOG_EVERY for step in logged_steps(stopped)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never logged a step"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM received: saving a checkpoint and stopping" in stderr

    ckpt = find_latest(stopped / "checkpoints")
    assert ckpt is not None and verify(ckpt) is not None, "no complete checkpoint after SIGTERM"
    step = int(ckpt.name.split("-")[1])
    assert step % LOG_EVERY == 0 and step >= 2 * LOG_EVERY, step  # saved at a logging step, not later

    final = step + LOG_EVERY
    resumed = subprocess.run([*command(features, stopped, final), "--resume", "auto"], cwd=REPO, env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = tmp_path / "reference"
    straight = subprocess.run(command(features, reference, final), cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-3000:]

    got = tensors(stopped / "checkpoints" / step_dir_name(final))
    want = tensors(reference / "checkpoints" / step_dir_name(final))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs after the SIGTERM stop and resume"
