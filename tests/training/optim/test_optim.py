"""Optimizers (training/optim/factory.py, training/optim/came.py): CAME against its reference, CAME state
round trips and exact resume, and the weight-decay groups on every backend's parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_input_pipeline import _final as all_tensors
from test_loop import run, tiny_config

from training.backends.gpu import GpuBackend, GpuConfig
from training.data.shards import write_synthetic_features
from training.model.build import ModelConfig, build_model
from training.optim.came import CAME
from training.optim.factory import DEFAULT_BETAS, DEFAULT_EPS, OptimConfig, named_groups, optimizer_factory
from training.optim.sharding import from_named_optimizer_state, to_named_optimizer_state


def _problem(seed: int = 0) -> torch.nn.Module:
    """A 2-layer MLP: 2-D weights (factored) and 1-D biases (full second moment)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.SiLU(), torch.nn.Linear(12, 3))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("hyper", [dict(lr=1e-3), dict(lr=3e-2, weight_decay=0.1, clip_threshold=0.5)])
def test_came_matches_came_pytorch_update_for_update(hyper: dict) -> None:
    from came_pytorch import CAME as Reference

    ours_model, ref_model = _problem(), _problem()
    ours, ref = CAME(ours_model.parameters(), **hyper), Reference(ref_model.parameters(), **hyper)
    for i in range(6):
        _steps(ours_model, ours, 1, seed=i)
        _steps(ref_model, ref, 1, seed=i)
        for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(a, b)
    # the factored moments are the reference's too
    w_ours, w_ref = ours_model[0].weight, ref_model[0].weight
    for key in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"):
        assert torch.equal(ours.state[w_ours][key], ref.state[w_ref][key]), key
    assert "exp_avg_sq" in ours.state[ours_model[0].bias]


def test_came_factors_1x1_convs_like_linears_and_keeps_3x3_full() -> None:
    """Sana's CAMEWrapper rule: a 1x1 conv is its (out, in) matrix; a 3x3 conv is not factored."""
    torch.manual_seed(0)
    lin, conv = torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(5, 4, 1, 1))
    conv.data.copy_(lin.data.view(5, 4, 1, 1))
    deep = torch.nn.Parameter(torch.randn(5, 1, 3, 3))
    opt = CAME([lin, conv, deep], lr=1e-2)
    for _ in range(3):
        grad = torch.randn(5, 4)
        lin.grad, conv.grad, deep.grad = grad.clone(), grad.view(5, 4, 1, 1).clone(), torch.randn(5, 1, 3, 3)
        opt.step()
    assert torch.equal(conv.detach().view(5, 4), lin.detach())
    assert {"exp_avg_sq_row", "exp_avg_sq_col"} <= opt.state[conv].keys()
    assert "exp_avg_sq" in opt.state[deep] and "exp_avg_sq_row" not in opt.state[deep]


def test_came_state_round_trip_continues_bit_identically() -> None:
    model = _problem()
    opt = CAME(model.parameters(), lr=1e-2, weight_decay=0.01)
    _steps(model, opt, 3)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = to_named_optimizer_state(model, opt)  # the checkpoint format
    fresh = _problem(seed=9)
    fresh.load_state_dict(saved_model)
    fresh_opt = CAME(fresh.parameters(), lr=5.0)  # hyper-parameters come back from the state
    from_named_optimizer_state(fresh, fresh_opt, saved)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and fresh_opt.param_groups[0]["weight_decay"] == 0.01
    _steps(model, opt, 3, seed=7)
    _steps(fresh, fresh_opt, 3, seed=7)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_optim_config_defaults_per_optimizer() -> None:
    came = OptimConfig(name="came")
    assert came.betas == DEFAULT_BETAS["came"] == (0.9, 0.999, 0.9999)
    assert came.eps == DEFAULT_EPS["came"] == (1e-30, 1e-16)
    assert OptimConfig().betas == (0.9, 0.999) and OptimConfig().eps == 1e-8
    assert OptimConfig(name="came", eps=["1e-30", "1e-16"]).eps == (1e-30, 1e-16)  # YAML strings
    for bad, match in ((dict(name="sgd"), "optim.name"), (dict(name="came", betas=[0.9, 0.99]), "optim.betas"),
                       (dict(eps=[1e-8, 1e-8]), "optim.eps"), (dict(name="came", eps=1e-8), "optim.eps")):
        with pytest.raises(ValueError, match=match):
            OptimConfig(**bad)


# ----- weight-decay groups ---------------------------------------------------------------------
def _expected_no_decay(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters()
            if n.endswith("bias") or "norm" in n or "scale_shift_table" in n}


def _groups(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[float, set[str]]:
    return {wd: set(names) for wd, names in named_groups(model, opt)}


@pytest.mark.parametrize("name", ["adamw", "came"])
def test_no_weight_decay_on_norms_biases_and_scale_shift_tables(name: str) -> None:
    model = build_model(ModelConfig(preset="tiny"))
    cfg = OptimConfig(name=name, weight_decay=0.03)
    opt = optimizer_factory(cfg, model)(model.parameters())
    groups = _groups(model, opt)
    exempt = _expected_no_decay(model)
    assert "caption_norm.weight" in exempt and "scale_shift_table" in exempt
    assert "transformer_blocks.0.scale_shift_table" in exempt
    assert groups == {0.03: {n for n, _ in model.named_parameters()} - exempt, 0.0: exempt}
    # and the exempt ones really do not decay: zero gradient -> AdamW/CAME move only decayed ones
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if n in exempt:
            assert torch.equal(p, before[n]), n


def test_without_weight_decay_there_is_one_group() -> None:
    model = build_model(ModelConfig(preset="tiny"))
    opt = optimizer_factory(OptimConfig(), model)(model.parameters())
    assert len(opt.param_groups) == 1


def test_groups_follow_fsdp2_dtensor_parameters() -> None:
    """FSDP2 replaces the parameters with DTensors; the groups are built from the sharded
    model's names at call time, and CAME steps the DTensors like plain tensors."""
    torch.manual_seed(0)
    plain = build_model(ModelConfig(preset="tiny"))
    backend = GpuBackend(GpuConfig(distributed="fsdp"), precision="fp32")
    backend.init()
    try:
        torch.manual_seed(0)
        sharded = backend.prepare_model(build_model(ModelConfig(preset="tiny")))
        cfg = OptimConfig(name="came", weight_decay=0.03, lr=1e-2)
        opt = backend.build_optimizer(sharded, optimizer_factory(cfg, sharded))
        assert all(hasattr(p, "full_tensor") for g in opt.param_groups for p in g["params"])
        assert _groups(sharded, opt)[0.0] == _expected_no_decay(plain)
        ref = optimizer_factory(cfg, plain)(plain.parameters())
        x = dict(hidden_states=torch.randn(2, 4, 8, 8), encoder_hidden_states=torch.randn(2, 3, 8),
                 timestep=torch.rand(2) * 1000)
        for m, o in ((sharded, opt), (plain, ref)):
            m(**x).sample.square().mean().backward()
            o.step()
        got = backend.model_state_dict(sharded)
        for name, want in plain.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        backend.close()


# ----- exact resume with CAME through the real loop ----------------------------------------------
@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=16, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8,
                             text_tokens=(1, 8), samples_per_shard=8)
    return out


def _final(out: Path, step: int) -> dict[str, torch.Tensor]:
    # every tensor of the checkpoint, whichever file layout training/checkpoint writes
    return all_tensors(out, step)["tensors"]


def test_came_run_resumes_bit_identically(features: Path, tmp_path: Path) -> None:
    # constant schedule: a cosine over max_steps would make the 3-step run a different run
    over = dict(optim__name="came", optim__weight_decay=0.03, optim__grad_accum_steps=1, ema__decay=0.0,
                optim__schedule="constant",
                checkpoint__every_steps=3, tensorboard=False)
    straight = run(tiny_config(features, tmp_path / "a", max_steps=6, **over))
    assert straight.steps == 6
    run(tiny_config(features, tmp_path / "b", max_steps=3, **over))
    resumed = run(tiny_config(features, tmp_path / "b", max_steps=6, **over))
    assert resumed.steps == 3  # it did resume from step 3
    want, got = _final(tmp_path / "a", 6), _final(tmp_path / "b", 6)
    assert want.keys() == got.keys() and any(k.endswith("exp_avg_res_row") for k in want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


# ----- fused AdamW ----------------------------------------------------------------------------
def _bf16_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(16, 6, generator=g).bfloat16()).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_is_the_default_and_steps_like_foreach(dtype: torch.dtype) -> None:
    """optim.fused picks torch's fused kernel on CPU/CUDA; its updates are AdamW's with the same
    param groups, for fp32 and bf16 parameters."""
    start = _problem().to(dtype).state_dict()
    models, opts = [], []
    for fused in (True, False):
        model = _problem().to(dtype)
        opt = optimizer_factory(OptimConfig(lr=1e-2, weight_decay=0.1, fused=fused), model)(model.parameters())
        _steps(model, opt, 5) if dtype == torch.float32 else _bf16_steps(model, opt, 5)
        models.append(model)
        opts.append(opt)
    assert opts[0].defaults["fused"] is True and not opts[1].defaults["fused"]
    assert [len(g["params"]) for g in opts[0].param_groups] == [len(g["params"]) for g in opts[1].param_groups]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        assert a.dtype == dtype and not torch.equal(a, start[name])  # it moved
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_fused_falls_back_where_torch_has_no_fused_kernel() -> None:
    """Parameters on a device without fused AdamW (meta here, XLA on Trainium) keep foreach/for-loop."""
    model = torch.nn.Linear(3, 3, device="meta")
    opt = optimizer_factory(OptimConfig(), model)(model.parameters())
    assert not opt.defaults["fused"]


@pytest.mark.parametrize("saved_fused", [False, True])
def test_checkpoint_resumes_with_this_runs_implementation(saved_fused: bool) -> None:
    """A foreach checkpoint (before optim.fused existed) resumes under fused AdamW and a fused
    one under foreach (Trainium's XLA parameters have no fused kernel); both continue alike."""
    model = _problem()
    old = optimizer_factory(OptimConfig(lr=1e-2, fused=saved_fused), model)(model.parameters())
    _steps(model, old, 3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = to_named_optimizer_state(model, old)
    finals = []
    for fused in (True, False):
        model.load_state_dict(weights)
        opt = optimizer_factory(OptimConfig(lr=1e-2, fused=fused), model)(model.parameters())
        from_named_optimizer_state(model, opt, {**state, "state": {
            n: {k: v.clone() for k, v in s.items()} for n, s in state["state"].items()}})
        # the group keeps this run's implementation, not the checkpoint's
        assert bool(opt.param_groups[0]["fused"]) is fused
        _steps(model, opt, 2, seed=2)
        finals.append({k: v.clone() for k, v in model.state_dict().items()})
    for name, want in finals[1].items():
        torch.testing.assert_close(finals[0][name], want, rtol=1e-5, atol=1e-6, msg=name)
