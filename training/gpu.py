"""``python -m training.gpu --config training/configs/tiny-cpu.yaml [--set k=v] [--resume auto]``

Entry point for CUDA GPUs (one process per GPU under torchrun) and for CPU processes (tests,
the local demo). Thin on purpose (STYLE.md rule 1): parse, build the backend, train, close.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence

from training.errors import exits_cleanly


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    from training.backends.gpu import GpuBackend
    from training.config import load_config
    from training.loop import train

    cfg = load_config(argv, prog="python -m training.gpu")
    backend = GpuBackend(cfg.gpu, precision=cfg.precision)
    try:
        backend.init()
        logging.basicConfig(level=logging.INFO if backend.is_main else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
        result = train(cfg, backend)
        if backend.is_main:
            print(json.dumps({"steps": result.steps, "final_loss": result.final_loss,
                              "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                              "output_dir": cfg.output_dir}), flush=True)
        if result.stopped_by is not None:  # Slurm asked us to stop: say so in the exit code
            raise SystemExit(128 + result.stopped_by)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
