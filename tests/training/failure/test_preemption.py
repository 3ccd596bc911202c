"""SIGTERM (what scancel, a time limit and HyperPod's restarts send) makes a real
``python -m training.gpu`` run save a checkpoint within two steps and exit 143; the resumed run
ends bit-identical to one that was never stopped. With two ranks, a signal that reaches only
rank 1 during step k stops both ranks after saving step k + 1 (the host-side exchange every
step, training/failure/preemption.py), however far the next logging step is."""

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

from training.checkpoint.consolidate import load_full
from training.checkpoint.layout import find_latest, step_dir_name, verify
from training.data.shards import write_synthetic_features

REPO = Path(__file__).resolve().parents[3]
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
    assert step >= 2 * LOG_EVERY, step

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


@pytest.mark.parametrize("sig", ["sigterm", "sigusr1"])
def test_a_signal_on_one_rank_stops_every_rank_at_the_next_step(tmp_path: Path, sig: str) -> None:
    """Rank 1 alone gets the signal as step 4 starts (training/smoke/drill.py): both ranks
    agree at the end of step 5, save step 5 and exit 128 + signal; logging is every 1000 steps."""
    from tests.training.ranks import launch_ranks
    from training.smoke.drill import FAULTS_ENV

    features = tmp_path / "features"
    write_synthetic_features(features, num_samples=24, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8,
                             text_tokens=(1, 8))
    out = tmp_path / "run"
    args = command(features, out, 100)[3:]  # the training.gpu arguments
    args[args.index(f"log_every={LOG_EVERY}")] = "log_every=1000"
    ranks = launch_ranks(2, ["-m", "training.smoke.drill", *args], **{FAULTS_ENV: f"{sig}:1:4"})
    signum = signal.SIGTERM if sig == "sigterm" else signal.SIGUSR1
    assert ranks.codes == {0: 128 + signum, 1: 128 + signum}, ranks.outputs
    assert f"{signal.Signals(signum).name} received: saving a checkpoint and stopping" in ranks.outputs[0]
    assert find_latest(out / "checkpoints") == out / "checkpoints" / step_dir_name(5)
    assert verify(out / "checkpoints" / step_dir_name(5)) is not None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [step_dir_name(5)]
