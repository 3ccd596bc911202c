"""CAME sharded by rows (ZeRO-1) is the unsharded CAME: three ranks over real collectives
(gloo, one process each), parameters whose rows do not divide by 3 (zero padding, a rank
with no real row), factored and unfactored second moments (training/optim/came.py)."""

from __future__ import annotations

from tests.training.ranks import launch_ranks


def test_sharded_came_over_gloo_equals_the_unsharded_update():
    ranks = launch_ranks(3, ["-m", "tests.training.optim.came_shard_worker"], timeout_s=180)
    for rank, code in ranks.codes.items():
        assert code == 0, ranks.outputs[rank][-3000:]
        assert "sharded CAME == unsharded CAME" in ranks.outputs[rank]
