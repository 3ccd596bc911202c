"""Activation checkpointing modes (training/model/activation_checkpointing.py): every mode computes
the gradients of no checkpointing, and each recomputes what it claims to (counted)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.errors import UserError
from training.model.activation_checkpointing import checkpointed_blocks
from training.model.build import ModelConfig, build_model

LAYERS = 3


class _CountOps(TorchDispatchMode):
    """Counts forward convolutions (the Mix-FFN's) executed while active."""

    def __init__(self) -> None:
        super().__init__()
        self.convolutions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.convolutions += 1
        return func(*args, **(kwargs or {}))


def _grads(
    mode: str, *, every_n: int = 2, autocast: bool = False
) -> tuple[dict[str, torch.Tensor], list[int], int]:
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            preset="tiny",
            overrides={"num_layers": LAYERS},
            activation_checkpointing=mode,
            checkpoint_every_n=every_n,
        )
    )
    calls = [0] * LAYERS
    for i, block in enumerate(model.transformer_blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(
            torch.randn(2, 4, 8, 8),
            torch.randn(2, 5, 8),
            torch.tensor([10.0, 900.0]),
            encoder_attention_mask=torch.ones(2, 5),
            return_dict=False,
        )[0]
    counter = _CountOps()
    with counter:
        out.float().square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls, counter.convolutions


@pytest.mark.parametrize("mode", ["full", "every_n", "selective"])
def test_every_mode_gives_the_gradients_of_no_checkpointing(mode: str) -> None:
    want, calls_none, conv_none = _grads("none")
    got, calls, conv = _grads(mode)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=name)
    # forward pre-hooks fire again for each recomputed block (post-hooks may not: non-reentrant
    # recomputation stops early once it has the saved tensors)
    recomputed = [i for i in range(LAYERS) if calls[i] == 2]
    assert calls_none == [1] * LAYERS
    assert recomputed == checkpointed_blocks(LAYERS, mode, 2)
    if mode == "every_n":
        assert recomputed == [1]  # blocks n-1, 2n-1, ...
    # selective keeps the convolution outputs (no convolution re-runs in backward); full
    # recomputes all of them
    assert conv_none == 0
    assert (conv == 0) if mode == "selective" else (conv > 0)


def test_selective_matches_in_bf16_autocast() -> None:
    want, _, _ = _grads("none", autocast=True)
    got, calls, _ = _grads("selective", autocast=True)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=name)
    assert calls == [2] * LAYERS


def test_config_modes_and_the_deprecated_alias(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        assert ModelConfig(gradient_checkpointing=True).activation_checkpointing == "full"
    assert sum("deprecated" in r.message for r in caplog.records) == 1
    assert ModelConfig(gradient_checkpointing=False).activation_checkpointing == "none"
    assert ModelConfig(activation_checkpointing="every_n").gradient_checkpointing is True
    with pytest.raises(ValueError, match="activation_checkpointing: 'some' is not one of"):
        ModelConfig(activation_checkpointing="some")
    with pytest.raises(ValueError, match="contradicts"):
        ModelConfig(activation_checkpointing="selective", gradient_checkpointing=False)


def test_yaml_alias_still_loads(tmp_path) -> None:
    from training.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: tiny\n  gradient_checkpointing: true\n")
    assert load_config(["--config", str(path)]).model.activation_checkpointing == "full"
    with pytest.raises(UserError, match="model.activation_checkpointing"):
        load_config(["--config", str(path), "--set", "model.activation_checkpointing=partial"])
