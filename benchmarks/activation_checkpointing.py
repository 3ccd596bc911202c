"""FLOPs each activation-checkpointing mode spends in backward, counted, side by side.

``torch.utils.flop_counter.FlopCounterMode`` counts matmul/convolution/attention FLOPs of the
forward pass and, separately, of the backward pass (which includes any recomputed forward).
``full`` recomputes one forward in backward (the "+33% FLOPs" of a step); ``every_n`` 1/n
of one; ``selective`` saves every matmul/convolution/attention output, so it should recompute
none of those FLOPs (only uncounted elementwise ops and norms). sana-600m-512 widths, ``--layers`` blocks, 16x16 latents, CPU.

Run: ``python benchmarks/activation_checkpointing.py [--layers 4]``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--every-n", type=int, default=2)
    args = ap.parse_args()
    from training.model.build import ModelConfig, build_model

    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 32, 16, 16, generator=g), torch.randn(1, 32, 2304, generator=g)
    rows = []
    for mode in ("none", "full", "every_n", "selective"):
        torch.manual_seed(0)
        cfg = ModelConfig(
            preset="sana-600m-512",
            overrides=dict(num_layers=args.layers),
            activation_checkpointing=mode,
            checkpoint_every_n=args.every_n,
        )
        model = build_model(cfg)
        with FlopCounterMode(display=False) as fwd:
            out = model(x, text, torch.tensor([500.0]), return_dict=False)[0]
        with FlopCounterMode(display=False) as bwd:
            out.square().mean().backward()
        rows.append((mode, fwd.get_total_flops(), bwd.get_total_flops()))
    # Backward totals themselves are not meaningful here: FlopCounterMode books the depthwise
    # convolution's backward as a dense one (groups ignored). That error is the same in every
    # mode, so the difference to "none" is the recomputed forward, which is what differs.
    base = rows[0][2]
    print(f"sana-600m-512 widths, {args.layers} blocks, 16x16 latents, 32 text tokens, batch 1 (GFLOP)")
    for mode, f, b in rows:
        recomputed = b - base
        print(
            f"  {mode:9} forward {f / 1e9:7.2f}  recomputed in backward {recomputed / 1e9:7.2f} "
            f"({recomputed / f:4.0%} of a forward; step FLOPs vs none, backward = 2x forward: "
            f"{(3 * f + recomputed) / (3 * f):4.2f}x)"
        )


if __name__ == "__main__":
    main()
