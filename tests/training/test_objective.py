"""Rectified-flow objective: matches a hand computation, and can overfit one batch."""

from __future__ import annotations

import math

import pytest
import torch

from training.model.build import ModelConfig, build_model
from training.objective import ObjectiveConfig, RectifiedFlow, shift_sigmas

B, C, H, N, D = 3, 4, 8, 6, 8
SCALE = 0.41407


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    mask = torch.zeros(B, N, dtype=torch.int64)
    for i, n in enumerate((2, 6, 4)):
        mask[i, :n] = 1
    return {"latents": torch.randn(B, C, H, H, generator=gen),
            "text": torch.randn(B, N, D, generator=gen) * mask[..., None], "text_mask": mask}


def _null() -> tuple[torch.Tensor, torch.Tensor]:
    """The empty caption as precompute stores it: the full N-row encoding (<bos>, then the
    padding positions' rows, which are not zero) and its own mask [1, 0, ...]."""
    text = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    text[0] = 1.5
    mask = torch.zeros(N, dtype=torch.int64)
    mask[0] = 1
    return text, mask


def test_flow_shift_formula() -> None:
    sigma = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.allclose(shift_sigmas(sigma, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))
    assert torch.equal(shift_sigmas(sigma, 1.0), sigma)


def test_loss_matches_hand_computation() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"))
    batch = _batch()
    null_text, null_mask = _null()
    cfg = ObjectiveConfig(logit_mean=0.3, logit_std=0.8, flow_shift=3.0, caption_dropout=0.5)
    objective = RectifiedFlow(cfg, vae_scaling_factor=SCALE, null_text=null_text, null_mask=null_mask)

    torch.manual_seed(42)
    loss = objective(model, batch)

    # By hand, same draw order: logit-normal u, noise, dropout coin.
    torch.manual_seed(42)
    u = torch.randn(B) * 0.8 + 0.3
    t = 1 / (1 + torch.exp(-u))
    sigma = 3 * t / (1 + 2 * t)
    noise = torch.randn(B, C, H, H)
    drop = torch.rand(B) < 0.5
    assert 0 < int(drop.sum()) < B  # this seed exercises both branches
    x0 = batch["latents"] * SCALE
    text, mask = batch["text"].clone(), batch["text_mask"].clone()
    text[drop] = null_text  # Sana's token_drop: the full null encoding, the caption's own mask
    x_t = torch.stack([(1 - sigma[i]) * x0[i] + sigma[i] * noise[i] for i in range(B)])
    pred = model(x_t, text, sigma * 1000, encoder_attention_mask=mask).sample
    want = ((pred - (noise - x0)) ** 2).mean()
    assert loss.dtype == torch.float32
    assert math.isclose(loss.item(), want.item(), rel_tol=1e-6)


def test_global_draw_is_sliced_per_rank() -> None:
    """Rank r of N sees exactly rows r*B:(r+1)*B of what one process with N*B draws."""
    cfg = ObjectiveConfig(caption_dropout=0.5)
    null_text, null_mask = _null()
    whole = RectifiedFlow(cfg, vae_scaling_factor=1.0, null_text=null_text, null_mask=null_mask)
    torch.manual_seed(5)
    sigma, noise, drop = whole.sample(torch.zeros(2 * B, C, H, H))
    for rank in range(2):
        part = RectifiedFlow(cfg, vae_scaling_factor=1.0, null_text=null_text, null_mask=null_mask,
                             rank=rank, world_size=2)
        torch.manual_seed(5)
        s, n, d = part.sample(torch.zeros(B, C, H, H))
        rows = slice(rank * B, (rank + 1) * B)
        assert torch.equal(s, sigma[rows]) and torch.equal(n, noise[rows]) and torch.equal(d, drop[rows])


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_caption_dropout_extremes(p: float) -> None:
    """p=1 feeds only the null caption (output independent of the real caption); p=0 never does."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"))
    null_text, null_mask = _null()
    objective = RectifiedFlow(ObjectiveConfig(caption_dropout=p), vae_scaling_factor=SCALE,
                              null_text=null_text, null_mask=null_mask)
    batch = _batch()
    other = {**batch, "text": torch.randn(B, N, D) * batch["text_mask"][..., None]}
    torch.manual_seed(9)
    a = objective(model, batch)
    torch.manual_seed(9)
    b = objective(model, other)
    assert torch.equal(a, b) == (p == 1.0)


class _Recorder(torch.nn.Module):
    """The transformer's call, recorded: what the objective hands the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, **kwargs):
        self.calls.append({k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)})
        return self.model(**kwargs)


def _sana_token_drop(caption: torch.Tensor, drop_ids: torch.Tensor, y_embedding: torch.Tensor) -> torch.Tensor:
    """NVlabs Sana diffusion/model/nets/sana_blocks.py ``CaptionEmbedder.token_drop`` on our
    [B, N, D] layout (Sana's caption is [B, 1, N, D]: ``drop_ids[:, None, None, None]``);
    ``forward`` passes the mask on untouched."""
    return torch.where(drop_ids[:, None, None], y_embedding, caption)


@pytest.mark.parametrize("p", [0.5, 1.0])
def test_dropout_is_sanas_token_drop_full_null_encoding_and_the_captions_mask(p: float) -> None:
    torch.manual_seed(0)
    model = _Recorder(build_model(ModelConfig(preset="tiny")))
    null_text, null_mask = _null()
    objective = RectifiedFlow(ObjectiveConfig(caption_dropout=p), vae_scaling_factor=SCALE,
                              null_text=null_text, null_mask=null_mask)
    batch = _batch()
    torch.manual_seed(42)
    objective(model, batch)
    torch.manual_seed(42)
    _, _, drop = objective.sample(batch["latents"])
    assert int(drop.sum()) >= 1
    seen = model.calls[0]
    torch.testing.assert_close(seen["encoder_hidden_states"], _sana_token_drop(batch["text"], drop, null_text),
                               rtol=0, atol=0)
    # the null encoding's padding rows reach the model for every real token of the caption
    assert not torch.equal(seen["encoder_hidden_states"][drop][:, 1:], torch.zeros_like(null_text[1:]).expand(
        int(drop.sum()), -1, -1))
    assert torch.equal(seen["encoder_attention_mask"], batch["text_mask"])  # the caption's own mask, dropped or not


def test_overfits_one_batch() -> None:
    """Same batch, same noise every step: a pure regression the model must fit (loss -50%+)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny"))
    null_text, null_mask = _null()
    objective = RectifiedFlow(ObjectiveConfig(caption_dropout=0.0), vae_scaling_factor=SCALE,
                              null_text=null_text, null_mask=null_mask)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    batch = _batch()
    losses = []
    for _ in range(150):
        torch.manual_seed(123)
        loss = objective(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] <= 0.5 * losses[0], (losses[0], losses[-1])


def test_null_caption_is_cut_to_a_trimmed_batch_and_untouched_at_the_padded_length() -> None:
    """Caption trimming (training/data/text_trim.py): the null caption follows the batch's length;
    at the padded length the very same tensors are used (no slice: the XLA graph is unchanged)."""
    null_text, null_mask = _null()
    objective = RectifiedFlow(ObjectiveConfig(), vae_scaling_factor=SCALE, null_text=null_text, null_mask=null_mask)
    text, mask = objective.null_caption(N)
    assert text is null_text and mask is null_mask
    text, mask = objective.null_caption(2)
    assert torch.equal(text, null_text[:2]) and torch.equal(mask, null_mask[:2])


def test_only_the_gpu_backend_trims_captions() -> None:
    from training.backends.base import Backend
    from training.backends.gpu import GpuBackend
    from training.backends.neuron import NeuronBackend

    assert GpuBackend.trims_text and not NeuronBackend.trims_text and not Backend.trims_text
