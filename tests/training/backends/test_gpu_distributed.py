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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.data.shards import write_synthetic_features

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parents[1] / "dist_worker.py"
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
    # gradient_as_bucket_view: the gradients are views into DDP's buckets (no second copy)
    assert ranks[0]["grads"] > 10 and ranks[0]["grad_storages"] <= 2, (ranks[0]["grads"], ranks[0]["grad_storages"])


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


@pytest.mark.slow
def test_hsdp_2x2_mesh_equals_one_process_with_the_global_batch(runs) -> None:
    """HSDP on 4 gloo ranks as 2 "nodes" x 2: shard within a pair, replicate across pairs. Same
    global batch as one process (which DDP matches, test above), with 2 accumulated
    micro-batches so the no-sync path (gradient sync off for the first) runs: same loss and
    weights."""
    tmp, _ = runs
    accum = ("--set", "optim.grad_accum_steps=2")
    ref = launch(tmp, "single-accum", 1, 4, *accum)[0]
    ranks = launch(tmp, "hsdp", 4, 1, "--set", "gpu.distributed=hsdp", "--set", "gpu.shard_group_size=2", *accum)
    assert ranks[0]["describe"]["mesh"] == {"replicate": 2, "shard": 2}
    assert_close(ranks[0]["full"], ref["full"])
    # each rank logs the loss of its own slice: their mean is the global batch's loss
    assert sum(r["loss"] for r in ranks) / 4 == pytest.approx(ref["loss"], rel=1e-5)
    name = "proj_out.weight"
    # ranks 0,1 (node 0) hold the two halves; rank 2 (node 1) holds rank 0's half again
    stitched = torch.cat([ranks[0]["local"][name], ranks[1]["local"][name]])
    torch.testing.assert_close(stitched, ranks[0]["full"][name], rtol=0, atol=0)
    assert torch.equal(ranks[2]["local"][name], ranks[0]["local"][name])
    assert ranks[0]["local"][name].shape[0] * 2 == ranks[0]["full"][name].shape[0]


@pytest.mark.slow
def test_ddp_bf16_gradient_compression_runs_and_stays_close(runs) -> None:
    """gpu.ddp_grad_compression=bf16: gradients all-reduced in bf16 (~3 significant digits) move
    AdamW's weights by a little: not the fp32 result bit for bit, but close. AdamW normalises
    each element's step, so an element whose gradient is ~0 (ranks nearly cancelling) can take
    a step of up to lr either way: the bound is 1e-4 for all but <1% of the elements, lr*steps
    for those."""
    tmp, ref = runs
    ranks = launch(tmp, "ddp-bf16", 2, 2, "--set", "gpu.ddp_grad_compression=bf16")
    assert ranks[0]["describe"]["ddp_grad_compression"] == "bf16"
    want = ref["single"][0]["full"]
    diffs = torch.cat([(ranks[0]["full"][k].float() - want[k].float()).abs().flatten() for k in want])
    assert diffs.max() > ATOL  # the hook ran: not the fp32 all-reduce's result
    assert diffs.max() <= LR * STEPS
    assert (diffs > 1e-4).float().mean() < 0.01, (diffs > 1e-4).sum()
    for key, value in ranks[0]["local"].items():  # still replicas
        assert torch.equal(value, ranks[1]["local"][key]), key


@pytest.mark.slow
def test_hsdp_checkpoint_resume_continues_the_run(runs) -> None:
    """HSDP (2 x 2) stopped after 2 steps with a checkpoint and resumed to 4 ends where one
    process running 4 steps straight ends: weights, AdamW state and data position restored."""
    tmp, _ = runs
    constant = ("--set", "optim.schedule=constant")  # a cosine over max_steps would differ between the runs
    ref = launch(tmp, "single-constant", 1, 4, *constant)[0]
    hsdp = ("--set", "gpu.distributed=hsdp", "--set", "gpu.shard_group_size=2", "--set", "checkpoint.every_steps=2",
            *constant)
    launch(tmp, "hsdp-resume", 4, 1, *hsdp, "--max-steps", "2")
    ranks = launch(tmp, "hsdp-resume", 4, 1, *hsdp)
    run = tmp / "hsdp-resume" / "run"
    # the second launch resumed at step 2 (a fresh start would log step 2 again)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    assert_close(ranks[0]["full"], ref["full"])
