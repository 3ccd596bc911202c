"""LoRA vs full fine-tuning on CPU: optimizer-step time and memory, side by side.

A mid-size Sana (the 600M's widths, ``--layers`` blocks) takes AdamW steps in one process,
full fine-tuning and LoRA (rank ``--rank`` on to_q/to_k/to_v) interleaved step by step so
both see the same machine load; the printed ratio is LoRA / full. Memory is what training
keeps besides the weights and activations: gradients + AdamW state, counted from the
tensors after a step, and each variant's peak RSS measured in its own child process.

    .venv/bin/python benchmarks/lora_vs_full.py [--layers 2 --steps 6 --rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.model.build import ModelConfig, build_model  # noqa: E402
from training.model.lora import LoraConfig, apply_lora  # noqa: E402
from training.optim.factory import OptimConfig, optimizer_factory  # noqa: E402

LATENT, TEXT_TOKENS, BATCH = (32, 16, 16), 64, 2


def setup(lora_rank: int, layers: int):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="sana-600m-512", overrides={"num_layers": layers}))
    model = apply_lora(model, LoraConfig(rank=lora_rank))
    opt = optimizer_factory(OptimConfig(lr=1e-4), model)([p for p in model.parameters() if p.requires_grad])
    gen = torch.Generator().manual_seed(1)
    batch = (
        torch.randn(BATCH, *LATENT, generator=gen),
        torch.randn(BATCH, TEXT_TOKENS, 2304, generator=gen),
        torch.rand(BATCH, generator=gen) * 1000,
        torch.randn(BATCH, *LATENT, generator=gen),
    )
    return model, opt, batch


def step(model, opt, batch) -> float:
    x, text, t, target = batch
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x, text, t).sample, target)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def state_bytes(model, opt) -> int:
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    moments = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return grads + moments


def peak_rss() -> int:
    """This process's RSS high-water mark in bytes. /proc VmHWM, not getrusage's ru_maxrss:
    a child forked from a big parent reports the parent's peak in ru_maxrss (Linux carries it
    over fork), VmHWM belongs to the exec'd image alone (proc(5))."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(lora_rank: int, layers: int, steps: int) -> None:
    """One variant alone: peak RSS over ``steps`` steps, printed as JSON."""
    model, opt, batch = setup(lora_rank, layers)
    for _ in range(steps):
        step(model, opt, batch)
    print(json.dumps({"peak_rss": peak_rss()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant (after 1 warm-up each)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.child is not None:
        child(args.child, args.layers, 3)
        return
    runs = {"full": setup(0, args.layers), "lora": setup(args.rank, args.layers)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():  # warm-up (allocations, optimizer state)
        step(*run)
    for i in range(args.steps):  # interleaved, alternating which goes first
        for name in ["full", "lora"] if i % 2 == 0 else ["lora", "full"]:
            times[name].append(step(*runs[name]))
    rss = {}
    for name, rank in (("full", 0), ("lora", args.rank)):
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(rank), "--layers", str(args.layers)],
            capture_output=True,
            text=True,
            check=True,
        )
        rss[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss"]
    result = {}
    for name, (model, opt, _) in runs.items():
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result[name] = {
            "median_step_s": statistics.median(times[name]),
            "trainable_params": trainable,
            "grad_and_optimizer_bytes": state_bytes(model, opt),
            "peak_rss_bytes": rss[name],
        }
    total = sum(p.numel() for p in runs["full"][0].parameters())
    print(
        f"mid Sana: 600M widths, {args.layers} blocks, {total / 1e6:.1f}M params; batch {BATCH}, "
        f"latents {LATENT}, {TEXT_TOKENS} text tokens; LoRA rank {args.rank} on to_q/to_k/to_v; "
        f"{args.steps} interleaved steps each"
    )
    for name, r in result.items():
        print(
            f"  {name:4s}: step {r['median_step_s']:.3f} s, trainable {r['trainable_params'] / 1e6:.2f}M, "
            f"grads+AdamW {r['grad_and_optimizer_bytes'] / 2**20:.1f} MiB, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
        )
    f, lo = result["full"], result["lora"]
    print(
        f"ratio lora/full: step time {lo['median_step_s'] / f['median_step_s']:.3f}, "
        f"grads+AdamW {lo['grad_and_optimizer_bytes'] / f['grad_and_optimizer_bytes']:.4f}, "
        f"peak RSS {lo['peak_rss_bytes'] / f['peak_rss_bytes']:.3f}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
