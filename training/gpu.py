"""``python -m training.gpu --config training/configs/tiny-cpu.yaml [--set k=v] [--resume auto]``

Entry point for CUDA GPUs (one process per GPU under torchrun) and for CPU processes (tests,
the local demo). Thin on purpose (CONTRIBUTING.md, 1): parse, build the backend, train, close.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from training.errors import exits_cleanly


def check_memory(cfg) -> None:
    """``gpu.memory_check``: refuse, before any process group or model exists, a config whose
    per-GPU estimate exceeds the device (one line naming the knob; rank 0 prints the estimate)."""
    import torch

    if cfg.gpu.memory_check == "off" or (cfg.gpu.memory_check == "auto" and not torch.cuda.is_available()):
        return
    from training.perf.memory import check_gpu_config

    out = sys.stdout if os.environ.get("RANK", "0") == "0" else None
    check_gpu_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), out=out)


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    from training.backends.gpu import GpuBackend
    from training.config import load_config
    from training.loop import run

    cfg = load_config(argv, prog="python -m training.gpu")
    check_memory(cfg)
    run(cfg, GpuBackend(cfg.gpu, precision=cfg.precision))


if __name__ == "__main__":
    main()
