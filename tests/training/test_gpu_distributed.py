"""Real multi-process data parallelism on CPU (gloo, torchrun): DDP and FSDP2.

Two ranks with batch B each must end where one process with batch 2B ends: the loader gives
rank r the r-th slice of the same global batch and the objective draws noise for the global
batch and slices it (training/objective.py), so the only difference is floating-point
summation order in the all-reduce. Tolerance: 2e-6 absolute on parameters after 4 AdamW
steps at lr 1e-3 (an AdamW step moves a weight by up to ~1e-3; measured differences are
~3e-8). One exception: the cross-attention key bias has an exactly-zero true gradient
(softmax ignores a bias shared by all keys), so its gradient is pure rounding noise that
AdamW normalises into steps of up to lr; there the bound is lr * steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.data import write_synthetic_features

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
STEPS = 4
LR = 1e-3
ATOL = 2e-6
ZERO_GRAD = {"transformer_blocks.0.attn2.to_k.bias"}


def launch(tmp: Path, name: str, nproc: int, batch: int, *extra: str) -> list[dict]:
    out = tmp / name
    args = [sys.executable]
    if nproc > 1:
        args += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    args += [str(WORKER), "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
             "--set", f"data.path={tmp / 'features'}", "--set", f"data.batch_size={batch}",
             "--set", "optim.warmup_steps=0", "--set", f"optim.lr={LR}", "--set", "checkpoint.every_steps=0",
             "--set", "tensorboard=false", "--set", "log_every=2", "--set", "objective.caption_dropout=0.5",
             "--set", "ema.decay=0.9",
             "--max-steps", str(STEPS), "--output-dir", str(out / "run"), "--dump", str(out / "dump"), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / "dump" / f"rank-{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("dist")
    write_synthetic_features(tmp / "features", num_samples=32, latent_shape=(4, 8, 8), text_dim=8,
                             max_text_tokens=8, samples_per_shard=16)
    return tmp, {"single": launch(tmp, "single", 1, 4)}


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key].float() - b[key].float()).abs().max().item()
        assert diff <= (LR * STEPS if key in ZERO_GRAD else ATOL), (key, diff)


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_process_with_double_batch(runs) -> None:
    tmp, ref = runs
    ranks = launch(tmp, "ddp", 2, 2)
    for key, value in ranks[0]["local"].items():  # replicas are bit-identical
        assert torch.equal(value, ranks[1]["local"][key]), key
    assert ranks[1]["full"] == {}  # full state dicts come from rank 0 only
    assert_close(ranks[0]["full"], ref["single"][0]["full"])
    assert ranks[0]["describe"]["world_size"] == 2


@pytest.mark.slow
def test_fsdp_two_ranks_equal_one_process_with_double_batch(runs) -> None:
    tmp, ref = runs
    ranks = launch(tmp, "fsdp", 2, 2, "--set", "gpu.distributed=fsdp")
    assert ranks[0]["describe"]["distributed"] == "fsdp"
    assert_close(ranks[0]["full"], ref["single"][0]["full"])
    # Each rank holds its own shard: together they are the full parameter.
    name = "proj_out.weight"
    stitched = torch.cat([ranks[0]["local"][name], ranks[1]["local"][name]])
    torch.testing.assert_close(stitched, ranks[0]["full"][name], rtol=0, atol=0)
