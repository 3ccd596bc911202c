"""A diffusers-style Sana training step: the baseline ``bench --compare-reference`` measures against.

Written the way diffusers' example trains Sana (examples/dreambooth/train_dreambooth_lora_sana.py,
diffusers v0.32+, the training loop inside ``main``), with the full model trained instead of
LoRA adapters, as diffusers' full fine-tuning examples do (train_text_to_image.py: fp32 model,
``accelerator.autocast`` under ``--mixed_precision bf16``):

- the model: diffusers' ``SanaTransformer2DModel`` with diffusers' own init and attention
  processors, fp32 weights, wrapped as a whole in DDP when there are several ranks
  (``accelerator.prepare``), not compiled;
- timesteps: ``u = compute_density_for_timestep_sampling("logit_normal", ...)``
  (diffusers training_utils.py: sigmoid of a normal), ``indices = (u * num_train_timesteps).long()``,
  ``timesteps = scheduler.timesteps[indices]``, sigmas looked up per sample with the script's
  ``get_sigmas`` (one ``(schedule_timesteps == t).nonzero().item()`` per sample, a host sync
  each, as the script does), from a ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``;
- ``noisy = (1 - sigma) * x + sigma * noise``, target ``noise - x``, loss = per-sample mean of
  ``weighting * (pred.float() - target.float()) ** 2`` then the mean (``weighting`` = 1 for
  logit_normal: ``compute_loss_weighting_for_sd3``);
- forward under ``torch.autocast(bf16)`` for bf16-mixed; ``loss.backward()``,
  ``clip_grad_norm_`` on all parameters, ``optimizer.step()``, ``optimizer.zero_grad()``;
- ``torch.optim.AdamW`` with the default (foreach, not fused) implementation;
- captions at the full padded length (the script encodes every prompt to ``max_sequence_length``).

What it leaves out of the script: the data loader, VAE encoding (latents come precomputed, as
with ``--cache_latents``), the LR scheduler step (a constant schedule is a no-op) and logging.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from training.errors import UserError

Batch = dict[str, torch.Tensor]


class ReferenceStep:
    """One diffusers-style optimizer step per call on a host batch (moved to ``device``).

    Args:
        model_kwargs: ``SanaTransformer2DModel`` kwargs (the same preset our step trains).
        device: where the model and batches live.
        precision: "bf16-mixed" (fp32 weights + bf16 autocast) or "fp32".
        lr, betas, eps, weight_decay, max_grad_norm: the optimizer settings (ours, for a fair match).
        flow_shift, logit_mean, logit_std: the timestep distribution (as our objective).
        vae_scaling_factor: latents are stored unscaled (training/data.py).
        world_size: > 1 wraps the model in DDP (process group already initialised).
    """

    def __init__(
        self,
        model_kwargs: dict[str, Any],
        *,
        device: torch.device,
        precision: str,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        flow_shift: float = 3.0,
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        vae_scaling_factor: float = 1.0,
        world_size: int = 1,
    ) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, SanaTransformer2DModel

        self.device = device
        self.autocast = precision == "bf16-mixed"
        with torch.device(device):
            model: nn.Module = SanaTransformer2DModel(**model_kwargs)
        model.train()
        self.inner = model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None
            )
        self.model = model
        self.optimizer = torch.optim.AdamW(
            self.inner.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        self.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=flow_shift)
        self.max_grad_norm = max_grad_norm
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.scale = float(vae_scaling_factor)

    def _sigmas(self, timesteps: torch.Tensor, n_dim: int) -> torch.Tensor:
        """The script's ``get_sigmas``: each timestep looked up in the schedule (a sync per sample)."""
        sigmas = self.scheduler.sigmas.to(device=self.device, dtype=torch.float32)
        schedule = self.scheduler.timesteps.to(self.device)
        indices = [(schedule == t).nonzero().item() for t in timesteps.to(self.device)]
        sigma = sigmas[indices].flatten()
        while sigma.ndim < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def __call__(self, batch: Batch) -> torch.Tensor:
        """Train on ``batch`` ({"latents", "text", "text_mask"}); returns the detached loss."""
        from diffusers.training_utils import compute_density_for_timestep_sampling

        cuda = self.device.type == "cuda"
        batch = {k: v.to(self.device, non_blocking=cuda) for k, v in batch.items()}
        x = batch["latents"].float() * self.scale
        noise = torch.randn_like(x)
        u = compute_density_for_timestep_sampling(
            weighting_scheme="logit_normal",
            batch_size=x.shape[0],
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
        )
        indices = (u * self.scheduler.config.num_train_timesteps).long()
        timesteps = self.scheduler.timesteps[indices].to(device=self.device)
        sigmas = self._sigmas(timesteps, x.ndim)
        noisy = (1.0 - sigmas) * x + sigmas * noise
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            pred = self.model(
                hidden_states=noisy,
                encoder_hidden_states=batch["text"],
                encoder_attention_mask=batch["text_mask"],
                timestep=timesteps,
                return_dict=False,
            )[0]
        target = noise - x
        loss = torch.mean(((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.inner.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()


# ----- ours vs the reference, interleaved in one process -------------------------------------


@dataclasses.dataclass(kw_only=True)
class Comparison:
    """Seconds per repetition of each step, interleaved (ours, reference, ours, ...)."""

    steps_per_repetition: int
    seconds_ours: list[float]
    seconds_reference: list[float]
    samples_per_step: int  # global samples per optimizer step (both)
    final_loss_ours: float
    final_loss_reference: float
    update_ours: float  # L2 norm of the change of a sample of the weights (proof that it trained)
    update_reference: float
    tokens: Any  # training.text_trim.StepTokens over our timed steps (rank 0)
    reference_tokens: Any  # the same for the reference's (untrimmed) batches

    def samples_per_s(self, seconds: list[float]) -> float:
        return self.samples_per_step * self.steps_per_repetition * len(seconds) / sum(seconds)


def _weights_sample(model: nn.Module) -> torch.Tensor:
    """Up to 64 values of every parameter (this rank's shard under FSDP), as one fp32 CPU vector."""
    parts = []
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        parts.append(local.detach().flatten()[:64].float().cpu())
    return torch.cat(parts) if parts else torch.zeros(1)


def compare(
    cfg: Any, backend: Any, *, repetitions: int, steps: int, warmup: int, batches_in_memory: int = 4
) -> Comparison:
    """Our production step (``training.loop.train_step`` on the backend's prepared model, with
    caption trimming) and ``ReferenceStep`` on the same host batches, model preset, batch and
    precision; ``warmup`` steps of each first, then ``repetitions`` x (``steps`` of ours,
    ``steps`` of the reference), each block device-synchronised at both ends, so machine
    noise falls on both alike. ``backend`` must be initialised."""
    import itertools
    import time

    from training.bench import drain
    from training.data import FeatureLoader
    from training.loop import _throughput_fn, train_step
    from training.model import build_model
    from training.objective import RectifiedFlow
    from training.optim import build_scheduler, optimizer_factory
    from training.text_trim import StepTokens, TokenMeter, trimmed

    if cfg.optim.grad_accum_steps != 1:
        raise UserError(
            "--compare-reference: needs optim.grad_accum_steps=1 (the reference steps once per batch)"
        )
    if getattr(getattr(cfg, "lora", None), "enabled", False):
        raise UserError("--compare-reference: compares full training; set lora.rank=0")
    torch.manual_seed(cfg.seed)
    loader = FeatureLoader.from_config(cfg.data, rank=backend.rank, world_size=backend.world_size)
    try:
        host = [{k: v.clone() for k, v in next(loader).items()} for _ in range(batches_in_memory)]
        null_text, null_mask = loader.null_caption()
        scaling = loader.index.vae_scaling_factor
    finally:
        loader.close()
    model = backend.prepare_model(build_model(cfg.model))
    inner = backend.unwrap(model)
    optimizer = backend.build_optimizer(model, optimizer_factory(cfg.optim, inner))
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=warmup + repetitions * steps + 1)
    objective = RectifiedFlow(
        cfg.objective,
        vae_scaling_factor=scaling,
        null_text=null_text.to(backend.device),
        null_mask=null_mask.to(backend.device),
        rank=backend.rank,
        world_size=backend.world_size,
    )
    meter, ref_meter = TokenMeter(), TokenMeter()
    lengths = cfg.text_trim.lengths if backend.trims_text and cfg.text_trim.enabled else None
    ours_batches = backend.device_batches(
        trimmed(itertools.cycle(host), lengths=lengths, floor=int(null_mask.sum()), meter=meter)
    )
    ref_batches = trimmed(itertools.cycle(host), lengths=None, meter=ref_meter)
    count, _ = _throughput_fn(cfg, backend, inner)
    reference = ReferenceStep(
        cfg.model.model_kwargs(),
        device=backend.device,
        precision=cfg.precision,
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        **(
            {"betas": tuple(cfg.optim.betas), "eps": float(cfg.optim.eps)}
            if cfg.optim.name == "adamw" and cfg.optim.betas and cfg.optim.eps
            else {}
        ),
        max_grad_norm=cfg.optim.max_grad_norm or 1.0,
        flow_shift=cfg.objective.flow_shift,
        logit_mean=cfg.objective.logit_mean,
        logit_std=cfg.objective.logit_std,
        vae_scaling_factor=scaling,
        world_size=backend.world_size,
    )
    before = (_weights_sample(inner), _weights_sample(reference.inner))
    ours_tokens: list[StepTokens] = []
    ref_tokens: list[StepTokens] = []
    losses: dict[str, torch.Tensor] = {}

    def ours() -> None:
        losses["ours"], _ = train_step(
            model, optimizer, scheduler, objective, ours_batches, backend, cfg.optim
        )
        backend.sync()
        ours_tokens.append(count(meter.take(1)))

    def ref() -> None:
        losses["ref"] = reference(next(ref_batches))
        ref_tokens.append(count(ref_meter.take(1)))

    def timed(step: Any) -> float:
        drain(backend.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        drain(backend.device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        ours()
        ref()
    t_ours: list[float] = []
    t_ref: list[float] = []
    for _ in range(repetitions):
        t_ours.append(timed(ours))
        t_ref.append(timed(ref))
    after = (_weights_sample(inner), _weights_sample(reference.inner))
    return Comparison(
        steps_per_repetition=steps,
        seconds_ours=t_ours,
        seconds_reference=t_ref,
        samples_per_step=cfg.data.batch_size * backend.world_size,
        final_loss_ours=float(losses["ours"].float().cpu()),
        final_loss_reference=float(losses["ref"].float().cpu()),
        update_ours=float((after[0] - before[0]).norm()),
        update_reference=float((after[1] - before[1]).norm()),
        tokens=sum(ours_tokens[warmup:], StepTokens()),
        reference_tokens=sum(ref_tokens[warmup:], StepTokens()),
    )
