"""Helpers shared by the tests/xla modules (imported by name: tests/xla is on sys.path)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: the tiny preset's input shapes (in_channels 4, caption_channels 8)
LATENT_SHAPE = (4, 8, 8)
TEXT_DIM = 8
MAX_TEXT_TOKENS = 8
BATCH = 4


def tiny_tree(features: Path, output_dir: Path, **overrides: Any) -> dict[str, Any]:
    """The config (as YAML would give it) every XLA training test shares: the same graph,
    compiled once per session. ``overrides`` nest with ``__``: ``checkpoint__resume="auto"``."""
    tree: dict[str, Any] = {
        "model": {"preset": "tiny"},
        "data": {"path": str(features), "batch_size": BATCH, "prefetch": 0},
        "objective": {"flow_shift": 3.0, "caption_dropout": 0.1},
        "optim": {"lr": 1.0e-3, "warmup_steps": 2, "schedule": "cosine", "max_grad_norm": 1.0},
        "checkpoint": {"every_steps": 0, "keep_last": 0, "resume": "none"},
        "precision": "fp32",
        "max_steps": 12,
        "seed": 0,
        "output_dir": str(output_dir),
        "log_every": 5,
        "tensorboard": False,
    }
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def tiny_config(features: Path, output_dir: Path, **overrides: Any):
    """``tiny_tree`` as a validated TrainConfig."""
    from training.config import config_from_dict

    return config_from_dict(tiny_tree(features, output_dir, **overrides))


def fixed_draws(steps: int, seed: int = 7) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Host-side (sigma, noise, drop) per step, identical for every backend."""
    from training.objective import shift_sigmas

    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        sigma = shift_sigmas(torch.sigmoid(torch.randn(BATCH, generator=gen)), 3.0)
        noise = torch.randn((BATCH, *LATENT_SHAPE), generator=gen)
        drop = torch.rand(BATCH, generator=gen) < 0.25
        yield sigma, noise, drop


def fixed_noise_objective(steps: int, *, device: torch.device, null_text: torch.Tensor,
                          null_mask: torch.Tensor, vae_scaling_factor: float):
    """The real RectifiedFlow loss with its random draw replaced by host tensors.

    The XLA generator and torch's CPU generator give different numbers for the same seed,
    so comparing backends needs the draw taken out of the device; everything else (scaling,
    caption dropout, interpolation, model call, MSE) is the production code.
    """
    from training.objective import ObjectiveConfig, RectifiedFlow

    draws = fixed_draws(steps)

    class FixedNoiseFlow(RectifiedFlow):
        def sample(self, latents: torch.Tensor):
            return tuple(t.to(latents.device) for t in next(draws))

    return FixedNoiseFlow(ObjectiveConfig(flow_shift=3.0, caption_dropout=0.25),
                          vae_scaling_factor=vae_scaling_factor,
                          null_text=null_text.to(device), null_mask=null_mask.to(device))


def run_steps(backend, features: Path, *, steps: int, max_grad_norm: float = 1.0,
              gradient_checkpointing: bool = False, optimizer: str = "adamw") -> dict[str, Any]:
    """``steps`` optimizer steps of the shared loop's ``train_step`` on ``backend`` with the
    fixed-noise objective (``optimizer``: "adamw" or "came"); returns per-step (loss, grad
    norm) and the final full CPU states."""
    from training.data.loader import FeatureLoader
    from training.loop import train_step
    from training.model.build import ModelConfig, build_model
    from training.optim.factory import OptimConfig, build_scheduler, optimizer_factory

    optim = OptimConfig(name=optimizer, lr=1e-3, warmup_steps=0, max_grad_norm=max_grad_norm)
    torch.manual_seed(0)
    # init="torch": the parity thresholds (and test_parity's null-gradient rule) were set on
    # PyTorch's default init; Sana's caption-norm scale 0.01 makes more gradients ~0 at step 0.
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny", init="torch",
                                                          gradient_checkpointing=gradient_checkpointing)))
    optimizer = backend.build_optimizer(model, optimizer_factory(optim))
    scheduler = build_scheduler(optimizer, optim, max_steps=100)
    loader = FeatureLoader(str(features), batch_size=BATCH, seed=0, prefetch=0)
    null_text, null_mask = loader.null_caption()
    objective = fixed_noise_objective(steps, device=backend.device, null_text=null_text, null_mask=null_mask,
                                      vae_scaling_factor=loader.index.vae_scaling_factor)
    batches = backend.device_batches(loader)
    logged: list[tuple[float, float]] = []
    for _ in range(steps):
        loss, norm = train_step(model, optimizer, scheduler, objective, batches, backend, optim)
        backend.on_host(lambda loss, norm: logged.append((loss, norm)), loss, norm)
        backend.sync()
    return {"logged": logged, "model": backend.model_state_dict(model),
            "optimizer": backend.optimizer_state_dict(model, optimizer), "backend": backend,
            "module": model, "optim": optimizer}
