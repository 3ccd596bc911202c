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
is no per-rank generator to keep in sync. The extra draw is a few MB per step even at
1024px on 64 devices.

The slice is *data*, not a constant: the draw is viewed as [world, B, ...] and this rank's
row is picked with ``index_select`` by a one-element rank tensor that lives on the device.
A Python slice ``draw[r*B:(r+1)*B]`` would be lowered by torch-xla into an HLO ``slice``
with the bounds baked in, so every rank would trace its own step graph. The Neuron
persistent cache is keyed by the graph's hash (awsdocs-neuron v2.29.1, about-neuron/arch/
neuron-features/neuron-caching.rst), so that is N neuronx-cc compiles and N cache
entries, a precompile that fills one rank's entry only, and replicas whose collectives sit
in different programs. With the index as device data every rank's graph is the same HLO
with a different input (tests/xla/test_same_graph.py hashes it as ranks 0, 1 and 31 of 32).

Caption dropout is Sana's ``CaptionEmbedder.token_drop`` (NVlabs Sana diffusion/model/nets/
sana_blocks.py): a dropped caption is replaced by the *whole* null encoding
(``y_embedding``, every one of the N rows: train_scripts/train.py encodes ``""`` padded to
``model_max_length`` and diffusion/utils/checkpoint.py loads that ``[N, D]`` tensor as
``y_embedder.y_embedding``), while the attention mask stays the caption's own
(``token_drop`` swaps the embedding only; ``forward`` passes ``mask`` through unchanged).
So the model learns the unconditional branch from the null encoding's first ``len(caption)``
rows, as Sana's models did.
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
    #: branch used by classifier-free guidance; Sana model.class_dropout_prob: 0.1)
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
        null_text, null_mask: the empty caption's full encoding [N, D] and its own mask [N]
            (from the loader), on the training device; a dropped caption gets ``null_text``
            and keeps its mask (``null_mask`` is the negative prompt's mask for sampling).
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
        self._rank_index: dict[torch.device, torch.Tensor] = {}

    def rank_index(self, device: torch.device) -> torch.Tensor:
        """This rank's id as a one-element int64 tensor on ``device``, made once per device.

        Made on the host and transferred: on XLA that is device data (a graph *input*),
        where ``torch.tensor(r, device=xla)`` or a Python int would be a traced constant.
        """
        if device not in self._rank_index:
            self._rank_index[device] = torch.tensor([self.rank], dtype=torch.int64).to(device)
        return self._rank_index[device]

    def _local(self, draw: torch.Tensor, batch: int) -> torch.Tensor:
        """Rows [rank*B, (rank+1)*B) of the global draw, selected by a device index (see above)."""
        rows = draw.view(self.world_size, batch, *draw.shape[1:])
        return rows.index_select(0, self.rank_index(draw.device)).squeeze(0)

    def sample(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sigma [B], noise [B,C,H,W], drop [B] bool) for this rank, in a fixed draw order."""
        b, n = latents.shape[0], latents.shape[0] * self.world_size
        kw = dict(device=latents.device, dtype=torch.float32)
        u = torch.randn(n, **kw) * self.cfg.logit_std + self.cfg.logit_mean
        sigma = shift_sigmas(torch.sigmoid(u), self.cfg.flow_shift)
        noise = torch.randn((n, *latents.shape[1:]), **kw)
        uniform = torch.rand(n, **kw)
        drop = self._local(uniform, b) < self.cfg.caption_dropout
        return self._local(sigma, b), self._local(noise, b), drop

    def null_caption(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The null encoding and its mask cut to a trimmed batch's caption ``length``
        (training/data/text_trim.py: the batch's captions all end by then, so under their masks
        the cut rows are never attended). At the padded length nothing is sliced, so the XLA
        graph is unchanged."""
        if length == self.null_text.shape[0]:
            return self.null_text, self.null_mask
        return self.null_text[:length], self.null_mask[:length]

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scalar fp32 loss for one (micro-)batch of {"latents", "text", "text_mask"}."""
        x0 = batch["latents"].float() * self.scale
        sigma, noise, drop = self.sample(x0)
        null_text, _ = self.null_caption(batch["text"].shape[1])
        # Sana's token_drop: the full null encoding in, the caption's own mask kept
        text = torch.where(drop[:, None, None], null_text.to(batch["text"].dtype), batch["text"])
        mask = batch["text_mask"]
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - s) * x0 + s * noise
        pred = model(hidden_states=x_t, encoder_hidden_states=text, timestep=sigma * TIMESTEP_SCALE,
                     encoder_attention_mask=mask, return_dict=False)[0]
        return F.mse_loss(pred.float(), (noise - x0).float())
