"""One helper the training tests share: run the real loop on the GPU backend (CPU, gloo)."""

from __future__ import annotations

from training.backends.gpu import GpuBackend
from training.config import TrainConfig
from training.loop import TrainResult, train


def train_on_cpu(cfg: TrainConfig) -> TrainResult:
    """``train(cfg)`` with the GPU backend, initialised and closed around it (as the entrypoint does)."""
    backend = GpuBackend(cfg.gpu, precision=cfg.precision)
    backend.init()
    try:
        return train(cfg, backend)
    finally:
        backend.close()
