"""A diffusers-style Sana training step, tuned: the baseline ``bench --compare-reference`` measures against.

Written the way diffusers' example trains Sana (examples/dreambooth/train_dreambooth_lora_sana.py,
diffusers v0.32+, the training loop inside ``main``), with the full model trained instead of
LoRA adapters, as diffusers' full fine-tuning examples do (train_text_to_image.py: fp32 model,
``accelerator.autocast`` under ``--mixed_precision bf16``), and then given every speed-up a
careful user of that script would switch on, so a ratio against it measures our design and
not a handicap of the baseline:

- the model: diffusers' ``SanaTransformer2DModel`` with diffusers' own init and attention
  processors, fp32 weights, wrapped as a whole in DDP when there are several ranks
  (``accelerator.prepare``), with ``gradient_as_bucket_view`` (as ours);
- compiled when ours is: each ``SanaTransformerBlock`` with ``block.compile()``, which is
  diffusers' regional compilation (``ModelMixin.compile_repeated_blocks`` compiles every
  sub-module whose class is in ``_repeated_blocks``; SanaTransformer2DModel leaves that list
  empty, so the blocks are compiled here by hand, as that method would);
- timesteps: ``u = compute_density_for_timestep_sampling("logit_normal", ..., device=...)``
  (diffusers training_utils.py: sigmoid of a normal), ``indices = (u * num_train_timesteps).long()``,
  ``timesteps = scheduler.timesteps[indices]`` from a
  ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``. The script's ``get_sigmas`` looks each
  timestep up with ``(schedule_timesteps == t).nonzero().item()`` (one host sync per sample);
  here ``sigmas[indices]`` on the device, the same values (the timestep at an index is
  unique in the schedule; tests/training/perf/test_bench.py) without a sync;
- ``noisy = (1 - sigma) * x + sigma * noise``, target ``noise - x``, loss = per-sample mean of
  ``weighting * (pred.float() - target.float()) ** 2`` then the mean (``weighting`` = 1 for
  logit_normal: ``compute_loss_weighting_for_sd3``);
- forward under ``torch.autocast(bf16)`` for bf16-mixed; ``loss.backward()``,
  ``clip_grad_norm_`` on all parameters, ``optimizer.step()``, ``optimizer.zero_grad()``;
- ``torch.optim.AdamW(fused=True)`` where the parameters' device has the fused kernel
  (training/optim/factory.py ``fused_supported``), else torch's default;
- batches arrive from pinned host memory (``compare`` pins them once) and are copied with
  ``non_blocking=True``;
- captions at the full padded length (the script encodes every prompt to
  ``max_sequence_length`` with ``padding="max_length"``), from the same batches, hence the
  same real caption lengths, as our step.

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
        compile: compile each transformer block (diffusers' regional compilation).
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
        compile: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, SanaTransformer2DModel

        from training.optim.factory import fused_supported

        self.device = device
        self.autocast = precision == "bf16-mixed"
        with torch.device(device):
            model: nn.Module = SanaTransformer2DModel(**model_kwargs)
        model.train()
        self.compiled = bool(compile)
        if compile:
            for block in model.transformer_blocks:
                block.compile(backend=compile_backend)
        self.inner = model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True,
            )
        self.model = model
        params = list(self.inner.parameters())
        self.fused = fused_supported([params])
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=self.fused or None
        )
        self.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=flow_shift)
        self.sigmas = self.scheduler.sigmas.to(device=device, dtype=torch.float32)
        self.timesteps = self.scheduler.timesteps.to(device)
        self.max_grad_norm = max_grad_norm
        self.logit_mean, self.logit_std = logit_mean, logit_std
        self.scale = float(vae_scaling_factor)

    def _sigmas(self, indices: torch.Tensor, n_dim: int) -> torch.Tensor:
        """Sigma of each sample's timestep index, on the device (no host sync), broadcastable."""
        sigma = self.sigmas[indices].flatten()
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
            device=self.device,
        )
        indices = (u * self.scheduler.config.num_train_timesteps).long()
        timesteps = self.timesteps[indices]
        sigmas = self._sigmas(indices, x.ndim)
        noisy = (1.0 - sigmas) * x + sigmas * noise
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            pred = self.model(
                hidden_states=noisy,
                encoder_hidden_states=batch["text"].float(),
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

    def describe(self) -> str:
        return ("diffusers-style step (training/perf/reference_step.py): fp32 model, whole-model DDP, bf16 autocast, "
                f"AdamW ({'fused' if self.fused else 'default'}), "
                f"{'per-block compile (diffusers regional compilation)' if self.compiled else 'eager'}, "
                "no per-sample host syncs, pinned batches, padded captions")


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
    tokens: Any  # training.data.text_trim.StepTokens over our timed steps (rank 0)
    reference_tokens: Any  # the same for the reference's (untrimmed) batches
    reference_description: str = ""  # ReferenceStep.describe()
    compiled: bool = False  # both sides compiled (ours per gpu.compile, the reference with it)
    compiles: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None)  # compile_stats at the
    # end of the warm-up and at the end (both sides together; None when nothing compiles)

    def ratios(self) -> list[float]:
        """ours / reference samples/s of each interleaved repetition (= their time ratio)."""
        return [r / o for o, r in zip(self.seconds_ours, self.seconds_reference, strict=True)]

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

    from training.data.loader import FeatureLoader
    from training.data.text_trim import StepTokens, TokenMeter, trimmed
    from training.loop import _throughput_fn, train_step
    from training.model.build import build_model
    from training.objective import RectifiedFlow
    from training.optim.factory import build_scheduler, optimizer_factory
    from training.perf.timing import drain

    if cfg.optim.grad_accum_steps != 1:
        raise UserError(
            "--compare-reference: needs optim.grad_accum_steps=1 (the reference steps once per batch)"
        )
    if getattr(getattr(cfg, "lora", None), "enabled", False):
        raise UserError("--compare-reference: compares full training; set lora.rank=0")
    torch.manual_seed(cfg.seed)
    loader = FeatureLoader.from_config(cfg.data, rank=backend.rank, world_size=backend.world_size)
    cuda = backend.device.type == "cuda"
    try:
        # pinned once, as a pinned loader hands them out (data.pin_memory): both sides copy asynchronously
        host = [{k: (v.pin_memory() if cuda else v.clone()) for k, v in next(loader).items()}
                for _ in range(batches_in_memory)]
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
        compile=bool(getattr(cfg.gpu, "compile", False)),  # compile on for both, or off for both
        compile_backend=getattr(cfg.gpu, "compile_backend", "inductor"),
    )
    stats = getattr(backend, "compile_stats", lambda: None)
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
    drain(backend.device)
    at_start = stats()
    t_ours: list[float] = []
    t_ref: list[float] = []
    for _ in range(repetitions):
        t_ours.append(timed(ours))
        t_ref.append(timed(ref))
    at_end = stats()
    after = (_weights_sample(inner), _weights_sample(reference.inner))
    mine, theirs = sum(ours_tokens[warmup:], StepTokens()), sum(ref_tokens[warmup:], StepTokens())
    if mine.real_text_tokens != theirs.real_text_tokens:  # same batches, so the same real captions
        raise RuntimeError(f"compare: ours saw {mine.real_text_tokens} real caption tokens, the reference "
                           f"{theirs.real_text_tokens}; the two sides must train on the same batches")
    return Comparison(
        steps_per_repetition=steps,
        seconds_ours=t_ours,
        seconds_reference=t_ref,
        samples_per_step=cfg.data.batch_size * backend.world_size,
        final_loss_ours=float(losses["ours"].float().cpu()),
        final_loss_reference=float(losses["ref"].float().cpu()),
        update_ours=float((after[0] - before[0]).norm()),
        update_reference=float((after[1] - before[1]).norm()),
        tokens=mine,
        reference_tokens=theirs,
        reference_description=reference.describe(),
        compiled=reference.compiled,
        compiles=(at_start, at_end),
    )
