"""Ours vs the tuned diffusers-style reference (training/perf/reference_step.py), both eager and
both compiled, on the same batches (identical caption lengths), interleaved repetitions.

Each mode is one ``python -m training.bench --compare-reference`` run (the production step
through training.loop.train_step against ``ReferenceStep``: warm-up steps of each, then
``--repetitions`` x (``--steps`` of ours, ``--steps`` of the reference)); this script prints
the two side by side: per-repetition ratios, their median, the real caption tokens each
side saw (the same batches, so the same) and the tokens each computed (ours trims, the
reference pads).

Default model: sana-600m-512's widths with 2 of its 28 blocks at 8x8 latents, batch 2, fp32
(bf16 matmuls are emulated on most CPUs), captions of the padded 300 tokens unless
``--caption-lengths`` names real features (training/data/caption_lengths.py). Compiled mode
uses inductor (C++ on CPU): the first steps take minutes here.

Run: ``.venv/bin/python benchmarks/reference_compare.py [--reps 5] [--steps 3]``.
CPU figures: they check the method, not a GPU's numbers (benchmarks/gpu-check.sh does that).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.perf.bench import main as bench_main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--latent", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--caption-lengths", default="full")
    ap.add_argument("--modes", default="eager,compiled")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reference-compare-"))
    results = {}
    for mode in args.modes.split(","):
        out = work / f"{mode}.json"
        bench_main(["--backend", "gpu", "--config", str(REPO / "training/configs/sana-600m-512.yaml"),
                    "--set", f"model.overrides={{num_layers: {args.layers}, sample_size: {args.latent}}}",
                    "--set", f"data.batch_size={args.batch}", "--set", f"precision={args.precision}",
                    "--set", "tensorboard=false", "--set", f"gpu.compile={'true' if mode == 'compiled' else 'false'}",
                    "--set", "gpu.compile_cache_dir=''", "--compare-reference", "--synthetic",
                    "--caption-lengths", args.caption_lengths, "--warmup", str(args.warmup),
                    "--steps", str(args.steps), "--repetitions", str(args.reps),
                    "--work-dir", str(work), "--out", str(out)])
        results[mode] = json.loads(out.read_text())
    first = next(iter(results.values()))
    print(f"\nsana-600m-512 widths, {args.layers} blocks, {args.latent}x{args.latent} latents, batch {args.batch}, "
          f"{args.precision}, CPU, torch {first['versions']['torch']}; captions: {first['caption_lengths']}; "
          f"{args.reps} interleaved repetitions x {args.steps} steps per side after {args.warmup} warm-up")
    print(f"{'mode':<14} {'ours s/step':>11} {'ref s/step':>10} {'median':>7}  per-repetition ours/ref             "
          f"real tokens ours/ref  computed ours/ref")
    for mode, r in results.items():
        ref = r["reference"]
        steps = ref["repetitions"] * ref["steps_per_repetition"]
        print(f"{'both ' + mode:<14} {sum(ref['seconds_ours']) / steps:>11.3f} "
              f"{sum(ref['seconds_reference']) / steps:>10.3f} {ref['ratio_median']:>6.3f}x  "
              f"{', '.join(f'{x:.3f}' for x in ref['ratios']):<34} "
              f"{r['text_tokens_real']:>6.1f} / {ref['text_tokens_real']:<6.1f}      "
              f"{r['text_tokens_computed']:.1f} / {ref['text_tokens_computed']:.1f}")
        if r.get("compile_count") is not None:
            print(f"{'':<14} compiled graphs {r['compile_count']} ({r['compile_seconds']:.0f} s), "
                  f"{r['compiles_in_timed_steps']} in the timed window, {r['graph_breaks']} graph breaks")


if __name__ == "__main__":
    main()
