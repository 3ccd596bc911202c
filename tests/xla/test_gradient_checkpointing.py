"""Activation checkpointing on XLA: torch's version fails there, the backend swaps in
torch_xla's, and the step computes the same thing as without checkpointing."""

from __future__ import annotations

import pytest
import torch
from xla_helpers import run_steps

from training.backends.gpu import GpuBackend, GpuConfig
from training.backends.neuron import NeuronBackend
from training.backends.neuron_config import NeuronConfig


@pytest.mark.slow
def test_gradient_checkpointing_uses_torch_xla_and_matches(features):
    from torch_xla.utils.checkpoint import checkpoint

    reference = GpuBackend(GpuConfig(), precision="fp32")
    reference.init()
    plain = run_steps(reference, features, steps=1)
    xla = NeuronBackend(NeuronConfig(), precision="fp32")
    xla.init()
    ckpt = run_steps(xla, features, steps=1, gradient_checkpointing=True)

    model = ckpt["module"]
    assert model.is_gradient_checkpointing
    assert model._checkpoint_fn is checkpoint  # training/model/activation_checkpointing.py's hook
    (pl, pn), (cl, cn) = plain["logged"][0], ckpt["logged"][0]
    assert cl == pytest.approx(pl, rel=1e-4)
    assert cn == pytest.approx(pn, rel=1e-4)
    for name, p in plain["model"].items():
        # the key bias has a zero gradient up to rounding; AdamW makes that an lr-sized step of
        # random sign (see test_parity.py), so it is held to one step's size
        atol = 2e-3 if name.endswith("to_k.bias") else 1e-6
        torch.testing.assert_close(ckpt["model"][name], p, rtol=1e-4, atol=atol, msg=name)


def test_selective_checkpointing_is_refused_on_trainium():
    """Op-level SAC needs eager per-op dispatch, which lazy XLA tracing does not give."""
    from training.errors import UserError
    from training.model.build import ModelConfig, build_model

    backend = NeuronBackend(NeuronConfig(), precision="fp32")
    backend.init()
    model = build_model(ModelConfig(preset="tiny", activation_checkpointing="selective"))
    with pytest.raises(UserError, match=r"'selective' is not supported on the trainium backend; use one of "
                                        r"none, full, every_n"):
        backend.prepare_model(model)
