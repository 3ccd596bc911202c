"""Per-block ``torch.compile`` for the GPU backend (``gpu.compile: true``).

torchtitan compiles each transformer block, after activation checkpointing and before
``fully_shard``: the repeated block compiles once and is reused by every layer, and FSDP's
all-gather / reduce-scatter hooks stay outside the compiled graphs
(torchtitan/models/llama3/infra/parallelize.py ``apply_compile``: "Apply torch.compile to each
TransformerBlock, which makes compilation efficient due to repeated structure").

Differences from torchtitan, on purpose:
- We compile the block's ``forward`` in place instead of replacing the block by an
  ``OptimizedModule``: parameter names (checkpoints, optimizer state by name, LoRA) keep no
  ``_orig_mod.`` infix, and module hooks (FSDP2's, activation checkpointing's recomputation
  through ``block.__call__``) still run eagerly around the compiled forward.
- ``dynamic=False``: shapes are static per resolution bucket (one graph per bucket shape);
  dynamic shapes would trade kernel quality for fewer compiles, and a run sees few buckets.
- What a block sees decides how many graphs there are: the FSDP2 unit is the whole block
  (training/backends/gpu.py ``_fully_shard``), so no FSDP hook runs inside a compiled
  forward and the block, its checkpoint region included, is one graph with no break. Under
  bf16 autocast block 0 receives the bf16 patch embedding and later blocks the fp32 residual
  stream, so a run compiles two graphs per shape, whatever the depth
  (tests/training/model/test_compile.py counts them with ``compile_stats``).
- The inductor cache (``TORCHINDUCTOR_CACHE_DIR`` with the FX-graph cache on) lives on
  shared storage for the cluster, per user: a restart or the next job on any node loads
  compiled kernels instead of compiling again (torch docs "Compile Time Caching
  Configuration": TORCHINDUCTOR_FX_GRAPH_CACHE / TORCHINDUCTOR_CACHE_DIR).
"""

from __future__ import annotations

import getpass
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

#: ``gpu.compile_cache_dir`` default: FSx (``$SANA_FSX``, else /fsx) per user; "" = torch's
#: default (/tmp/torchinductor_<user>), used where that FSx root does not exist (laptops, CI)
DEFAULT_CACHE_DIR = "${SANA_FSX:-/fsx}/cache/inductor/${USER}"


def resolve_cache_dir(template: str) -> Path | None:
    """``gpu.compile_cache_dir`` -> a directory, or None to keep torch's default.

    ``${SANA_FSX:-/fsx}`` and ``${USER}`` are expanded here (os.path.expandvars has no
    defaults syntax); a cache under a root that does not exist is skipped, not created.
    """
    if not template:
        return None
    fsx = os.environ.get("SANA_FSX") or "/fsx"
    try:
        user = os.environ.get("USER") or getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    path = template.replace("${SANA_FSX:-/fsx}", fsx).replace("${USER}", user)
    path = os.path.expanduser(os.path.expandvars(path))
    if template.startswith("${SANA_FSX:-/fsx}") and not Path(fsx).is_dir():
        return None
    return Path(path)


def configure_cache(template: str) -> Path | None:
    """Point inductor's caches at ``template`` (set before the first compile). Returns the dir."""
    cache = resolve_cache_dir(template)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    if cache is None:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return cache


def compile_blocks(model: nn.Module, *, fullgraph: bool = False, backend: str = "inductor") -> int:
    """Compile each ``model.transformer_blocks[i].forward`` in place (dynamic=False) with ``backend``.

    Returns the number of compiled blocks. Every block shares one code object, so the
    per-code-object recompile limit must cover one graph per block x bucket shape when guards
    specialise on the instance; raise it rather than silently falling back to eager.
    """
    blocks = list(getattr(model, "transformer_blocks", []))
    limit = max(torch._dynamo.config.recompile_limit, 8 * max(1, len(blocks)))
    torch._dynamo.config.recompile_limit = limit
    from training.model.activation_checkpointing import checkpointed_forward

    for block in blocks:
        # A checkpointed block compiles its checkpoint region with it (torchtitan: AC, then compile).
        block.forward = torch.compile(checkpointed_forward(model, block), dynamic=False, fullgraph=fullgraph,
                                      backend=backend)
    log.info(
        "torch.compile: %d transformer blocks (%s, dynamic=False, cache %s)",
        len(blocks),
        backend,
        os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch default"),
    )
    return len(blocks)


#: graph-break / recompile reasons kept in ``compile_stats`` (the first line of each, most frequent first)
REASONS_KEPT = 5


def compile_stats() -> dict[str, Any]:
    """What dynamo compiled in this process so far, from torch 2.13's own counters.

    Sources (torch/_dynamo): ``utils.counters["frames"]["ok"]`` counts frames dynamo
    converted (convert_frame.py ``ConvertFrame.__call__``), ``counters["stats"]["unique_graphs"]``
    each FX graph handed to the backend (output_graph.py ``compile_and_call_fx_graph``),
    ``counters["graph_break"][reason]`` each graph break (symbolic_convert.py, category
    "graph_break"); ``utils.get_compilation_metrics()`` one record per frame compile (forward)
    and per AOT backward compile, with the guard failure that caused a recompile
    (``recompile_reason``) and its ``duration_us``. The metrics deque keeps the last 64
    records (``DEFAULT_COMPILATION_METRICS_LIMIT``): enough for per-block compile, which
    compiles a few graphs per shape; the counters are unbounded.

    ``compiles`` still growing after warm-up means a recompiling step; ``graph_breaks`` > 0
    means part of a compiled region runs eagerly.
    """
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = get_compilation_metrics()
    breaks = counters["graph_break"]
    recompiles = [m.recompile_reason for m in metrics if m.recompile_reason]

    def first_lines(reasons: list[str]) -> list[str]:
        seen: dict[str, int] = {}
        for reason in reasons:
            line = reason.strip().splitlines()[0] if reason.strip() else "?"
            seen[line] = seen.get(line, 0) + 1
        return [line for line, _ in sorted(seen.items(), key=lambda kv: -kv[1])[:REASONS_KEPT]]

    return {
        "frames": int(counters["frames"]["ok"]),
        "frames_failed": int(counters["frames"]["total"] - counters["frames"]["ok"]),
        "compiles": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": first_lines([r for r, n in breaks.most_common() for _ in range(n)]),
        "recompiles": len(recompiles),
        "recompile_reasons": first_lines(recompiles),
        "compile_seconds": round(sum((m.duration_us or 0) for m in metrics) / 1e6, 3),
    }
