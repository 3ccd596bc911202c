"""AdamW step time: torch's fused kernel (``optim.fused: true``, the new default) vs the
foreach implementation torch picks by itself (the old default) vs the per-parameter loop.

Same parameters (a sana-600m-512-width model, ``--layers`` blocks), same gradients, the
implementations interleaved repetition by repetition in one process so machine load hits
all of them alike. Prints median ms per step and the ratios.

Run: ``python benchmarks/optimizer_step.py [--layers 2] [--reps 15] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMPLS = {
    "fused (new default)": dict(fused=True),
    "foreach (old default)": dict(foreach=True),
    "for-loop": dict(foreach=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from training.model.build import ModelConfig, build_model

    torch.manual_seed(0)
    base = build_model(
        ModelConfig(preset="sana-600m-512", overrides=dict(num_layers=args.layers), init="torch")
    )
    base.to(args.device)
    n = sum(p.numel() for p in base.parameters())
    setups = {}
    for name, kw in IMPLS.items():
        params = [p.detach().clone().requires_grad_(True) for p in base.parameters()]
        g = torch.Generator(device=args.device).manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, device=args.device) * 1e-3
        setups[name] = (params, torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw))
    times: dict[str, list[float]] = {name: [] for name in IMPLS}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for rep in range(args.reps + 2):
        for name, (_, opt) in setups.items():
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if rep >= 2:  # the first steps allocate the state
                times[name].append(time.perf_counter() - t0)
    ref = setups["foreach (old default)"][0]
    for name, (params, _) in setups.items():  # same math: the results agree
        worst = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(params, ref, strict=True))
        assert worst < 1e-6, (name, worst)
    print(
        f"AdamW over {n / 1e6:.1f}M fp32 parameters ({args.layers} sana-600m-512 blocks) on {args.device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} interleaved reps"
    )
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    for name, ms in med.items():
        print(f"  {name:22} {ms:8.1f} ms/step (p10 {sorted(times[name])[len(times[name]) // 10] * 1e3:.1f})")
    print(
        f"  foreach / fused = {med['foreach (old default)'] / med['fused (new default)']:.2f}x, "
        f"for-loop / fused = {med['for-loop'] / med['fused (new default)']:.2f}x"
    )


if __name__ == "__main__":
    main()
