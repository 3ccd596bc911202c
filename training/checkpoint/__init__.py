"""Exact, crash-safe, sharded and asynchronous checkpoints (one package, one job per module).

- ``layout``: names, durable writes, manifest, discovery (``find_latest``, ``verify``)
- ``shards``: per-rank safetensors shard files, written through a hash, read by rows
- ``sharded``: format ``sana-checkpoint/2``: stage, background write, commit
- ``full``: format ``sana-checkpoint/1``: rank 0 writes and every rank reads the full files
- ``checkpointer``: ``Checkpointer`` (save when due, restore; the collectives of both)
- ``config``: ``CheckpointConfig``; ``train_state``: counters, RNG, data position, the JSON
  record; ``resume``: what a run resumes from (``resolve_checkpoint``, also for export)
- ``mirror``: the S3 mirror; ``consolidate``: full tensors out of either format (export)

Import from the module that defines a name (nothing is re-exported here, so importing one
module never loads the others).
"""
