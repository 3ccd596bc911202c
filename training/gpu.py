"""``python -m training.gpu --config training/configs/tiny-cpu.yaml [--set k=v] [--resume auto]``

Entry point for CUDA GPUs (one process per GPU under torchrun) and for CPU processes (tests,
the local demo). Thin on purpose (STYLE.md rule 1): parse, build the backend, train, close.
"""

from __future__ import annotations

from collections.abc import Sequence

from training.errors import exits_cleanly


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    from training.backends.gpu import GpuBackend
    from training.config import load_config
    from training.entry import run

    cfg = load_config(argv, prog="python -m training.gpu")
    run(cfg, GpuBackend(cfg.gpu, precision=cfg.precision))


if __name__ == "__main__":
    main()
