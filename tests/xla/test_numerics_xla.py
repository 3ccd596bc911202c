"""The Trainium backend computes Sana's linear attention in fp32 too (training/model/attention.py).

``torch.autocast("xla", dtype=bf16)`` (bf16-mixed) puts ``matmul`` on its lower-precision list
like CUDA's autocast does, and pure bf16 feeds bf16 q/k/v; either way the processor must
hand the two batched matmuls and the normaliser fp32 tensors. Probed with a dispatch mode on
the XLA device (it sees the dtypes the lazy ops are recorded with), through NeuronBackend.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.backends.neuron import NeuronBackend
from training.backends.neuron_config import NeuronConfig
from training.model.build import ModelConfig, build_model


class _AttnOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.dtypes: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if self.active and name in ("aten::bmm", "aten::div", "aten::matmul"):
            self.dtypes.setdefault(name, set()).update(
                a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point())
        return func(*args, **(kwargs or {}))


def _probe(backend: NeuronBackend, fp32_attention: bool) -> dict[str, set[torch.dtype]]:
    torch.manual_seed(0)
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny", fp32_linear_attention=fp32_attention)))
    probe = _AttnOps()
    attn = model.transformer_blocks[0].attn1
    attn.register_forward_pre_hook(lambda *_: setattr(probe, "active", True))
    attn.register_forward_hook(lambda *_: setattr(probe, "active", False))
    dtype = torch.bfloat16 if backend.precision == "bf16" else torch.float32
    x = dict(hidden_states=torch.randn(2, 4, 8, 8, dtype=dtype).to(backend.device),
             encoder_hidden_states=torch.randn(2, 5, 8, dtype=dtype).to(backend.device),
             timestep=torch.tensor([999.0, 3.0]).to(backend.device))
    with probe, backend.autocast():
        out = model(**x).sample
    assert out.device.type == "xla"
    return probe.dtypes


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_linear_attention_kernels_are_fp32_on_xla(precision: str) -> None:
    backend = NeuronBackend(NeuronConfig(stochastic_rounding=False), precision=precision)
    backend.init()
    got = _probe(backend, fp32_attention=True)
    assert got["aten::bmm"] == {torch.float32} and got["aten::div"] == {torch.float32}


def test_the_probe_sees_bf16_with_diffusers_processor_under_xla_autocast() -> None:
    backend = NeuronBackend(NeuronConfig(), precision="bf16-mixed")
    backend.init()
    assert torch.bfloat16 in _probe(backend, fp32_attention=False)["aten::bmm"]


@pytest.mark.parametrize("zero1", [False, True])
def test_weight_decay_groups_hold_on_xla_parameters_and_zero1(zero1: bool) -> None:
    """The groups are found by name on the model after it moved to the XLA device (new
    Parameter objects), and ZeRO-1 rebuilds its sharded optimizer from those groups: with zero
    gradients only decayed parameters move, by exactly lr * wd * p."""
    import torch_xla

    from training.optim.factory import OptimConfig, no_decay_names, optimizer_factory

    backend = NeuronBackend(NeuronConfig(zero1=zero1), precision="fp32")
    backend.init()
    torch.manual_seed(0)
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny")))
    cfg = OptimConfig(lr=0.1, weight_decay=0.5)
    optimizer = backend.build_optimizer(model, optimizer_factory(cfg, model))
    assert sorted(g["weight_decay"] for g in optimizer.param_groups) == [0.0, 0.5]
    before = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    backend.clip_and_step(model, optimizer, 0.0)
    torch_xla.sync()
    exempt = no_decay_names(model)
    assert "caption_norm.weight" in exempt and "transformer_blocks.0.scale_shift_table" in exempt
    for name, p in model.named_parameters():
        got, was = p.detach().cpu(), before[name]
        want = was if name in exempt else was * (1 - 0.1 * 0.5)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
