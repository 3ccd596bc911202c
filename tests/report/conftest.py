"""Bench results produced for real (tiny preset), shared by the report tests.

GPU backend: in this process on CPU. Trainium backend: ``python -m training.bench
--backend trainium`` in .venv-xla (torch-xla on PJRT CPU) as a subprocess, because torch-xla
lives only in that environment.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
XLA_PYTHON = REPO / ".venv-xla" / "bin" / "python"
TINY = REPO / "training" / "configs" / "tiny-cpu.yaml"
#: tiny preset, 16 text tokens, batch 4: identical on both backends so the report compares them
BENCH_ARGS = ["--config", str(TINY), "--set", "tensorboard=false", "--set", "data.batch_size=4",
              "--synthetic", "--text-tokens", "16"]
#: one price for "local" (both CPU runs), so every cost number can be checked by hand
LOCAL_PRICE = 0.5


@pytest.fixture(scope="session")
def gpu_result(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training import bench

    out = tmp_path_factory.mktemp("bench") / "gpu-cpu.json"
    bench.main(["--backend", "gpu", *BENCH_ARGS, "--steps", "4", "--warmup", "1",
                "--work-dir", str(out.parent / "work"), "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def trainium_result(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not XLA_PYTHON.exists():
        pytest.skip(".venv-xla missing: run `make setup-xla` to bench the Trainium backend on XLA CPU")
    out = tmp_path_factory.mktemp("bench") / "trainium-xla-cpu.json"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(XLA_PYTHON), "-m", "training.bench", "--backend", "trainium", *BENCH_ARGS,
                           "--steps", "4", "--warmup", "2", "--work-dir", str(out.parent / "work"),
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture
def local_prices(tmp_path: Path) -> Path:
    path = tmp_path / "prices.yaml"
    path.write_text(f"""as_of: "2026-01-01"
currency: USD
region: local
prices:
  local:
    usd_per_hour: {LOCAL_PRICE}
    source: "illustrative price for local CPU runs (tests)"
    checked: "2026-01-01"
    verified: true
""")
    return path
