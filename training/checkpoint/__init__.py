"""Exact, crash-safe, sharded and asynchronous checkpoints (one package, one job per module).

- ``layout``: names, durable writes, manifest, discovery (``find_latest``, ``verify``)
- ``shards``: per-rank safetensors shard files, written through a hash, read by rows
- ``sharded``: format ``sana-checkpoint/2``: stage, background write, commit
- ``checkpointer``: ``Checkpointer`` (save when due, restore, resume resolution), config
- ``mirror``: the S3 mirror; ``consolidate``: full tensors out of either format (export)

The names other modules import are re-exported here.
"""

from training.checkpoint.checkpointer import (
    CheckpointConfig,
    Checkpointer,
    Stateful,
    TrainState,
    capture_rng,
    map_data_position,
    resolve_checkpoint,
    restore_rng,
)
from training.checkpoint.layout import (
    EMA_FILE,
    FAULT_ENV,
    FORMAT,
    FORMAT_SHARDED,
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    find_latest,
    list_complete,
    read_manifest,
    sha256_file,
    step_dir_name,
    verify,
)

__all__ = [
    "EMA_FILE", "FAULT_ENV", "FORMAT", "FORMAT_SHARDED", "MANIFEST", "MODEL_FILE", "OPTIMIZER_FILE", "RNG_FILE",
    "STATE_FILE", "CheckpointConfig", "Checkpointer", "Stateful", "TrainState", "capture_rng", "find_latest",
    "list_complete", "map_data_position", "read_manifest", "resolve_checkpoint", "restore_rng", "sha256_file",
    "step_dir_name", "verify",
]
