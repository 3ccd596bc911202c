"""Fixtures for the training tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One torch thread for the whole session, as the GPU backend uses on CPU: on these 2 shared
    cores intra-op threads fight each other (measured ~15x slower) and make timings noisy.

    Session scope on purpose: on CPU the thread count is part of the numerics (it changes the
    reduction order), and a module-scoped fixture (e.g. test_lora's ``lora_run``) is set up
    before any function-scoped one, so with a per-test setting the reference run and the
    resumed run of one test could use different counts and differ in the last bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
