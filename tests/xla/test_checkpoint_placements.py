"""The sharded-checkpoint placement check under torch 2.9 (the Trainium pin, .venv-xla).

In torch 2.9 ``_StridedShard`` (FSDP2 + TP's right-to-left sharding) subclasses ``Shard``
(torch/distributed/tensor/placement_types.py), so an isinstance check takes it for Shard(0)
and would write its interleaved rows as if they were ``chunk_rows``. The check compares types
exactly (training/optim/sharding.py ``placement_problem``).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from training.optim.sharding import placement_problem


def test_strided_shard_is_refused_although_it_is_a_shard_in_torch_2_9():
    strided = _StridedShard(0, split_factor=2)
    assert isinstance(strided, Shard)  # what made the old isinstance(Shard) check pass it
    assert "is not Shard(0) or Replicate()" in placement_problem((strided,))
    assert "is not Shard(0) or Replicate()" in placement_problem((Replicate(), strided))
    assert placement_problem((Replicate(), Shard(0))) is None
