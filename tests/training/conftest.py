"""Fixtures for the training tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread per test, as the GPU backend uses on CPU: on these 2 shared cores
    intra-op threads fight each other (measured ~15x slower) and make timings noisy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
