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


def compile_blocks(model: nn.Module, *, fullgraph: bool = False) -> int:
    """Compile each ``model.transformer_blocks[i].forward`` in place (dynamic=False).

    Returns the number of compiled blocks. Every block shares one code object, so the
    per-code-object recompile limit must cover one graph per block x bucket shape when guards
    specialise on the instance; raise it rather than silently falling back to eager.
    """
    blocks = list(getattr(model, "transformer_blocks", []))
    limit = max(torch._dynamo.config.recompile_limit, 8 * max(1, len(blocks)))
    torch._dynamo.config.recompile_limit = limit
    from training.activation_checkpointing import checkpointed_forward

    for block in blocks:
        # A checkpointed block compiles its checkpoint region with it (torchtitan: AC, then compile).
        block.forward = torch.compile(checkpointed_forward(model, block), dynamic=False, fullgraph=fullgraph)
    log.info(
        "torch.compile: %d transformer blocks (dynamic=False, cache %s)",
        len(blocks),
        os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch default"),
    )
    return len(blocks)
