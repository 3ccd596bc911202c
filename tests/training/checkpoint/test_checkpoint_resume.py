"""SIGKILL real ``python -m training.gpu`` runs (tiny preset, CPU) mid-training and mid-checkpoint
write, resume them, and require the final state to be bit-identical to an uninterrupted run.
Also: the same run mirroring to the loopback S3 through the fault proxy, its node "lost", and
the resume pulled back from S3."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faultproxy import FaultProxy
from test_mirror import Watcher, dangling_manifests

from training.checkpoint.consolidate import load_full
from training.checkpoint.layout import FAULT_ENV, MANIFEST, find_latest, step_dir_name
from training.checkpoint.mirror import remote_checkpoints
from training.data.shards import write_synthetic_features

REPO = Path(__file__).resolve().parents[3]
MAX_STEPS = 20
EVERY = 4

pytestmark = pytest.mark.slow


def command(features: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "training.gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
            "--set", f"data.path={features}", "--set", f"checkpoint.every_steps={EVERY}",
            "--set", "checkpoint.keep_last=3", "--set", "ema.decay=0.9", "--set", "tensorboard=false",
            "--set", "data.prefetch=1", "--set", "objective.caption_dropout=0.3",
            "--max-steps", str(MAX_STEPS), "--output-dir", str(out), *extra]


def env(**extra: str) -> dict[str, str]:
    # One thread everywhere: the same reduction order in every run (bit-identity), and kind to
    # the shared CPUs.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def run(cmd: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env(**extra_env), capture_output=True, text=True, timeout=300)


def final_state(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    path = out / "checkpoints" / step_dir_name(MAX_STEPS)
    full = load_full(path)
    optim = full["optimizer"]
    return {"model": full["model"], "ema": full["ema"],
            "optim": {f"{name}/{k}": torch.as_tensor(v) for name, st in optim["state"].items()
                      for k, v in st.items()},
            "train_state": (path / "train_state.json").read_text()}


def assert_bit_identical(got: dict, want: dict) -> None:
    for part in ("model", "ema", "optim"):
        assert got[part].keys() == want[part].keys(), part
        for key in want[part]:
            assert torch.equal(got[part][key], want[part][key]), f"{part}: {key} differs"
    assert got["train_state"] == want["train_state"]  # step, samples, data position, schedule, config...


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=24, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8,
                             text_tokens=(1, 8))
    return out


@pytest.fixture(scope="module")
def reference(features, tmp_path_factory) -> dict:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    done = run(command(features, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return final_state(out)


def latest_step(out: Path) -> int:
    found = find_latest(out / "checkpoints")
    return int(found.name.split("-")[1]) if found else 0


@pytest.mark.cpu_stress
def test_sigkill_mid_training_and_mid_checkpoint_write_then_resume_is_bit_identical(features, reference,
                                                                                       tmp_path):
    out = tmp_path / "run"
    # The output_dir differs from the reference's, and train_state.json stores the config:
    # compare everything but that path.
    cmd = command(features, out)

    # 1. SIGKILL while training, as soon as the first checkpoint is complete.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = out / "checkpoints" / step_dir_name(EVERY) / MANIFEST
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    stderr = proc.communicate()[1]
    assert proc.returncode == -signal.SIGKILL, f"the run was not running any more:\n{stderr[-3000:]}"
    resumed_from = latest_step(out)
    assert EVERY <= resumed_from <= MAX_STEPS - 2 * EVERY

    # 2. SIGKILL inside the next checkpoint write (in the background writer), after the shard
    #    file, before the done record and the manifest.
    target = resumed_from + EVERY
    done = run(cmd, **{FAULT_ENV: f"{target}:after-shard"})
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / step_dir_name(resumed_from)}" in done.stderr
    tmp = out / "checkpoints" / f".tmp-step-{target:08d}"
    assert (tmp / "shard-rank-00000.safetensors").exists() and not (tmp / "rank-00000.done.json").exists()
    assert not (tmp / MANIFEST).exists()
    assert not (out / "checkpoints" / step_dir_name(target)).exists()
    assert latest_step(out) == resumed_from

    # 3. SIGKILL with the manifest written but the directory not yet renamed into place.
    done = run(cmd, **{FAULT_ENV: f"{target}:before-rename"})
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert (tmp / MANIFEST).exists() and latest_step(out) == resumed_from

    # 4. Resume to the end. The temp dir of step 3 holds a complete manifest: the start finishes
    #    its rename (what the killed commit was about to do) and resumes from it.
    done = run(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"finished the commit of {out / 'checkpoints' / step_dir_name(target)}" in done.stderr
    assert f"resumed from {out / 'checkpoints' / step_dir_name(target)}" in done.stderr
    got = final_state(out)
    got["train_state"] = got["train_state"].replace(str(out), "<out>")
    assert_bit_identical(got, {**reference, "train_state": _relative(reference["train_state"])})
    assert not list((out / "checkpoints").glob(".tmp-*"))


def _relative(train_state: str) -> str:
    import json

    output_dir = json.loads(train_state)["config"]["output_dir"]
    return train_state.replace(output_dir, "<out>")


def test_mirror_through_faults_then_resume_from_s3_after_losing_the_node(features, reference, tmp_path,
                                                                         s3_endpoint, s3_bucket):
    out = tmp_path / "run"
    url = f"s3://{s3_bucket}/runs/tiny"
    cmd = command(features, out, "--set", f"checkpoint.s3_mirror={url}")
    with FaultProxy(s3_endpoint, error_rate=0.15, drop_rate=0.1, max_faults=30, seed=3) as proxy, \
            Watcher(s3_bucket, "runs/tiny", s3_endpoint) as watcher:
        # SIGKILL the run as soon as a first checkpoint is complete on S3 (the upload runs in the
        # background while training goes on).
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(AWS_ENDPOINT_URL_S3=proxy.url), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while not remote_checkpoints(url) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        stderr = proc.communicate()[1]
        assert proc.returncode == -signal.SIGKILL, f"the run was not running any more:\n{stderr[-3000:]}"
    assert watcher.polls > 0 and watcher.problems == []
    assert dangling_manifests(s3_bucket, "runs/tiny", s3_endpoint) == []
    mirrored = remote_checkpoints(url)
    print("faults:", dict(proxy.stats), "on S3:", mirrored)
    assert mirrored and mirrored[-1] < MAX_STEPS

    shutil.rmtree(out)  # the replacement node starts with an empty local checkpoint dir
    with FaultProxy(s3_endpoint, error_rate=0.15, drop_rate=0.1, max_faults=30, seed=4) as proxy, \
            Watcher(s3_bucket, "runs/tiny", s3_endpoint) as watcher:
        done = run(cmd, AWS_ENDPOINT_URL_S3=proxy.url)
        assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / step_dir_name(mirrored[-1])}" in done.stderr
    assert watcher.problems == [] and dangling_manifests(s3_bucket, "runs/tiny", s3_endpoint) == []
    assert remote_checkpoints(url)[-1] == MAX_STEPS  # close() waited for the last upload
    got = final_state(out)
    got["train_state"] = _relative(got["train_state"])
    want = {**reference, "train_state": _relative(reference["train_state"])}
    # The mirror URL is part of this run's config only.
    got["train_state"] = got["train_state"].replace(f'"{url}"', "null")
    assert_bit_identical(got, want)


def test_two_ranks_killed_mid_write_resume_bit_identical(features, tmp_path):
    """torchrun, 2 CPU ranks (gloo, DDP): rank 0 is SIGKILLed inside a checkpoint write while
    rank 1 waits at the barrier; the resumed job ends bit-identical to an uninterrupted one
    (every rank restores its own RNG file)."""

    def torchrun(out: Path, **extra_env: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               *command(features, out, "--max-steps", "8")[1:]]
        return run(cmd, **extra_env)

    ref = torchrun(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    done = torchrun(out, **{FAULT_ENV: "8:before-manifest"})  # every rank done, rank 0 dies before the manifest
    assert done.returncode != 0
    assert (out / "checkpoints" / ".tmp-step-00000008" / "rank-00001.done.json").exists()
    assert latest_step(out) == 4
    done = torchrun(out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    want, got = (load_full(root / "checkpoints" / "step-00000008") for root in (tmp_path / "ref", out))
    for part in ("model", "ema"):
        assert want[part].keys() == got[part].keys(), part
        assert all(torch.equal(want[part][k], got[part][k]) for k in want[part]), part
