"""Checkpoints are portable: one written on XLA resumes on the GPU backend and vice versa."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from xla_helpers import tiny_config

from training.backends.gpu import GpuBackend, GpuConfig
from training.backends.neuron import NeuronBackend
from training.backends.neuron_config import NeuronConfig
from training.checkpoint.consolidate import load_full
from training.checkpoint.layout import STATE_FILE, find_latest, verify
from training.loop import train
from training.model.build import ModelConfig, build_model
from training.optim.factory import OptimConfig, optimizer_factory


def _files(ckpt: Path) -> tuple[dict, dict]:
    """(model state, portable optimizer state) of either checkpoint format, consolidated."""
    full = load_full(ckpt)
    return full["model"], full["optimizer"]


def _assert_same_optimizer_state(got: dict, want: dict) -> None:
    assert got["state"].keys() == want["state"].keys()
    for name, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][name][key].cpu(), value), f"{name}.{key}"
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]


def _load_into(backend, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """Load files' state into ``backend`` and read it back out through the same backend."""
    torch.manual_seed(1)  # a different init, so a no-op load cannot pass
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny")))
    optimizer = backend.build_optimizer(model, optimizer_factory(OptimConfig()))
    backend.load_model_state_dict(model, model_sd)
    backend.load_optimizer_state_dict(model, optimizer, optim_sd)
    return backend.model_state_dict(model), backend.optimizer_state_dict(model, optimizer)


def test_xla_checkpoint_loads_bit_exactly_and_resumes_on_gpu_backend(xla_run, features, tmp_path):
    ckpt = find_latest(xla_run["out"] / "checkpoints")
    assert ckpt is not None and ckpt.name == "step-00000012" and verify(ckpt) is not None
    meta = json.loads((ckpt / STATE_FILE).read_text())
    assert meta["backend"]["backend"] == "trainium"
    model_sd, optim_sd = _files(ckpt)
    assert all(t.device.type == "cpu" for t in model_sd.values())

    gpu = GpuBackend(GpuConfig(), precision="fp32")
    gpu.init()
    got_model, got_optim = _load_into(gpu, model_sd, optim_sd)
    assert got_model.keys() == model_sd.keys()
    assert all(torch.equal(got_model[k], v) for k, v in model_sd.items())
    _assert_same_optimizer_state(got_optim, optim_sd)

    cfg = tiny_config(features, tmp_path, checkpoint__resume=str(ckpt), max_steps=14)
    result = train(cfg, GpuBackend(cfg.gpu, precision=cfg.precision))
    assert result.steps == 2
    resumed = find_latest(tmp_path / "checkpoints")
    assert resumed.name == "step-00000014"
    _, optim_after = _files(resumed)
    assert {float(e["step"]) for e in optim_after["state"].values()} == {14.0}


def test_gpu_checkpoint_loads_bit_exactly_and_resumes_on_xla_without_recompiling(xla_run, features, tmp_path):
    gpu_cfg = tiny_config(features, tmp_path / "gpu", max_steps=3)
    gpu = GpuBackend(gpu_cfg.gpu, precision=gpu_cfg.precision)
    gpu.init()
    train(gpu_cfg, gpu)
    ckpt = find_latest(tmp_path / "gpu" / "checkpoints")
    assert ckpt is not None and ckpt.name == "step-00000003"
    model_sd, optim_sd = _files(ckpt)

    xla = NeuronBackend(NeuronConfig(), precision="fp32")
    xla.init()
    got_model, got_optim = _load_into(xla, model_sd, optim_sd)
    assert all(torch.equal(got_model[k], v) for k, v in model_sd.items())
    _assert_same_optimizer_state(got_optim, optim_sd)

    # resume through the loop: the restored AdamW state makes step 4 the steady graph that
    # xla_run compiled already, so no compile happens at all
    cfg = tiny_config(features, tmp_path / "xla", checkpoint__resume=str(ckpt), max_steps=5)
    before = xla.compile_stats()["compiles"]
    result = train(cfg, xla)
    assert result.steps == 2
    assert xla.compile_stats()["compiles"] == before
    resumed = find_latest(tmp_path / "xla" / "checkpoints")
    assert resumed.name == "step-00000005"
    _, optim_after = _files(resumed)
    assert {float(e["step"]) for e in optim_after["state"].values()} == {5.0}
    assert result.final_loss is not None and result.final_loss == pytest.approx(result.final_loss)
