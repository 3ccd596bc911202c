"""Loader throughput with aspect-ratio buckets vs square mode, side by side, at 600M-512 shapes.

``python benchmarks/loader_buckets.py [--dir DIR] [--samples 1024] [--reps 3] [--seconds 4]``

Writes two synthetic feature directories (once; kept in ``--dir``) in the real shard format
with sana-600m-512 shapes (text <= 300 x 2304 bf16, 20-120 real tokens): ``square``, every
latent 32x16x16, and ``buckets``, the same number of samples spread over five buckets of
NVlabs Sana's ASPECT_RATIO_512 table (0.57 ... 1.75: latents 12x21 ... 21x12, about the same
token count). Then, in interleaved repetitions (the order alternates each repetition), one
loader process per run delivers batches of ``--batch-size`` to a consumer that only takes
them (training/data/bench.py ``bench``), and the script prints samples/s of each mode (median
of the repetitions and best window) and the ratio buckets / square. The target is >= 500
samples/s per loader process in both modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.data.bench import SANA_600M_512, bench
from training.data.buckets import aspect_ratio_table, latent_shape  # noqa: E402
from training.data.shards import INDEX, write_synthetic_features

#: Sana 512 buckets around square, where most photos land
RATIOS = ("0.57", "0.78", "1.0", "1.29", "1.75")


def ensure(path: Path, samples: int, *, bucketed: bool) -> Path:
    if (path / INDEX).exists():
        return path
    spec = dict(SANA_600M_512)
    t0 = time.perf_counter()
    if bucketed:
        table = aspect_ratio_table("512")
        spec["buckets"] = {r: latent_shape(table[r], SANA_600M_512["latent_shape"][0]) for r in RATIOS}
        spec["bucket_weights"] = (0.15, 0.2, 0.3, 0.2, 0.15)
    write_synthetic_features(path, num_samples=samples, samples_per_shard=256, seed=0, **spec)
    print(f"wrote {samples} samples ({'buckets' if bucketed else 'square'}) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where the two feature directories are kept (default: a temp dir)")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="loader-buckets-"))
    dirs = {"square": ensure(root / "square", args.samples, bucketed=False),
            "buckets": ensure(root / "buckets", args.samples, bucketed=True)}
    runs: dict[str, list[dict]] = {"square": [], "buckets": []}
    for rep in range(args.reps):
        for mode in (("square", "buckets") if rep % 2 == 0 else ("buckets", "square")):
            r = bench(dirs[mode], batch_size=args.batch_size, seconds=args.seconds)
            runs[mode].append(r)
            print(f"rep {rep} {mode:8s} {r['samples_per_s']:7.0f} samples/s (best window {r['best_window']:.0f})",
                  flush=True)
    summary = {mode: {"median_samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                      "best_window": max(r["best_window"] for r in rs)} for mode, rs in runs.items()}
    ratio = summary["buckets"]["median_samples_per_s"] / summary["square"]["median_samples_per_s"]
    summary["ratio_buckets_over_square"] = ratio
    for mode in ("square", "buckets"):
        s = summary[mode]
        print(f"{mode:8s} median {s['median_samples_per_s']:.0f} samples/s, best window {s['best_window']:.0f}")
    print(f"ratio buckets / square: {ratio:.3f} (batch {args.batch_size}, {args.reps} interleaved reps)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
