"""Rectified-flow objective as Sana trains (NVlabs Sana ``train_scripts/train.py`` with
``weighting_scheme: logit_normal`` and ``flow_shift``; SD3 paper, Esser et al. 2024, sec. 3.1).

For clean latents x0 and noise eps: sigma ~ shift(sigmoid(N(mean, std))),
x_t = (1 - sigma) * x0 + sigma * eps, the model predicts the velocity eps - x0, loss = MSE
in fp32. The timestep the model sees is ``sigma * 1000``, which is what diffusers'
``SanaPipeline`` feeds it (FlowMatchEulerDiscreteScheduler timesteps), so an exported
checkpoint samples correctly.

Randomness is drawn for the *global* batch (``world_size * B``) from the device's default
generator, seeded identically on every rank, and each rank keeps its slice. So a run on
N ranks sees exactly the noise one process with the N-times batch sees (tested), and there
is no per-rank generator to keep in sync or to trip XLA graph tracing. The extra draw is
a few MB per step even at 1024px on 64 devices.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

TIMESTEP_SCALE = 1000.0


@dataclasses.dataclass(kw_only=True)
class ObjectiveConfig:
    """Timestep distribution and classifier-free-guidance dropout."""

    #: mean of the normal whose sigmoid is the timestep (logit-normal; Sana: 0)
    logit_mean: float = 0.0
    #: std of that normal (Sana: 1)
    logit_std: float = 1.0
    #: s in sigma' = s*sigma / (1 + (s-1)*sigma); >1 moves mass to noisier timesteps
    #: (Sana: 3.0 at 1024px; 1.0 = off)
    flow_shift: float = 3.0
    #: probability of replacing a caption by the null caption (trains the unconditional
    #: branch used by classifier-free guidance)
    caption_dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.logit_std <= 0:
            raise ValueError("objective.logit_std: must be > 0")
        if self.flow_shift <= 0:
            raise ValueError("objective.flow_shift: must be > 0 (1.0 = no shift)")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError("objective.caption_dropout: must be in [0, 1]")


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Flow shift (SD3 / Sana): sigma' = s*sigma / (1 + (s-1)*sigma)."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


class RectifiedFlow:
    """The training loss; one instance per run.

    Args:
        cfg: objective section.
        vae_scaling_factor: from the feature index; shards hold UNscaled latents.
        null_text, null_mask: the empty caption's padded embedding [N, D] and mask [N]
            (from the loader), on the training device.
        rank, world_size: this rank's slice of the global random draw.
    """

    def __init__(self, cfg: ObjectiveConfig, *, vae_scaling_factor: float, null_text: torch.Tensor,
                 null_mask: torch.Tensor, rank: int = 0, world_size: int = 1) -> None:
        self.cfg = cfg
        self.scale = float(vae_scaling_factor)
        self.null_text = null_text
        self.null_mask = null_mask
        self.rank = rank
        self.world_size = world_size

    def _local(self, draw: torch.Tensor, batch: int) -> torch.Tensor:
        return draw[self.rank * batch:(self.rank + 1) * batch]

    def sample(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sigma [B], noise [B,C,H,W], drop [B] bool) for this rank, in a fixed draw order."""
        b, n = latents.shape[0], latents.shape[0] * self.world_size
        kw = dict(device=latents.device, dtype=torch.float32)
        u = torch.randn(n, **kw) * self.cfg.logit_std + self.cfg.logit_mean
        sigma = shift_sigmas(torch.sigmoid(u), self.cfg.flow_shift)
        noise = torch.randn((n, *latents.shape[1:]), **kw)
        drop = torch.rand(n, **kw) < self.cfg.caption_dropout
        return self._local(sigma, b), self._local(noise, b), self._local(drop, b)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scalar fp32 loss for one (micro-)batch of {"latents", "text", "text_mask"}."""
        x0 = batch["latents"].float() * self.scale
        sigma, noise, drop = self.sample(x0)
        text = torch.where(drop[:, None, None], self.null_text.to(batch["text"].dtype), batch["text"])
        mask = torch.where(drop[:, None], self.null_mask.to(batch["text_mask"].dtype), batch["text_mask"])
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - s) * x0 + s * noise
        pred = model(hidden_states=x_t, encoder_hidden_states=text, timestep=sigma * TIMESTEP_SCALE,
                     encoder_attention_mask=mask, return_dict=False)[0]
        return F.mse_loss(pred.float(), (noise - x0).float())
