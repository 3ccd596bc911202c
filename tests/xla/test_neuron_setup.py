"""Configuration, environment and packaging of the Trainium backend (no graph compiles)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from training.backends.neuron import NeuronBackend
from training.backends.neuron_config import NeuronConfig
from training.backends.neuron_runtime import (
    COMPILE_CACHE_ENV,
    STOCHASTIC_ROUNDING_ENV,
    apply_neuron_env,
    neuron_status,
)
from training.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def test_bf16_sets_stochastic_rounding_and_refuses_it_off():
    env: dict[str, str] = {}
    assert apply_neuron_env(NeuronConfig(), "bf16", env)[STOCHASTIC_ROUNDING_ENV] == "1"
    assert STOCHASTIC_ROUNDING_ENV not in apply_neuron_env(NeuronConfig(), "bf16-mixed", {})
    with pytest.raises(UserError, match=STOCHASTIC_ROUNDING_ENV):
        apply_neuron_env(NeuronConfig(), "bf16", {STOCHASTIC_ROUNDING_ENV: "0"})
    # an explicit opt-out is respected
    assert apply_neuron_env(NeuronConfig(stochastic_rounding=False), "bf16",
                            {STOCHASTIC_ROUNDING_ENV: "0"}).get(STOCHASTIC_ROUNDING_ENV) is None


def test_compile_cache_and_compiler_flags_are_exported_once():
    env = {"NEURON_CC_FLAGS": "--retry_failed_compilation"}
    cfg = NeuronConfig(compile_cache_url="s3://bucket/neuron-cache", allreduce_bucket_mb=64)
    apply_neuron_env(cfg, "bf16-mixed", env)
    apply_neuron_env(cfg, "bf16-mixed", env)  # idempotent: flags are not appended twice
    assert env[COMPILE_CACHE_ENV] == "s3://bucket/neuron-cache"
    assert env["NEURON_CC_FLAGS"].split() == ["--retry_failed_compilation", "--model-type=transformer"]
    assert env["ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB"] == "64"
    assert env["XLA_NO_SPECIAL_SCALARS"] == "1"


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"compile_cache_url": "relative/cache"}, "trainium.compile_cache_url"),
    ({"compile_cache_url": "s3://"}, "trainium.compile_cache_url"),
    ({"precompile_steps": 0}, "trainium.precompile_steps"),
    ({"allreduce_bucket_mb": -1}, "trainium.allreduce_bucket_mb"),
])
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        NeuronConfig(**kwargs)


def test_config_section_loads_through_train_config(features, tmp_path):
    from xla_helpers import tiny_config

    cfg = tiny_config(features, tmp_path, trainium__zero1=True, trainium__compile_cache_url="/fsx/neuron-cache")
    assert cfg.trainium.zero1 and cfg.trainium.compile_cache_url == "/fsx/neuron-cache"


def test_missing_neuron_packages_are_reported_not_fatal():
    available, note = neuron_status()
    assert available is False  # PyPI has only a placeholder; the real one is on the Neuron repository
    assert "torch-neuronx" in note and "requirements-neuron.txt" in note
    backend = NeuronBackend(NeuronConfig(), precision="fp32")
    backend.init()
    assert backend.device.type == "xla" and backend.world_size == 1 and backend.rank == 0
    assert backend.broadcast_object({"a": 1}) == {"a": 1}
    backend.barrier()
    backend.close()


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="precision"):
        NeuronBackend(NeuronConfig(), precision="fp16")


def test_requirements_pin_the_tested_torch_xla_pair():
    import torch
    import torch_xla

    neuron = _pins(REPO / "training" / "requirements-neuron.txt")
    gpu = _pins(REPO / "training" / "requirements-gpu.txt")
    assert neuron["torch"] == torch.__version__.split("+")[0]
    assert neuron["torch-xla"] == torch_xla.__version__.split("+")[0]
    assert neuron["torch"].rsplit(".", 1)[0] == neuron["torch-xla"].rsplit(".", 1)[0]
    assert neuron["torch-neuronx"].startswith(neuron["torch"] + ".")  # torch-neuronx 2.9.0.x pairs with torch 2.9.0
    shared = (set(neuron) & set(gpu)) - {"torch"}
    assert {"diffusers", "transformers", "safetensors"} <= shared
    assert {n: neuron[n] for n in shared} == {n: gpu[n] for n in shared}, "both backends must build the same model"
    text = (REPO / "training" / "requirements-neuron.txt").read_text()
    assert len(re.findall(r"^# Neuron SDK release: \d+\.\d+\.\d+", text, re.M)) == 1
    assert "pip.repos.neuron" not in text  # the index URL comes from platform-settings.json


def test_xla_test_requirements_take_pins_from_the_neuron_file():
    lines = [line.strip() for line in (REPO / "training" / "requirements-xla-test.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "-c requirements-neuron.txt" in lines
    assert "torch" in lines and "torch-xla" in lines


def test_accelerator_names_match_the_flops_table():
    from training.backends.neuron_runtime import neuron_accelerator
    from training.model.flops import ACCELERATORS

    assert neuron_accelerator("trn1.32xlarge", {}) == "NeuronCore-v2"
    assert neuron_accelerator("trn1n.32xlarge", {}) == "NeuronCore-v2"
    assert neuron_accelerator("trn2.48xlarge", {}) == "NeuronCore-v3-LNC2"
    for name in ("NeuronCore-v2", "NeuronCore-v3-LNC2"):
        assert name in ACCELERATORS


@pytest.mark.parametrize("mb", [0, 25])
def test_bucket_size_is_exported_even_when_zero_and_survives_torch_xla_neuron_defaults(monkeypatch, mb):
    """torch-xla's Neuron start-up setdefault()s ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB=50; the
    configured value (0 = one all-reduce) must be what xm.reduce_gradients then reads."""
    from torch_xla._internal import neuron as xla_neuron

    monkeypatch.delenv("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB", raising=False)
    xla_neuron.set_envvar_defaults()  # control: unset, Neuron's default applies
    import os

    assert os.environ["ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB"] == "50"
    monkeypatch.delenv("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB")
    apply_neuron_env(NeuronConfig(allreduce_bucket_mb=mb), "fp32")
    xla_neuron.set_envvar_defaults()
    assert os.environ["ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB"] == str(mb)


def test_zero1_collectives_are_configured_as_nxd():
    """pin_layout=False and coalesced (bucketed) reduce-scatter / all-gather of
    trainium.zero1_bucket_mb; test_zero1.py proves the update still equals the unsharded one."""
    import torch

    from training.model.build import ModelConfig, build_model
    from training.optim.factory import OptimConfig, optimizer_factory

    backend = NeuronBackend(NeuronConfig(zero1=True, zero1_bucket_mb=8), precision="fp32")
    backend.init()
    torch.manual_seed(0)
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny")))
    zero = backend.build_optimizer(model, optimizer_factory(OptimConfig(), model))
    assert zero.pin_layout is False
    assert zero.coalesce_cc_reduce_scatter and zero.coalesce_cc_all_gather
    assert zero.bucket_cap_mb_reduce_scatter == zero.bucket_cap_mb_all_gather == 8
    with pytest.raises(ValueError, match="trainium.zero1_bucket_mb"):
        NeuronConfig(zero1_bucket_mb=-1)
