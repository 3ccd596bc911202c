"""torchrun worker for test_gpu_distributed.py: ``python -m training.gpu`` plus a dump of
this rank's parameters (``--dump DIR`` -> DIR/rank-<r>.pt), which the test compares."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from training.backends.gpu import GpuBackend
from training.config import load_config
from training.loop import train


def main(argv: list[str]) -> None:
    i = argv.index("--dump")
    dump = Path(argv[i + 1])
    cfg = load_config(argv[:i] + argv[i + 2:])
    backend = GpuBackend(cfg.gpu, precision=cfg.precision)
    backend.init()
    try:
        result = train(cfg, backend)
        inner = backend.unwrap(result.model)
        local = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone()
                 for k, v in inner.state_dict().items()}
        full = backend.model_state_dict(result.model)  # collective
        # where the last step's gradients live: one storage per DDP bucket with
        # gradient_as_bucket_view, one per parameter otherwise
        grads = [p.grad for p in inner.parameters() if p.grad is not None and not hasattr(p.grad, "to_local")]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        dump.mkdir(parents=True, exist_ok=True)
        torch.save({"local": local, "full": full, "loss": result.final_loss,
                    "describe": backend.describe(),
                    "grads": len(grads), "grad_storages": len(storages)}, dump / f"rank-{backend.rank}.pt")
    finally:
        backend.close()


if __name__ == "__main__":
    main(sys.argv[1:])
