"""Bench results produced for real (tiny preset), shared by the report tests.

``training.demo.compare.run_demo_comparison`` is what ``make demo`` ends with: the GPU backend
benched in this process on CPU, the Trainium backend benched by ``python -m training.bench
--backend trainium`` in .venv-xla (torch-xla on PJRT CPU; a subprocess because torch-xla
lives only there), then ``python -m training.report`` over both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import skip_or_fail

REPO = Path(__file__).resolve().parents[3]
XLA_PYTHON = REPO / ".venv-xla" / "bin" / "python"


@pytest.fixture(scope="session")
def tiny_features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Feature shards shaped for the tiny preset (latents [4, 32, 32], 16 x 8 text)."""
    from training.data.shards import write_synthetic_features

    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=32, latent_shape=(4, 32, 32), text_dim=8, max_text_tokens=16,
                             text_tokens=(2, 16), seed=0, samples_per_shard=16)
    return out


@pytest.fixture(scope="session")
def demo_comparison(tiny_features: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not XLA_PYTHON.exists():
        skip_or_fail(".venv-xla missing: run `make setup-xla` to bench the Trainium backend on XLA CPU",
                     required_by="SANA_REQUIRE_ALL")
    from training.demo.compare import run_demo_comparison

    return run_demo_comparison(tmp_path_factory.mktemp("compare"), features=tiny_features, steps=4,
                               dataset_samples=1000, epochs=2)
