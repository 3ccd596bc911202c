"""Caption trimming on CPU: step time and FLOPs, padded vs trimmed, side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/text_trim_bench.py [--layers 2] [--reps 7]

What runs: the production objective (training/objective.py, caption dropout on) with
forward + backward + AdamW on a sana-600m-512-shaped transformer (widths, caption channels,
256 image tokens, 300 padded caption tokens) with fewer blocks (``--layers``, default 2: the
full 28 blocks take minutes per step on CPU), fp32, one thread. Caption lengths are drawn
uniformly from 40..120 real tokens (mean 80, the issue's figure for 512 px captions), so a
batch's longest caption rounds up to 128 under the default ``text_trim.lengths``.

Repetitions interleave (padded, trimmed) with the order flipped every repetition, so machine
noise falls on both; it prints the medians of CPU seconds per step and their ratio, and the
analytic FLOPs per sample (training/model/flops.py) for the model measured and for the full 28-block
sana-600m-512.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from training.data.text_trim import DEFAULT_LENGTHS, trimmed
from training.model import flops
from training.model.build import PRESETS, ModelConfig, build_model
from training.objective import ObjectiveConfig, RectifiedFlow


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    kw = {**PRESETS["sana-600m-512"], "num_layers": args.layers}
    model = build_model(ModelConfig(preset="sana-600m-512", overrides={"num_layers": args.layers}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n, d = 300, int(kw["caption_channels"])
    real = torch.randint(40, 121, (args.batch,))
    mask = (torch.arange(n)[None, :] < real[:, None]).long()
    batch = {
        "latents": torch.randn(args.batch, 32, 16, 16),
        "text": torch.randn(args.batch, n, d) * mask[..., None],
        "text_mask": mask,
    }
    null_text, null_mask = torch.zeros(n, d), torch.zeros(n, dtype=torch.long)
    null_text[:2], null_mask[:2] = torch.randn(2, d), 1
    objective = RectifiedFlow(
        ObjectiveConfig(caption_dropout=0.1),
        vae_scaling_factor=0.41407,
        null_text=null_text,
        null_mask=null_mask,
    )
    cut = next(trimmed([batch], lengths=DEFAULT_LENGTHS, floor=2))
    variants = {"padded": batch, "trimmed": cut}

    def step(b: dict[str, torch.Tensor]) -> float:
        c0 = time.process_time()
        opt.zero_grad(set_to_none=True)
        objective(model, b).backward()
        opt.step()
        return time.process_time() - c0

    for b in variants.values():  # warm-up: allocator, AdamW state
        step(b)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.reps):
        for name in ("padded", "trimmed") if r % 2 == 0 else ("trimmed", "padded"):
            times[name].append(step(variants[name]))
    med = {k: statistics.median(v) for k, v in times.items()}
    mean_real = float(mask.sum()) / args.batch
    length = cut["text"].shape[1]
    print(
        f"batch {args.batch}, real caption tokens {real.tolist()} (mean {mean_real:.1f}), padded {n}, "
        f"trimmed to {length}; {args.layers} of 28 blocks; {args.reps} interleaved repetitions"
    )
    print(
        f"CPU s/step (median): padded {med['padded']:.3f}, trimmed {med['trimmed']:.3f}, "
        f"trimmed/padded = {med['trimmed'] / med['padded']:.3f}"
    )
    for label, model_kw in (
        (f"{args.layers}-block model", kw),
        ("sana-600m-512 (28 blocks)", PRESETS["sana-600m-512"]),
    ):
        padded = flops.train_flops_per_sample(model_kw, n, (16, 16))
        useful, computed = flops.batch_train_flops(model_kw, (16, 16), length, real_text_tokens=mean_real)
        print(
            f"FLOPs/sample {label}: padded {padded / 1e9:.1f} G, trimmed {computed / 1e9:.1f} G "
            f"({100 * (1 - computed / padded):.1f}% less), useful {useful / 1e9:.1f} G; "
            f"MFU on real tokens = {useful / padded:.3f} x the padded-count MFU at the same speed"
        )


if __name__ == "__main__":
    main()
