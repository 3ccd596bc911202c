"""``python -m training.bench --memory-table``: the per-GPU memory estimate
(training/perf/memory.py) of each GPU config for every mesh and activation-checkpointing mode,
as the Markdown runbooks/train-gpu.md pastes (tests/training/perf/test_memory.py checks that the
pasted table is this function's output). Nothing is built or run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from training.perf.measure import VAE_DOWNSAMPLE

#: the GPU configs --memory-table covers by default (training/configs/sana-*.yaml)
GPU_CONFIGS = "sana-*.yaml"


def memory_tables(configs: Sequence[str | Path], *, world_size: int, overrides: Sequence[str] = ()) -> str:
    """Markdown: one per-GPU memory table (training/perf/memory.py) per config, mesh x checkpointing."""
    from training.config import load_config
    from training.perf.memory import DEFAULT_GPU_GIB, gpu_memory_table

    out = []
    for path in configs:
        argv = ["--config", str(path)]
        for item in overrides:
            argv += ["--set", item]
        cfg = load_config(argv, prog="python -m training.bench")
        kw = cfg.model.model_kwargs()
        out += [f"**{cfg.model.preset}** (`{Path(path).name}`: batch {cfg.data.batch_size} per GPU, {cfg.precision}, "
                f"{int(kw.get('sample_size', 32)) * VAE_DOWNSAMPLE} px, {world_size} GPUs; GiB per GPU, "
                f"activations in brackets, over = above {DEFAULT_GPU_GIB:g} GiB)", "",
                gpu_memory_table(cfg, world_size=world_size), ""]
    return "\n".join(out).rstrip() + "\n"
