"""LoRA on the Trainium backend (torch-xla on PJRT CPU, one process): ZeRO-1 shards only the
adapter parameters, a step trains them, and the frozen base stays bit-identical.

(One device: the ZeRO-1 wrapper runs its real reduce-scatter / sharded-AdamW / all-gather
path with one shard; cross-rank sharding is proven on a trn node, see test_zero1.py.)
"""

from __future__ import annotations

import pytest
import torch
from xla_helpers import BATCH, fixed_noise_objective

from training.backends.neuron import NeuronBackend
from training.backends.neuron_config import NeuronConfig
from training.model.lora import LoraConfig, apply_lora, is_adapter_key

STEPS = 2


@pytest.mark.slow  # ~20 s each: one XLA compile per precision
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lora_step_with_zero1_trains_only_the_adapters(features, precision):
    """fp32, and pure bf16 (bf16 weights, ZeRO-1's fp32 master shards of the adapters only)."""
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    from training.data.loader import FeatureLoader
    from training.loop import train_step
    from training.model.build import ModelConfig, build_model
    from training.optim.factory import OptimConfig, build_scheduler, optimizer_factory

    backend = NeuronBackend(NeuronConfig(zero1=True), precision=precision)
    backend.init()
    torch.manual_seed(0)
    raw = apply_lora(build_model(ModelConfig(preset="tiny", init="torch")), LoraConfig(rank=2, alpha=4.0))
    before = {k: v.detach().clone() for k, v in raw.state_dict().items()}
    model = backend.prepare_model(raw)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, weight_decay=0.01)
    optimizer = backend.build_optimizer(model, optimizer_factory(optim, model))
    assert isinstance(optimizer, ZeroRedundancyOptimizer)
    sharded = {id(p) for g in optimizer.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in backend.unwrap(model).named_parameters() if is_adapter_key(n)}
    assert sharded == adapters  # ZeRO-1 state exists for the adapters only
    scheduler = build_scheduler(optimizer, optim, max_steps=10)
    loader = FeatureLoader(str(features), batch_size=BATCH, seed=0, prefetch=0)
    null_text, null_mask = loader.null_caption()
    objective = fixed_noise_objective(
        STEPS,
        device=backend.device,
        null_text=null_text,
        null_mask=null_mask,
        vae_scaling_factor=loader.index.vae_scaling_factor,
    )
    batches = backend.device_batches(loader)
    logged = []
    for _ in range(STEPS):
        loss, norm = train_step(model, optimizer, scheduler, objective, batches, backend, optim)
        backend.on_host(lambda loss, norm: logged.append((loss, norm)), loss, norm)
        backend.sync()
    backend.barrier()
    after = backend.model_state_dict(model)
    assert len(logged) == STEPS and all(torch.isfinite(torch.tensor(v)).all() for v in logged)
    moved = [k for k in after if ".lora_B." in k and after[k].abs().max() > 0]
    assert moved and len(moved) == sum(".lora_B." in k for k in after)
    for key, value in after.items():
        if not is_adapter_key(key):
            # frozen: bit-identical (in bf16: the init cast once, never updated)
            assert torch.equal(value.cpu(), before[key].to(value.dtype)), key
    state = backend.optimizer_state_dict(model, optimizer)["state"]
    assert state and all(is_adapter_key(name) for name in state)


@pytest.mark.slow
def test_lora_with_activation_checkpointing_gets_adapter_gradients():
    """torch_xla's checkpoint is reentrant: a block's output has a gradient only if an input
    has one, and with a frozen patch embedding none would (apply_lora's input hook). Adapter
    gradients with full checkpointing must equal those without."""
    from training.model.build import ModelConfig, build_model

    backend = NeuronBackend(NeuronConfig(), precision="fp32")
    backend.init()
    grads = {}
    for mode in ("none", "full"):
        torch.manual_seed(0)
        raw = build_model(ModelConfig(preset="tiny", init="torch", activation_checkpointing=mode))
        raw = apply_lora(raw, LoraConfig(rank=2, init="default"))
        with torch.no_grad():
            for name, p in raw.named_parameters():
                if ".lora_B." in name:
                    p.normal_(generator=torch.Generator().manual_seed(1))
        model = backend.prepare_model(raw)
        gen = torch.Generator().manual_seed(2)
        x, text, t = (
            torch.randn(2, 4, 8, 8, generator=gen),
            torch.randn(2, 8, 8, generator=gen),
            torch.rand(2) * 1000,
        )
        out = model(x.to(backend.device), text.to(backend.device), t.to(backend.device)).sample
        out.pow(2).mean().backward()
        backend.sync()  # one graph for forward + backward, not one per .cpu() below
        grads[mode] = {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads["full"]) == 12
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], g, rtol=1e-5, atol=1e-7, msg=name)
