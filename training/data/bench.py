"""``python -m training.data``: a feature directory's summary, and the loader benchmark."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from training.data.index import FeatureIndex
from training.data.loader import FeatureLoader
from training.data.shards import INDEX, write_synthetic_features
from training.errors import UserError, exits_cleanly

SANA_600M_512 = {"latent_shape": (32, 16, 16), "text_dim": 2304, "max_text_tokens": 300, "text_tokens": (20, 120)}


def bench(source: str | Path, *, batch_size: int = 32, seconds: float = 10.0, prefetch: int = 4,
          windows: int = 5) -> dict[str, float]:
    """Samples/s one loader process delivers to a consumer that only takes batches.

    The first batches (shard open + sha256) are excluded. The run is cut into ``windows``
    equal windows: ``samples_per_s`` is the whole run, ``best_window`` what the loader
    manages when the shared cores are not taken by others (timeit's min-of-repeats logic).
    """
    loader = FeatureLoader(source, batch_size=batch_size, prefetch=prefetch)
    try:
        for _ in range(max(1, prefetch)):
            next(loader)
        rates, total, t_start = [], 0, time.perf_counter()
        for _ in range(windows):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / windows:
                n += next(loader)["latents"].shape[0]
            rates.append(n / (time.perf_counter() - t0))
            total += n
        elapsed = time.perf_counter() - t_start
    finally:
        loader.close()
    return {"samples_per_s": total / elapsed, "best_window": max(rates), "samples": total, "seconds": elapsed,
            "bytes_per_sample": loader.index.bytes_per_sample}


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.data", description="Feature shards: index summary and loader benchmark.")
    p.add_argument("--info", metavar="SOURCE", help="print the index summary (bytes per sample) of a feature dir")
    p.add_argument("--bench", metavar="DIR", help="loader benchmark on sana-600m-512-shaped synthetic features "
                                                  "in DIR (written there first if DIR has no index.json)")
    p.add_argument("--samples", type=int, default=2048, help="samples to write for --bench")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--prefetch", type=int, default=4)
    args = p.parse_args(argv)
    if args.info:
        index = FeatureIndex.load(args.info)
        print(index.summary())
        if not index.is_s3:  # on FSx: have all shards been imported from S3 yet?
            missing = [s.name for s in index.shards if not (Path(index.source) / s.name).is_file()]
            if missing:
                raise UserError(f"{index.source}: {len(missing)} of {len(index.shards)} shards not present yet "
                                f"(first: {missing[0]}); wait for the FSx import or re-run precompute")
            print(f"all {len(index.shards)} shards present")
    if args.bench:
        if not (Path(args.bench) / INDEX).exists():
            t0 = time.perf_counter()
            write_synthetic_features(args.bench, num_samples=args.samples, samples_per_shard=512, **SANA_600M_512)
            print(f"wrote {args.samples} synthetic samples in {time.perf_counter() - t0:.1f} s", flush=True)
        print(FeatureIndex.load(args.bench).summary(), flush=True)
        r = bench(args.bench, batch_size=args.batch_size, seconds=args.seconds, prefetch=args.prefetch)
        print(f"loader: {r['samples_per_s']:.0f} samples/s (best window {r['best_window']:.0f}; {r['samples']} "
              f"samples in {r['seconds']:.1f} s, batch {args.batch_size}, prefetch {args.prefetch}), "
              f"{r['bytes_per_sample']:.0f} bytes/sample")
    if not (args.info or args.bench):
        p.error("give --info SOURCE or --bench DIR")
