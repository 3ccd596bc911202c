"""Exact, crash-safe, sharded and asynchronous checkpoints (one package, one job per module).

- ``layout``: names, durable writes, manifest, discovery (``find_latest``, ``verify``)
- ``shards``: per-rank safetensors shard files, written through a hash, read by rows
- ``sharded``: format ``sana-checkpoint/2``: stage, background write, commit
- ``checkpointer``: ``Checkpointer`` (save when due, restore, resume resolution), config
- ``mirror``: the S3 mirror; ``consolidate``: full tensors out of either format (export)

Import from the module that defines a name (nothing is re-exported here, so importing one
module never loads the others).
"""
