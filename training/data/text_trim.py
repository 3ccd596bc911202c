"""Caption trimming per batch, and the per-batch token counts MFU is computed from.

Every sample's caption is padded to ``max_text_tokens`` (300, Sana's Gemma-2 length) in
collate, but real captions are far shorter (~80 tokens at 512 px). The padding still runs
through the caption projection and the cross-attention k/v and scores: ~13% of the forward
FLOPs of sana-600m-512 (training/model/flops.py). ``trimmed`` cuts each host batch's ``text`` /
``text_mask`` to the batch's longest real caption, rounded up to one of a few lengths so
``torch.compile`` sees only a few shapes.

Why this changes no result: padded caption tokens take no part in the model's output.
diffusers' ``SanaTransformer2DModel.forward`` turns the 2-D ``encoder_attention_mask`` into
an additive bias ``(1 - mask) * -10000`` over the key axis of the cross-attention
(diffusers 0.42 models/transformers/sana_transformer.py, "convert encoder_attention_mask to
a bias"), so a masked key gets softmax weight exp(-10000) = 0 in fp32; the caption
projection (``PixArtAlphaTextProjection``: linear-GELU-linear) and ``caption_norm``
(RMSNorm over the channel axis) work per token; nothing else reads the caption. Real tokens
are a prefix of every row (training/data.py collate writes ``mask[row, :n] = 1``), so
keeping the first ``L >= longest`` columns keeps all of them. The objective's null encoding
(caption dropout) is cut to the same length (training/objective.py): a dropped caption keeps
its own mask, so only its first ``len(caption) <= L`` null rows are attended (the trim is
exact for dropped captions too); ``floor`` keeps the trim at or above a minimum length
(the loop passes the null caption's own real tokens).
tests/training/data/test_text_trim.py checks loss and gradients on a trimmed batch against the
untrimmed one.

The XLA backend keeps the fixed length (``Backend.trims_text`` is False there): every new
caption length would be a new graph and a neuronx-cc compile.

``TokenMeter`` records, for each batch as it passes (host tensors, before the backend's
device copy, so no device read ever happens), its latent size, its real caption tokens
(mask sum) and the caption length the step computes; the loop turns those into per-step
FLOPs for ``mfu`` (real tokens) and ``mfu_padded`` (tokens computed).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

Batch = dict[str, torch.Tensor]

#: default trim lengths: multiples of 64 (tensor-core friendly tile sizes); a batch whose
#: longest caption exceeds the last one keeps the padded length
DEFAULT_LENGTHS = (64, 128, 192, 256)


@dataclasses.dataclass(kw_only=True)
class TextTrimConfig:
    """Section ``text_trim``: cut caption padding per batch (GPU backend only)."""

    #: trim on backends that allow it (GPU); the Trainium backend always keeps the padded length
    enabled: bool = True
    #: caption lengths a batch is rounded up to (ascending); above the last: the padded length
    lengths: list[int] = dataclasses.field(default_factory=lambda: list(DEFAULT_LENGTHS))

    def __post_init__(self) -> None:
        if not isinstance(self.lengths, list) or not all(isinstance(n, int) and n >= 1 for n in self.lengths):
            raise ValueError(f"text_trim.lengths: must be a list of integers >= 1, got {self.lengths!r}")
        if self.lengths != sorted(set(self.lengths)):
            raise ValueError(f"text_trim.lengths: must be ascending without repeats, got {self.lengths}")


def trim_length(longest: int, lengths: Sequence[int], padded: int) -> int:
    """The smallest of ``lengths`` >= ``longest``; ``padded`` when none is (or it is smaller)."""
    i = bisect.bisect_left(lengths, longest)
    return min(padded, lengths[i]) if i < len(lengths) else padded


def trim_batch(batch: Batch, length: int) -> Batch:
    """``batch`` with ``text`` [B, N, D] and ``text_mask`` [B, N] cut to ``length`` columns.

    The cut copies are contiguous: a strided view would be pinned and copied to the GPU at
    nearly its full padded size (pinning allocates the view's whole storage span). A cut of a
    pinned loader buffer is pinned too, so the side-stream copy (training/data/input_pipeline.py)
    does not pin it again on the main thread.
    """
    if batch["text"].shape[1] == length:
        return batch
    return {**batch, "text": _cut(batch["text"], length), "text_mask": _cut(batch["text_mask"], length)}


def _cut(t: torch.Tensor, length: int) -> torch.Tensor:
    view = t[:, :length]
    return torch.empty(view.shape, dtype=t.dtype, pin_memory=t.is_pinned()).copy_(view)


@dataclasses.dataclass(frozen=True)
class BatchTokens:
    """What one (micro-)batch carried, as the step computes it."""

    samples: int
    latent_hw: tuple[int, int]
    real_tokens: float  # mean real caption tokens per sample (mask sum / samples)
    computed_tokens: int  # caption length the step runs on (trimmed or padded)


class TokenMeter:
    """Per-batch token counts, in the order batches were produced.

    A backend may read ahead of the step (prefetch), so counts are queued and the loop
    ``take``s exactly the batches a step consumed; the figures match the step's batches
    whatever the read-ahead.
    """

    def __init__(self) -> None:
        self._queue: collections.deque[BatchTokens] = collections.deque()

    def observe(self, batch: Batch) -> None:
        mask = batch["text_mask"]
        lat = batch["latents"]
        samples = int(mask.shape[0])
        self._queue.append(
            BatchTokens(
                samples=samples,
                latent_hw=(int(lat.shape[-2]), int(lat.shape[-1])),
                real_tokens=float(mask.sum()) / max(1, samples),
                computed_tokens=int(mask.shape[1]),
            )
        )

    def take(self, n: int) -> list[BatchTokens]:
        """The oldest ``n`` batches' counts (fewer if fewer were seen), removed from the queue."""
        return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]


def trimmed(
    batches: Iterable[Batch],
    *,
    lengths: Sequence[int] | None,
    floor: int = 1,
    meter: TokenMeter | None = None,
) -> Iterator[Batch]:
    """Host batches -> the same batches with caption padding cut (``lengths`` None: not cut).

    A plain iterator transform: it holds no loader state, so checkpointing the loader's
    position is unaffected. ``floor``: the trim never goes below this (the null caption's
    real length, so caption dropout keeps all of its tokens).
    """
    for batch in batches:
        if lengths is not None:
            padded = int(batch["text_mask"].shape[1])
            longest = int(batch["text_mask"].sum(1).max()) if batch["text_mask"].numel() else padded
            batch = trim_batch(batch, trim_length(max(longest, floor), lengths, padded))
        if meter is not None:
            meter.observe(batch)
        yield batch


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTokens:
    """Token and FLOP totals over the samples of one or more steps (one rank's batches)."""

    samples: int = 0
    useful_flops: float = 0.0  # training FLOPs counting real caption tokens only (the MFU numerator)
    computed_flops: float = 0.0  # training FLOPs of the caption length the step ran on (padded/trimmed)
    real_text_tokens: float = 0.0
    computed_text_tokens: float = 0.0
    image_tokens: float = 0.0

    def __add__(self, other: StepTokens) -> StepTokens:
        return StepTokens(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    def per_sample(self, name: str) -> float:
        """``name`` (a field) divided by the samples (0 when there are none)."""
        return getattr(self, name) / self.samples if self.samples else 0.0


#: ``(latent_hw, computed_tokens, real_tokens or None) -> training FLOPs per sample``
FlopModel = Callable[[tuple[int, int], int, float | None], float]


def count_step(
    parts: Sequence[BatchTokens], flops_per_sample: FlopModel, *, patch_size: int = 1
) -> StepTokens:
    """Totals of one step's micro-batches under the FLOP model ``flops_per_sample``
    (training.model.flops.train_flops_per_sample bound to the model: see loop._throughput_fn)."""
    total = StepTokens()
    for p in parts:
        h, w = p.latent_hw
        real = min(p.real_tokens, p.computed_tokens)
        total += StepTokens(
            samples=p.samples,
            useful_flops=p.samples * flops_per_sample(p.latent_hw, p.computed_tokens, real),
            computed_flops=p.samples * flops_per_sample(p.latent_hw, p.computed_tokens, None),
            real_text_tokens=p.samples * real,
            computed_text_tokens=p.samples * p.computed_tokens,
            image_tokens=p.samples * (h // patch_size) * (w // patch_size),
        )
    return total
