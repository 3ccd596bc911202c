"""Aspect-ratio buckets: which bucket an image goes to, and the per-step bucket order.

Sana trains on aspect-ratio buckets and its pipeline bins requested sizes to the same
tables at inference, so features cropped to squares only teach the model one of them.

Tables: NVlabs Sana's *training* tables, ``ASPECT_RATIO_512`` / ``ASPECT_RATIO_1024`` /
``ASPECT_RATIO_2048`` of ``diffusion/data/datasets/utils.py`` (keys: the ratio h/w as a string,
values: [h, w] pixels; 40 ratios from 0.25 to 4.0), which its configs name in
``model.aspect_ratio_type`` with ``multi_scale: true`` (configs/sana_config/512ms/
Sana_600M_img512.yaml, 1024ms/Sana_1600M_img1024.yaml). They are data, carried here (``SANA_TABLES``):
diffusers ships only the *inference* bins ``SanaPipeline`` snaps a requested size to
(``ASPECT_RATIO_512_BIN`` / ``1024_BIN`` in pipelines/pixart_alpha/pipeline_pixart_alpha.py:
33 of the same 40 entries, without 0.26, 0.27, 2.89, 3.11, 3.62, 3.75, 3.88;
``ASPECT_RATIO_2048_BIN`` in pipeline_pixart_sigma.py: all 40); every inference bin is one of
the training buckets.

Assignment (Sana ``diffusion/data/transforms.py`` ``get_closest_ratio``): the bucket whose
ratio is nearest to the image's h/w. Resize + crop (Sana ``SanaWebDatasetMS.getdata`` in
``diffusion/data/datasets/sana_data_multi_scale.py``): scale so the image covers the
bucket (the larger of bucket_h/h and bucket_w/w), then centre-crop to the bucket.

Order: Sana's ``AspectRatioBatchSampler`` (diffusion/data/builder.py) appends each index
of the rank's sampler stream to its ratio's queue and yields a batch when a queue is full
(ratios with fewer than ``valid_num`` samples are left out), so which bucket comes next
depends on the stream, and every rank's stream differs. Here instead the bucket of every step of an epoch is drawn up front from (seed, epoch) alone:
all ranks run the same bucket at each step (one graph shape per step on every rank, as
XLA's SPMD step and ZeRO's collectives need), on disjoint samples, and a position
(epoch, step) fixes the next batch exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

#: ``--buckets`` choices: a Sana table (by base resolution) or one square shape
TABLES = ("512", "1024", "2048")
SQUARE_MODE = "square"
#: VAE downsampling of DC-AE f32c32 (Sana's vae_downsample_rate): latents are pixels / 32
VAE_STRIDE = 32


#: NVlabs Sana diffusion/data/datasets/utils.py ``ASPECT_RATIO_512`` (S = 512**2 pixels): ratio h/w ->
#: (h, w). ``ASPECT_RATIO_1024`` is every side x2 and ``ASPECT_RATIO_2048`` x4 there, entry for
#: entry (tests/training/data/test_buckets.py checks all three against Sana's literals).
_SANA_512: dict[str, tuple[int, int]] = {
    "0.25": (256, 1024), "0.26": (256, 992), "0.27": (256, 960), "0.28": (256, 928),
    "0.32": (288, 896), "0.33": (288, 864), "0.35": (288, 832), "0.4": (320, 800),
    "0.42": (320, 768), "0.48": (352, 736), "0.5": (352, 704), "0.52": (352, 672),
    "0.57": (384, 672), "0.6": (384, 640), "0.68": (416, 608), "0.72": (416, 576),
    "0.78": (448, 576), "0.82": (448, 544), "0.88": (480, 544), "0.94": (480, 512),
    "1.0": (512, 512), "1.07": (512, 480), "1.13": (544, 480), "1.21": (544, 448),
    "1.29": (576, 448), "1.38": (576, 416), "1.46": (608, 416), "1.67": (640, 384),
    "1.75": (672, 384), "2.0": (704, 352), "2.09": (736, 352), "2.4": (768, 320),
    "2.5": (800, 320), "2.89": (832, 288), "3.0": (864, 288), "3.11": (896, 288),
    "3.62": (928, 256), "3.75": (960, 256), "3.88": (992, 256), "4.0": (1024, 256),
}
#: Sana's training tables by base resolution
SANA_TABLES: dict[str, dict[str, tuple[int, int]]] = {
    name: {ratio: (h * int(name) // 512, w * int(name) // 512) for ratio, (h, w) in _SANA_512.items()}
    for name in TABLES}
#: Sana resizes with LANCZOS for its 2048 (and 2880) tables and BICUBIC otherwise
#: (sana_data_multi_scale.py ``SanaWebDatasetMS.__init__`` ``interpolate_model``)
LANCZOS_TABLES = ("2048",)


def aspect_ratio_table(name: str) -> dict[str, tuple[int, int]]:
    """Sana's training table ``name`` (512, 1024 or 2048): ratio string -> (h, w) pixels."""
    if name not in SANA_TABLES:
        raise ValueError(f"bucket table {name!r}: choose one of {', '.join(TABLES)} or {SQUARE_MODE}")
    return dict(SANA_TABLES[name])


def resample_filter(name: str) -> str:
    """PIL resampling filter Sana resizes with for table ``name`` ("square" resizes bicubic)."""
    return "LANCZOS" if name in LANCZOS_TABLES else "BICUBIC"


def nearest_bucket(height: int, width: int, table: Mapping[str, tuple[int, int]]) -> str:
    """The table key whose ratio is nearest to height / width (Sana's get_closest_ratio;
    a tie goes to the first key in table order)."""
    ratio = height / width
    return min(table, key=lambda key: abs(float(key) - ratio))


def cover_resize(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(h, w) to resize an image to so it covers ``target`` (h, w) with its aspect kept,
    before the centre crop: Sana's getdata takes the larger of the two scale factors and
    truncates the other side with ``int()``, which never falls below the target side."""
    th, tw = target
    if th / height > tw / width:
        return th, max(tw, int(width * th / height))
    return max(th, int(height * tw / width)), tw


def latent_shape(pixels: tuple[int, int], channels: int) -> tuple[int, int, int]:
    h, w = pixels
    return channels, h // VAE_STRIDE, w // VAE_STRIDE


# ---------------------------------------------------------------------------- order
@dataclass(frozen=True)
class EpochPlan:
    """Which bucket each step of one epoch uses and which samples of it.

    ``order[s]``: position (in the kept buckets) of step ``s``'s bucket; ``within[s]``: how
    many earlier steps of the epoch used that bucket; ``perms[b]``: bucket ``b``'s samples
    (global indices) in this epoch's order. Step ``s`` takes the global batch
    ``perms[order[s]][within[s]*G:(within[s]+1)*G]`` and rank ``r`` its ``r``-th slice.
    """

    order: list[int]
    within: list[int]
    perms: list[torch.Tensor]

    @property
    def steps(self) -> int:
        return len(self.order)


def _generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    # stream 0 is the single-bucket permutation, the same seed the loader used before buckets
    # existed, so square-mode runs keep their sample order (and their resume positions).
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch + stream * (1 << 40))


#: the stream of the step -> bucket shuffle (bucket k's permutation uses stream k)
_ORDER_STREAM = 1 << 20


def plan_epoch(members: Sequence[torch.Tensor], *, global_batch: int, seed: int, epoch: int,
               fixed_steps: int = 0, run: int = 1) -> EpochPlan:
    """The epoch's plan from (seed, epoch) only: never from the rank.

    ``members``: each kept bucket's global sample indices (every one >= run * global_batch
    long). Bucket ``b`` gets ``len(members[b]) // (run * global_batch)`` runs of ``run``
    consecutive steps (``run`` = gradient-accumulation micro-batches, so an optimizer step
    is one shape and one graph); the rest of it waits for another epoch's permutation, as
    drop_last does. The runs of all buckets are shuffled together.
    ``fixed_steps`` > 0 (precompile): bucket by bucket in the given order, ``fixed_steps``
    runs each, so every bucket's graph is traced.
    """
    perms = [m[torch.randperm(len(m), generator=_generator(seed, epoch, b))] for b, m in enumerate(members)]
    runs = [len(m) // (global_batch * run) for m in members]
    if fixed_steps > 0:
        order = [b for b in range(len(members)) for _ in range(fixed_steps * run)]
        within = [k % (runs[b] * run) for b in range(len(members)) for k in range(fixed_steps * run)]
        return EpochPlan(order, within, perms)
    slots = torch.repeat_interleave(torch.arange(len(members)), torch.tensor(runs, dtype=torch.int64))
    if len(members) > 1:
        slots = slots[torch.randperm(len(slots), generator=_generator(seed, epoch, _ORDER_STREAM))]
    order = slots.repeat_interleave(run).tolist()
    seen = [0] * len(members)
    within = []
    for b in order:
        within.append(seen[b])
        seen[b] += 1
    return EpochPlan(order, within, perms)


def rank_slice(plan: EpochPlan, step: int, *, rank: int, batch_size: int, world_size: int) -> tuple[int, list[int]]:
    """(bucket position, this rank's global sample indices) of ``step``."""
    b, k = plan.order[step], plan.within[step]
    start = k * batch_size * world_size + rank * batch_size
    return b, plan.perms[b][start:start + batch_size].tolist()
