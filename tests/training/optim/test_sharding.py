"""The portable, name-keyed optimizer format (training/optim/sharding.py) and the GPU
backend's state dicts: plain and FSDP2 produce and accept the same thing."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from training.backends.gpu import GpuBackend, GpuConfig
from training.model.build import ModelConfig, build_model
from training.optim.sharding import from_named_optimizer_state, to_named_optimizer_state


def _stepped(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        out = model(torch.randn(2, 4, 8, 8), torch.randn(2, 3, 8), torch.rand(2) * 1000, return_dict=False)[0]
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_same(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    else:
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_named_format_is_torch_dcp_full_format() -> None:
    model, opt = _stepped()
    ours = to_named_optimizer_state(model, opt)
    dcp = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert set(ours["state"]) == {n for n, _ in model.named_parameters()}
    _assert_same(ours["state"], dcp["state"])
    assert ours["param_groups"][0]["params"] == dcp["param_groups"][0]["params"]
    assert all(t.device.type == "cpu" for s in ours["state"].values() for t in s.values())


def test_round_trip_continues_identically() -> None:
    model, opt = _stepped()
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = to_named_optimizer_state(model, opt)
    fresh = build_model(ModelConfig(preset="tiny"))
    fresh.load_state_dict(saved_model)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5.0)  # lr comes back from the state
    from_named_optimizer_state(fresh, fresh_opt, saved)
    _assert_same(to_named_optimizer_state(fresh, fresh_opt), saved)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        torch.manual_seed(3)
        out = m(torch.randn(2, 4, 8, 8), torch.randn(2, 3, 8), torch.rand(2) * 1000, return_dict=False)[0]
        out.square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_wrong_parameter_set_is_refused() -> None:
    model, opt = _stepped()
    saved = to_named_optimizer_state(model, opt)
    saved["param_groups"][0]["params"][0] = "not.a.parameter"
    with pytest.raises(ValueError, match="different parameter set"):
        from_named_optimizer_state(model, torch.optim.AdamW(model.parameters()), saved)


def test_fsdp_backend_reads_and_writes_the_plain_format() -> None:
    """A checkpoint from a plain/DDP run loads under FSDP2 and comes back out unchanged."""
    model, opt = _stepped()
    model_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_sd = to_named_optimizer_state(model, opt)
    backend = GpuBackend(GpuConfig(distributed="fsdp"), precision="fp32")
    backend.init()
    try:
        prepared = backend.prepare_model(build_model(ModelConfig(preset="tiny")))
        fsdp_opt = backend.build_optimizer(prepared, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        backend.load_model_state_dict(prepared, model_sd)
        backend.load_optimizer_state_dict(prepared, fsdp_opt, opt_sd)
        _assert_same(backend.model_state_dict(prepared), model_sd)
        _assert_same(backend.optimizer_state_dict(prepared, fsdp_opt)["state"], opt_sd["state"])
    finally:
        backend.close()
