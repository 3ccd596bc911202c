"""Timing on an asynchronous device: a timer must wait for the queued work first."""

from __future__ import annotations

from typing import Any


def drain(device: Any) -> None:
    """Wait until the device has finished all queued work (no-op for eager CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()
