"""ZeRO-1 (torch_xla ZeroRedundancyOptimizer) gives the unsharded update, and its sharded
state leaves and re-enters the backend in the portable name-keyed format.

With one PJRT CPU device the wrapper runs its real code path (reduce-scatter, sharded
AdamW over fp32 shards, global-norm clip, all-gather) with a shard count of 1; sharding
across ranks is proven on a trn node by scripts/trn-smoke.py (collectives across
processes do not work on PJRT CPU, pytorch/xla#5005).
"""

from __future__ import annotations

import pytest
import torch
from xla_helpers import run_steps

from training.backends.neuron import NeuronBackend
from training.backends.neuron_config import NeuronConfig


@pytest.fixture(scope="module")
def one_step(features):
    plain = NeuronBackend(NeuronConfig(), precision="fp32")
    plain.init()
    zero = NeuronBackend(NeuronConfig(zero1=True), precision="fp32")
    zero.init()
    return run_steps(plain, features, steps=1), run_steps(zero, features, steps=1)


def test_zero1_step_matches_unsharded(one_step):
    plain, zero = one_step
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    assert isinstance(zero["optim"], ZeroRedundancyOptimizer)
    (pl, pn), (zl, zn) = plain["logged"][0], zero["logged"][0]
    assert zl == pytest.approx(pl, rel=1e-6)
    assert zn == pytest.approx(pn, rel=1e-5)  # global norm over the reduced shards
    assert pn > 1.0  # clipping was active
    for name, p in plain["model"].items():
        torch.testing.assert_close(zero["model"][name], p, rtol=1e-5, atol=1e-7, msg=name)


def test_zero1_optimizer_state_is_the_portable_format(one_step):
    plain, zero = one_step
    ps, zs = plain["optimizer"], zero["optimizer"]
    assert zs["state"].keys() == ps["state"].keys()
    for name, entry in ps["state"].items():
        assert zs["state"][name].keys() == entry.keys()
        for key, value in entry.items():
            got = zs["state"][name][key]
            assert got.device.type == "cpu" and got.shape == value.shape, (name, key)
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-9, msg=f"{name}.{key}")
    assert [g["params"] for g in zs["param_groups"]] == [g["params"] for g in ps["param_groups"]]
    assert zs["param_groups"][0]["lr"] == ps["param_groups"][0]["lr"]


def test_zero1_loads_an_unsharded_state_and_gives_it_back(one_step):
    plain, zero = one_step
    backend, model, optimizer = zero["backend"], zero["module"], zero["optim"]
    # perturb, then load the unsharded optimizer's state and weights into the ZeRO run
    backend.load_model_state_dict(model, {k: v + 1.0 for k, v in plain["model"].items()})
    backend.load_model_state_dict(model, plain["model"])
    backend.load_optimizer_state_dict(model, optimizer, plain["optimizer"])
    again = backend.optimizer_state_dict(model, optimizer)
    for name, entry in plain["optimizer"]["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(again["state"][name][key], value, msg=f"{name}.{key}")
    # the fp32 master shards follow the loaded weights (else the next step would all-gather stale ones)
    names = {id(p): n for n, p in model.named_parameters()}
    for group, shards in zip(optimizer.param_groups, optimizer.base_optimizer.param_groups, strict=True):
        for p, shard in zip(group["params"], shards["params"], strict=True):
            torch.testing.assert_close(shard.detach().cpu()[: p.shape[0]], plain["model"][names[id(p)]])


def test_zero1_bf16_checkpoints_the_fp32_master_and_restores_it_exactly(features):
    backend = NeuronBackend(NeuronConfig(zero1=True), precision="bf16")
    backend.init()
    run = run_steps(backend, features, steps=1)
    model, optimizer = run["module"], run["optim"]
    state = run["model"]
    names = {id(p): n for n, p in model.named_parameters()}
    pairs = [(names[id(p)], p, s) for g, sg in zip(optimizer.param_groups, optimizer.base_optimizer.param_groups,
                                                   strict=True) for p, s in zip(g["params"], sg["params"], strict=True)]
    for name, param, shard in pairs:
        assert param.dtype == torch.bfloat16 and state[name].dtype == torch.float32
        assert torch.equal(state[name], shard.detach().cpu())  # the master, not the rounded weight
        assert torch.equal(param.detach().cpu(), state[name].to(torch.bfloat16))
    # perturb, then restore: master shards come back bit-exactly, weights as their bf16 rounding
    backend.load_model_state_dict(model, {k: v + 1.0 for k, v in state.items()})
    backend.load_model_state_dict(model, state)
    for name, param, shard in pairs:
        assert torch.equal(shard.detach().cpu(), state[name])
        assert torch.equal(param.detach().cpu(), state[name].to(torch.bfloat16))


def test_zero1_sharded_checkpoint_writes_the_shard_state_and_loads_it_back(one_step, tmp_path):
    """The sharded save path with the real ZeroRedundancyOptimizer (shard count 1 on PJRT
    CPU): moments come from the base optimizer's shards (no all-gather), move to the host one
    tensor at a time, and load back into the shards exactly. N -> M shard counts are
    tested on the same functions in tests/training/checkpoint/test_checkpoint_sharded.py."""
    from training.checkpoint.sharded import Stager
    from training.checkpoint.shards import ShardReader, write_shard

    plain, zero = one_step
    backend, model, optimizer = zero["backend"], zero["module"], zero["optim"]
    st = backend.sharded_state(model, optimizer)
    staged = Stager().stage(st.pieces)
    assert all(t.device.type == "cpu" for t, _, _ in staged.values())
    write_shard(tmp_path / "shard-rank-00000.safetensors", staged)
    want = backend.optimizer_state_dict(model, optimizer)  # the gathered, portable format
    weights = backend.model_state_dict(model)
    with ShardReader([tmp_path / "shard-rank-00000.safetensors"]) as reader:
        for name, entry in want["state"].items():
            for key, value in entry.items():
                assert torch.equal(reader(f"optim/{name}/{key}"), value), (name, key)
        assert all(torch.equal(reader(f"model/{k}"), v) for k, v in weights.items())
        # perturb the shards, then load: back bit-exactly
        base = optimizer.base_optimizer
        for entry in base.state.values():
            entry["exp_avg"].data = entry["exp_avg"].data + 1.0
        backend.load_sharded_state(model, optimizer, reader, keys=reader.keys(), values=st.values,
                                   param_groups=st.param_groups)
    again = backend.optimizer_state_dict(model, optimizer)
    for name, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(again["state"][name][key], value), (name, key)


# ----- CAME (NVlabs Sana's optimizer) under ZeRO-1 ------------------------------------------
@pytest.fixture(scope="module")
def came_steps(features):
    plain = NeuronBackend(NeuronConfig(), precision="fp32")
    plain.init()
    zero = NeuronBackend(NeuronConfig(zero1=True), precision="fp32")
    zero.init()
    return run_steps(plain, features, steps=2, optimizer="came"), run_steps(zero, features, steps=2, optimizer="came")


def test_came_zero1_step_on_xla_matches_unsharded_came(came_steps):
    """The ZeRO-1 wrapper's real path (reduce-scatter, the base CAME over fp32 shards with its
    row sums all-reduced, global-norm clip, all-gather) gives the unsharded CAME's update.
    Sharding across more than one rank over real collectives: tests/training/optim/test_came_sharded.py."""
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    from training.optim.came import CAME

    plain, zero = came_steps
    assert isinstance(zero["optim"], ZeroRedundancyOptimizer) and isinstance(zero["optim"].base_optimizer, CAME)
    assert zero["optim"].higher_cc_precision  # gradients reduce-scattered in fp32, not bf16
    assert len(zero["optim"].base_optimizer._shards) == len(list(zero["module"].parameters()))
    for (pl, pn), (zl, zn) in zip(plain["logged"], zero["logged"], strict=True):
        assert zl == pytest.approx(pl, rel=1e-6) and zn == pytest.approx(pn, rel=1e-5)
    # As in test_parity.py: the cross-attention key bias has a zero gradient up to rounding noise
    # (softmax ignores a constant on every key); CAME normalises that noise to full-size steps of
    # random sign (eps1 = 1e-30), so those are held to "moved by at most lr * sqrt(n) per step".
    state = plain["optimizer"]["state"]
    null_grad = {n for n, s in state.items() if "exp_avg_sq" in s and float(s["exp_avg_sq"].max()) < 1e-14}
    assert null_grad <= {n for n in state if "to_k.bias" in n}, null_grad
    for name, p in plain["model"].items():
        if name in null_grad:
            torch.testing.assert_close(zero["model"][name], p, rtol=0, atol=2 * 2 * 1e-3 * p.numel() ** 0.5, msg=name)
        else:
            torch.testing.assert_close(zero["model"][name], p, rtol=1e-5, atol=1e-7, msg=name)


def test_came_zero1_state_is_the_portable_format_and_loads_back(came_steps):
    plain, zero = came_steps
    ps, zs = plain["optimizer"], zero["optimizer"]
    assert zs["state"].keys() == ps["state"].keys()
    factored = 0
    for name, entry in ps["state"].items():
        assert zs["state"][name].keys() == entry.keys(), name
        factored += "exp_avg_sq_col" in entry
        for key, value in entry.items():
            got = zs["state"][name][key]
            assert got.shape == value.shape, (name, key)
            if "to_k.bias" not in name:  # noise-driven there (see above)
                torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-6, msg=lambda m, k=f"{name}.{key}": f"{k}: {m}")
    assert factored > 10  # the linears and 1x1 convs keep row/column statistics
    backend, model, optimizer = zero["backend"], zero["module"], zero["optim"]
    backend.load_optimizer_state_dict(model, optimizer, ps)
    again = backend.optimizer_state_dict(model, optimizer)
    for name, entry in ps["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(again["state"][name][key], value, msg=f"{name}.{key}")


def test_came_row_masks_are_graph_data_so_every_rank_traces_one_graph():
    """Ranks differ only in which rows of their shard are ZeRO padding (the last ranks'). The
    real-row mask is a transferred tensor, so rank 31 (padding) and rank 0 (none) trace the
    same step graph: one neuronx-cc compile and one cache entry for all ranks. A mask baked
    in as a constant (or a Python slice to the real rows) would give one graph per pattern."""
    import torch_xla

    from training.optim.came import CAME, RowShard
    from training.smoke.trn import step_graph_hash

    device = torch_xla.device()

    def traced(real_rows: int | None) -> str:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 6).to(device))
        b = torch.nn.Parameter(torch.randn(4).to(device))
        opt = CAME([w, b], lr=1e-2)
        if real_rows is not None:
            real = (torch.arange(4) < real_rows).to(device)
            opt.shard({w: RowShard(rows=30, real=real), b: RowShard(rows=30, real=real)}, lambda ts: ts)
        opt.init_state()
        torch_xla.sync()
        w.grad, b.grad = torch.randn(4, 6).to(device), torch.randn(4).to(device)
        opt.step()
        return step_graph_hash([w, b, *[v for s in opt.state.values() for v in s.values() if v.device.type == "xla"]])

    assert traced(4) == traced(2) == traced(0)
    assert traced(None) != traced(4)  # non-vacuity: the hash sees the sharded step's extra sums
