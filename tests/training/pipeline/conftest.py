"""Fixtures of the pipeline's fast tests: a valid recipe tree and a Site on this checkout."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from training.pipeline.site import PACKAGE_ROOT, Site

#: a small valid recipe (paths need not exist: nothing here reads them)
TREE: dict[str, Any] = {
    "name": "tiny",
    "source": {"raw": "/fsx/data/raw/tiny"},
    "precompute": {"vae": "/fsx/models/vae", "text_encoder": "/fsx/models/te", "resolution": 64,
                   "max_text_tokens": 16},
    "train": {"config": "training/configs/tiny-cpu.yaml", "overrides": {"max_steps": 20, "optim.lr": 1.0e-3}},
}


@pytest.fixture
def tree() -> dict[str, Any]:
    return copy.deepcopy(TREE)


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(checkpoint_root=tmp_path / "checkpoints", log_root=tmp_path / "logs", package_root=PACKAGE_ROOT,
                package_hash="0123456789ab", user="researcher")
