"""Raw image + caption pairs -> DC-AE latents + Gemma-2 caption embeddings, as feature shards.

    python -m training.precompute --input s3://data/raw/ --out s3://data/features/v1 \\
        --vae /fsx/models/dc-ae --text-encoder /fsx/models/gemma-2-2b-it --tokenizer /fsx/models/gemma-2-2b-it

    torchrun --nproc-per-node 8 -m training.precompute ...   # ranks split the shards

Input (local dir or s3:// prefix): a folder of images with same-stem ``.txt`` captions, or
WebDataset tars (training/data/raw_input.py).

Resumable: the assignment of samples to shards depends only on the input listing, a
shard is written through a temp name, and ``shard-NNNNN.json`` (its index entry) is
written after the tar: a shard with its marker is skipped on the next run. Rank r of
WORLD_SIZE (torchrun env) takes shards r, r+W, ...; rank 0 then waits for every marker
and writes null_caption.safetensors and, last, index.json (``--merge-only`` redoes just
that step). The run is thus restartable at any point, by any number of ranks.

One feature set per ``--out``: every marker and index.json record the run's settings
(resolution, buckets, CHI, caption text, N, the models' fingerprints...), and a run whose
settings differ from those already there is refused in one line naming each difference
(training/data/feature_settings.py). A full disk (ENOSPC, quota, EFBIG) ends the run in one
line; every file is written through ``.NAME.part-PID`` and a rename, the part file is
removed on failure, and a later run removes any a killed run left for its shards.

Aspect-ratio buckets (``--buckets 512|1024|2048``, by default the table of ``--resolution``,
as every NVlabs Sana config trains ``multi_scale: true``; ``square`` centre-crops every
image to ``--resolution``): each image goes to the bucket of Sana's 40-ratio training table
with the nearest h/w ratio, is resized to cover it and centre-cropped to it (training/data/
buckets.py, raw_samples.py); the table is scaled to ``--resolution``. Shards record each
sample's bucket, index.json lists the buckets with counts and shapes. Samples that cannot
be used (no caption, an empty or non-UTF-8 caption, an unreadable image, an image smaller
than its bucket by more than ``--max-upscale``) are skipped, each named in a warning line
and counted per reason in one summary line each.

Text conditioning: captions get NVlabs Sana's complex human instruction by default
(``--chi sana``; ``diffusers`` for SanaPipeline's list, ``none``, or a file) in front of
the raw caption (``--caption-text sana``; ``diffusers`` lower-cases it first), and the
choices, the CHI's sha256, N, the tokenizer and the text encoder's identity go into
index.json ``text_conditioning`` (training/data/text_features.py). The merge step also encodes
the validation prompts (``--validation-prompts``; by default those the ``--out`` already
records, else a built-in list) with the same settings into validation_prompts.safetensors,
so training renders its validation images without loading a text encoder
(training/evaluation/validation.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training import s3
from training.data.buckets import SQUARE_MODE, TABLES, aspect_ratio_table, resample_filter
from training.data.feature_output import PROMPTS_METADATA, Output
from training.data.feature_settings import (
    SETTINGS_KEY,
    FeatureSettings,
    normalised_input,
    recorded_settings,
    refuse_mixed,
)
from training.data.index import SQUARE
from training.data.raw_input import Unit, list_units, read_ref, unit_samples
from training.data.raw_samples import (  # noqa: F401  (Skip, UNREADABLE, TOO_SMALL: this module's API)
    NO_CAPTION,
    TOO_SMALL,
    UNREADABLE,
    Skip,
    caption_text,
    load_image,
    preprocess_to,
)
from training.data.shards import (
    INDEX,
    NULL_CAPTION,
    VALIDATION_PROMPTS,
    atomic_write_bytes,
    encode_sample,
    write_shard,
)
from training.data.text_features import (
    CAPTION_TEXT,
    CHI_CHOICES,
    TextConditioning,
    dir_fingerprint,
    resolve_chi,
)
from training.errors import UserError, exits_cleanly
from training.files.space import disk_full_is_one_line

#: encoded when --validation-prompts is not given: varied subjects, colours, text and counts,
#: where a broken run (wrong conditioning, NaNs, a collapsed model) shows at a glance
DEFAULT_VALIDATION_PROMPTS = (
    "a photo of a red apple on a wooden table",
    "a watercolor painting of a lighthouse on a cliff at sunset",
    "a close-up portrait of an elderly man with a white beard",
    "three blue cubes stacked on top of each other",
    "a city street at night with neon signs in the rain",
    "a sign that says \"hello\" in bold letters",
)


@dataclass(kw_only=True)
class PrecomputeConfig:
    """What ``python -m training.precompute`` was asked to do (one field per flag)."""

    #: raw data: local folder / .tar, or s3:// prefix
    input: str
    #: feature directory to write: local path or s3:// prefix
    out: str
    #: diffusers AutoencoderDC directory (local or s3://)
    vae: str
    #: transformers Gemma2Model directory (local or s3://)
    text_encoder: str
    #: tokenizer directory (local or s3://); usually the text encoder's
    tokenizer: str
    #: square mode: the side images are centre-cropped to; bucket mode: the side of the table's
    #: 1.0 bucket (the table is scaled to it). None: the table's own (buckets) or 512 (square)
    resolution: int | None = None
    #: a Sana aspect-ratio table: "512", "1024", "2048", or "square" (one shape). None: Sana's
    #: ``multi_scale: true`` (every config in NVlabs Sana configs/sana_config/): the table of
    #: --resolution (1024 -> "1024"), else the 512 table scaled to it
    buckets: str | None = None
    #: skip an image as too small when covering its target size needs more upscaling than this
    max_upscale: float = 2.0
    #: N: caption tokens kept (Sana: 300)
    max_text_tokens: int = 300
    #: complex-human-instruction prefix: "sana" (NVlabs Sana's configs), "diffusers" (SanaPipeline's
    #: default list), "none", or a file with one line each
    chi: str = "sana"
    #: "sana" (the raw caption, as NVlabs Sana's train.py) or "diffusers" (lower-cased and
    #: stripped, SanaPipeline's preprocessing); training/data/text_features.py
    caption_text: str = "sana"
    #: prompts to encode for validation images: a file (one a line), "none", or None = the ones
    #: the --out already records (a re-run keeps them), else the built-in list
    validation_prompts: str | None = None
    #: images per VAE / text-encoder forward
    batch_size: int = 16
    #: samples per output shard for folder input (tar input: one shard per input tar)
    samples_per_shard: int = 1000
    #: "auto" (cuda:LOCAL_RANK if available, else cpu), "cpu", "cuda", ...
    device: str = "auto"
    #: model compute dtype: "auto" (bf16 on CUDA, fp32 on CPU), "fp32", "bf16"
    dtype: str = "auto"
    #: local staging for shards going to S3 and for downloaded models / input tars
    work_dir: str | None = None
    #: only wait for all shard markers and write index.json (no models needed but the text encoder)
    merge_only: bool = False
    #: seconds rank 0 waits for the other ranks' shards before giving up
    merge_timeout: float = 6 * 3600.0
    #: image decode / download threads
    io_workers: int = 4
    rank: int = field(default_factory=lambda: int(os.environ.get("RANK", "0")))
    world_size: int = field(default_factory=lambda: int(os.environ.get("WORLD_SIZE", "1")))

    def __post_init__(self) -> None:
        if self.buckets is None:
            self.buckets = str(self.resolution) if str(self.resolution) in TABLES else TABLES[0]
        if self.buckets not in (SQUARE_MODE, *TABLES):
            raise UserError(f"--buckets: {self.buckets!r}; choose {SQUARE_MODE} or a Sana table: {', '.join(TABLES)}")
        if self.resolution is None:
            self.resolution = 512 if self.buckets == SQUARE_MODE else int(self.buckets)
        if self.caption_text not in CAPTION_TEXT:
            raise UserError(f"--caption-text: {self.caption_text!r}; choose {' or '.join(CAPTION_TEXT)}")
        if not self.max_upscale >= 1.0:
            raise UserError(f"--max-upscale: must be >= 1.0, got {self.max_upscale}")
        for name in ("resolution", "max_text_tokens", "batch_size", "samples_per_shard", "io_workers"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        if self.resolution % 32:
            raise UserError(f"--resolution: {self.resolution} is not a multiple of 32 (DC-AE compresses 32x)")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise UserError(f"--dtype: {self.dtype!r}; choose auto, fp32 or bf16")
        if self.chi not in CHI_CHOICES and not Path(self.chi).is_file():
            raise UserError(f"--chi: {self.chi!r} is neither {', '.join(CHI_CHOICES)} nor a readable file")
        if self.validation_prompts not in (None, "none") and not Path(self.validation_prompts).is_file():
            raise UserError(f"--validation-prompts: {self.validation_prompts!r} is not a readable file "
                            "(one prompt a line) nor none")
        if not 0 <= self.rank < self.world_size:
            raise UserError(f"RANK={self.rank} WORLD_SIZE={self.world_size}: rank out of range")


def preprocess(data: bytes, resolution: int) -> torch.Tensor:
    """Image bytes -> [3, R, R] in [-1, 1]: shorter side to R (bicubic), center crop."""
    return preprocess_to(data, (resolution, resolution))


def bucket_table(cfg: PrecomputeConfig, vae_stride: int) -> dict[str, tuple[int, int]]:
    """--buckets as name -> (h, w) pixels: Sana's table scaled to --resolution, sides rounded
    to the VAE's stride; square mode is one ``square`` bucket of resolution x resolution."""
    if cfg.buckets == SQUARE_MODE:
        return {SQUARE: (cfg.resolution, cfg.resolution)}
    scale = cfg.resolution / int(cfg.buckets)
    table = {}
    for name, (h, w) in aspect_ratio_table(cfg.buckets).items():
        table[name] = tuple(max(vae_stride, round(side * scale / vae_stride) * vae_stride) for side in (h, w))
    return table


# ---------------------------------------------------------------------------- models
def _local_model(path: str, work: Path, what: str) -> str:
    if s3.is_s3_url(path):
        return str(s3.sync_down(path, work / "models" / what))
    if not Path(path).is_dir():
        raise UserError(f"--{what} {path}: no such directory; give a local model dir or an s3:// prefix")
    return path


@dataclass
class Models:
    vae: Any
    text_encoder: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    chi: tuple[str, ...] | None
    conditioning: TextConditioning
    #: ``dir_fingerprint`` of the VAE directory (None when not loaded: nothing to encode)
    vae_fingerprint: str | None = None


def settings_of(cfg: PrecomputeConfig, models: Models) -> FeatureSettings:
    """This run's ``FeatureSettings`` (training/data/feature_settings.py)."""
    return FeatureSettings(
        input=normalised_input(cfg.input), resolution=int(cfg.resolution), buckets=str(cfg.buckets),
        max_upscale=float(cfg.max_upscale), samples_per_shard=int(cfg.samples_per_shard),
        max_text_tokens=int(cfg.max_text_tokens), chi_sha256=models.conditioning.chi_sha256,
        caption_text=cfg.caption_text, dtype=str(models.dtype).removeprefix("torch."), vae=models.vae_fingerprint,
        text_encoder=models.conditioning.text_encoder.get("fingerprint"),
        tokenizer=models.conditioning.tokenizer.get("fingerprint"))


def load_models(cfg: PrecomputeConfig, work: Path, *, with_vae: bool = True) -> Models:
    from diffusers import AutoencoderDC
    from transformers import AutoTokenizer, Gemma2Model

    if cfg.device == "auto":
        device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        cfg.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer_dir = _local_model(cfg.tokenizer, work, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"--tokenizer {cfg.tokenizer}: cannot load a tokenizer ({exc})") from None
    encoder_dir = _local_model(cfg.text_encoder, work, "text-encoder")
    try:
        text_encoder = Gemma2Model.from_pretrained(encoder_dir, torch_dtype=dtype).to(device).eval()
    except (OSError, ValueError) as exc:
        raise UserError(f"--text-encoder {cfg.text_encoder}: cannot load Gemma2Model ({exc})") from None
    vae, vae_fingerprint = None, None
    if with_vae:
        vae_dir = _local_model(cfg.vae, work, "vae")
        try:
            vae = AutoencoderDC.from_pretrained(vae_dir, torch_dtype=dtype).to(device).eval()
        except (OSError, ValueError) as exc:
            raise UserError(f"--vae {cfg.vae}: cannot load AutoencoderDC ({exc})") from None
        vae_fingerprint = dir_fingerprint(vae_dir)
    chi = resolve_chi(cfg.chi)
    config = text_encoder.config
    conditioning = TextConditioning.of(
        chi, max_text_tokens=cfg.max_text_tokens,
        tokenizer={"path": cfg.tokenizer, "class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
                   "fingerprint": dir_fingerprint(tokenizer_dir)},
        text_encoder={"path": cfg.text_encoder, "class": type(text_encoder).__name__,
                      "name_or_path": getattr(config, "_name_or_path", None), "hidden_size": config.hidden_size,
                      "num_hidden_layers": config.num_hidden_layers, "dtype": str(dtype).removeprefix("torch."),
                      "fingerprint": dir_fingerprint(encoder_dir)},
        caption_text=cfg.caption_text)
    return Models(vae, text_encoder, tokenizer, device, dtype, chi, conditioning, vae_fingerprint)


# ---------------------------------------------------------------------------- output
# ---------------------------------------------------------------------------- work
@torch.no_grad()
def encode_unit(unit: Unit, models: Models, cfg: PrecomputeConfig, work: Path, pool: ThreadPoolExecutor,
                progress) -> Encoded:
    """Encode every sample of a unit (VAE batches are per bucket: one shape per forward)."""
    from training.data.text_features import encode_for_shards

    table = bucket_table(cfg, vae_stride(models.vae))

    resample = resample_filter(cfg.buckets)

    def load(item: tuple[str, str, Any, Any]) -> tuple[str, tuple[torch.Tensor, str] | Skip, str]:
        key, name, image, caption = item
        try:
            if caption is None:
                raise Skip(NO_CAPTION, "the sample has no .txt")
            text = caption_text(caption if isinstance(caption, bytes) else read_ref(caption),
                                name if isinstance(caption, bytes) else caption)
            if image is None:
                raise Skip(UNREADABLE, "the sample has no .jpg/.jpeg/.png/.webp")
            data = image if isinstance(image, bytes) else read_ref(image)
            return key, load_image(data, table, cfg.max_upscale, resample=resample), text
        except Skip as skip:
            print(f"warning: {name}: {skip}; skipped", file=sys.stderr)
            return key, skip, ""
        except OSError as exc:  # an image / caption file (or its S3 object) that cannot be read
            print(f"warning: {name}: {UNREADABLE} ({exc.strerror or exc}); skipped", file=sys.stderr)
            return key, Skip(UNREADABLE, str(exc)), ""

    enc = Encoded()
    pending: dict[str, list[tuple[str, torch.Tensor, str]]] = {}

    def flush(name: str) -> None:
        batch = pending.pop(name)
        images = torch.stack([b[1] for b in batch]).to(models.device, models.dtype)
        latents = models.vae.encode(images).latent.float().cpu()
        texts = encode_for_shards([b[2] for b in batch], models.tokenizer, models.text_encoder,
                                  max_tokens=cfg.max_text_tokens, complex_human_instruction=models.chi,
                                  caption_text=cfg.caption_text)
        for (key, _, _), lat, txt in zip(batch, latents, texts, strict=True):
            enc.samples.append((key, encode_sample(lat, txt)))
            enc.buckets.append(name)
        enc.shapes[name] = list(latents.shape[1:])
        progress.update(len(batch))

    # Bounded read-ahead: the threads download + decode the next batches while the models
    # run (Executor.map would instead decode the whole unit into memory up front).
    samples, ahead = unit_samples(unit, work), collections.deque()

    def fill() -> None:
        while len(ahead) < 4 * cfg.batch_size and (item := next(samples, None)) is not None:
            ahead.append(pool.submit(load, item))

    fill()
    while ahead:
        key, loaded, text = ahead.popleft().result()
        fill()
        if isinstance(loaded, Skip):
            enc.skipped.append(key)
            enc.reasons[loaded.reason] = enc.reasons.get(loaded.reason, 0) + 1
            continue
        image, name = loaded
        pending.setdefault(name, []).append((key, image, text))
        if len(pending[name]) == cfg.batch_size:
            flush(name)
    for name in list(pending):
        flush(name)
    return enc


@dataclass
class Encoded:
    """One unit's output: samples with their buckets, bucket latent shapes, what was skipped."""

    samples: list[tuple[str, bytes]] = field(default_factory=list)
    buckets: list[str] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


def vae_stride(vae: Any) -> int:
    """Pixels per latent of an AutoencoderDC: one 2x downsample per encoder stage after the
    first (diffusers AutoencoderDC: 6 stages -> 32 for DC-AE f32c32; the tiny VAE's 2 -> 2)."""
    return 2 ** (len(vae.config.encoder_block_out_channels) - 1)


#: what a re-run finds of a failed one (the failure messages say so)
KEPT = "finished shards (those with their shard-NNNNN.json) are kept and skipped"


def check_settings(cfg: PrecomputeConfig, out: Output, models: Models, done: dict[str, dict[str, Any]],
                   previous: dict[str, Any] | None) -> FeatureSettings:
    """This run's settings, refused in one line if ``out`` holds features made with others."""
    settings = settings_of(cfg, models)
    refuse_mixed(cfg.out, recorded_settings(previous, done), settings)
    return settings


def run(cfg: PrecomputeConfig) -> dict[str, Any] | None:
    """Precompute this rank's shards, then (rank 0) merge. Returns the index on rank 0."""
    from tqdm import tqdm

    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="sana-precompute-"))
    work.mkdir(parents=True, exist_ok=True)
    no_caption: list[str] = []
    units = list_units(cfg.input, cfg.samples_per_shard, no_caption)
    out = Output(cfg.out, work)
    done = out.markers()
    previous = out.read_index()
    mine = [u for u in units if u.number % cfg.world_size == cfg.rank]
    todo = [u for u in mine if u.name[:-4] not in done]
    print(f"precompute rank {cfg.rank}/{cfg.world_size}: {len(units)} shards in total, {len(mine)} mine, "
          f"{len(mine) - len(todo)} already done", flush=True)
    models = load_models(cfg, work, with_vae=bool(todo))
    settings = check_settings(cfg, out, models, done, previous)
    if cfg.rank == 0:
        for image in no_caption:
            print(f"warning: {image}: {NO_CAPTION} ({Path(image).stem}.txt missing); skipped", file=sys.stderr)
    # part files a killed or disk-full run left for this rank's shards (no other process writes them)
    out.remove_stale_parts([n for u in mine for n in (u.name, f"{u.name[:-4]}.json")])
    text_dim = models.text_encoder.config.hidden_size
    scaling = float(models.vae.config.scaling_factor) if models.vae is not None else None
    total = sum(len(u.pairs) for u in todo) if all(u.tar is None for u in todo) else None
    # In a batch job's log (no TTY) a progress line every 60 s rather than none at all.
    interactive = sys.stderr.isatty()
    with (disk_full_is_one_line(out.staging, kept=KEPT), ThreadPoolExecutor(cfg.io_workers) as pool,
          tqdm(total=total, unit="img", desc=f"rank {cfg.rank}", mininterval=0.5 if interactive else 60) as progress):
        for unit in todo:
            enc = encode_unit(unit, models, cfg, work, pool, progress)
            bucketed = cfg.buckets != SQUARE_MODE
            entry = (write_shard(out.staging / unit.name, enc.samples, enc.buckets if bucketed else None)
                     if enc.samples else {"name": unit.name, "samples": 0, "bytes": 0, "sha256": ""})
            marker = {**entry, "latent_shape": next(iter(enc.shapes.values()), []), "text_dim": text_dim,
                      "max_text_tokens": cfg.max_text_tokens, "vae_scaling_factor": scaling,
                      "chi_sha256": models.conditioning.chi_sha256, "skipped": enc.skipped,
                      "skipped_reasons": enc.reasons, "bucket_table": f"{cfg.buckets}@{cfg.resolution}",
                      SETTINGS_KEY: settings.to_dict()}
            if bucketed:
                marker["bucket_shapes"] = enc.shapes
                marker.setdefault("buckets", [])
            out.publish(marker)
    if cfg.rank != 0:
        return None
    return merge(cfg, out, units, models, previous=previous, no_caption=len(no_caption))


def merge(cfg: PrecomputeConfig, out: Output, units: Sequence[Unit], models: Models, *,
          previous: dict[str, Any] | None = None, no_caption: int = 0) -> dict[str, Any]:
    """Rank 0: wait until every shard has its marker, then write null caption + index.json.

    ``previous``: the index an earlier run wrote (its validation prompts are kept when
    --validation-prompts is not given); ``no_caption``: images left out for want of a caption."""
    with disk_full_is_one_line(out.staging, kept=KEPT + "; the merge step is redone"):
        return _merge(cfg, out, units, models, previous=previous, no_caption=no_caption)


def _merge(cfg: PrecomputeConfig, out: Output, units: Sequence[Unit], models: Models, *,
           previous: dict[str, Any] | None, no_caption: int) -> dict[str, Any]:
    from safetensors.torch import save as st_save

    from training.data.text_features import encode_for_shards, null_caption

    deadline = time.monotonic() + cfg.merge_timeout
    while True:
        done = out.markers()
        missing = [u.name for u in units if u.name[:-4] not in done]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise UserError(f"{cfg.out}: {len(missing)} shards still unfinished after {cfg.merge_timeout:.0f} s "
                            f"(first: {missing[0]}); re-run precompute (finished shards are kept)")
        time.sleep(min(10.0, max(0.2, cfg.merge_timeout / 100)))
    markers = [done[u.name[:-4]] for u in units]
    if any(m["samples"] and m.get("chi_sha256", models.conditioning.chi_sha256) != models.conditioning.chi_sha256
           for m in markers):
        raise UserError(f"--chi {cfg.chi}: the finished shards in {cfg.out} were encoded with another complex "
                        "human instruction; use the --chi they were made with, or delete them and redo")
    out.remove_stale_parts([INDEX, NULL_CAPTION, VALIDATION_PROMPTS])
    null = null_caption(models.tokenizer, models.text_encoder, max_tokens=cfg.max_text_tokens)
    kept = out.recorded_validation_prompts(previous) if cfg.validation_prompts is None else None
    prompts = kept if kept is not None else validation_prompt_list(cfg.validation_prompts)
    extra: dict[str, Any] = {"text_conditioning": models.conditioning.to_dict(), "validation": {"prompts": prompts}}
    first = next((m for m in markers if m["samples"]), markers[0])
    if first.get(SETTINGS_KEY):
        extra[SETTINGS_KEY] = first[SETTINGS_KEY]
    extra_files: list[str] = []
    if prompts:
        rows = encode_for_shards(prompts, models.tokenizer, models.text_encoder, max_tokens=cfg.max_text_tokens,
                                 complex_human_instruction=models.chi, caption_text=cfg.caption_text)
        # written with open()'s mode (0666 & ~umask), not save_file's 0600 (training/files)
        atomic_write_bytes(out.staging / VALIDATION_PROMPTS,
                           st_save({f"{i:04d}": r.to(torch.bfloat16).contiguous() for i, r in enumerate(rows)},
                                   metadata={PROMPTS_METADATA: json.dumps(prompts)}))
        extra["validation"]["file"] = VALIDATION_PROMPTS
        extra_files.append(VALIDATION_PROMPTS)
    reasons: dict[str, int] = {NO_CAPTION: no_caption} if no_caption else {}
    for m in markers:
        for reason, n in m.get("skipped_reasons", {}).items():
            reasons[reason] = reasons.get(reason, 0) + n
    created_by = {"tool": "training.precompute", "input": cfg.input, "vae": cfg.vae,
                  "text_encoder": cfg.text_encoder, "tokenizer": cfg.tokenizer, "resolution": cfg.resolution,
                  "buckets": cfg.buckets, "max_upscale": cfg.max_upscale, "caption_text": cfg.caption_text,
                  "complex_human_instruction": list(models.chi) if models.chi else None,
                  "dtype": str(models.dtype).removeprefix("torch."), "skipped": sum(reasons.values()),
                  "skipped_reasons": reasons}
    index = out.write_index(markers, null, created_by, extra, extra_files)
    print(f"precompute: {index['num_samples']} samples in {len(index['shards'])} shards -> {cfg.out}; "
          f"{index['bytes_per_sample']:.0f} bytes/sample", flush=True)
    for name, bucket in (index.get("buckets") or {}).items():
        print(f"precompute: bucket {name}: {bucket['samples']} samples, latents "
              f"{'x'.join(map(str, bucket['latent_shape']))}", flush=True)
    for reason, n in sorted(reasons.items()):
        print(f"precompute: skipped {n} images: {reason}", flush=True)
    if out.is_s3:
        shutil.rmtree(out.staging, ignore_errors=True)
    return index


def validation_prompt_list(choice: str | None) -> list[str]:
    """--validation-prompts -> the prompts (blank lines dropped); [] for "none"."""
    if choice == "none":
        return []
    if choice is None:
        return list(DEFAULT_VALIDATION_PROMPTS)
    return [line.strip() for line in Path(choice).read_text().splitlines() if line.strip()]


def parse_args(argv: Sequence[str] | None) -> PrecomputeConfig:
    p = argparse.ArgumentParser(prog="python -m training.precompute", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="folder of images + .txt, WebDataset .tar(s), or s3:// prefix")
    p.add_argument("--out", required=True, help="feature directory: local path or s3:// prefix")
    p.add_argument("--vae", required=True, help="AutoencoderDC directory (local or s3://)")
    p.add_argument("--text-encoder", required=True, help="Gemma2Model directory (local or s3://)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the text encoder's)")
    p.add_argument("--resolution", type=int, help="square side (default 512), or the side of the bucket "
                                                  "table's 1.0 bucket (default: the table's own)")
    p.add_argument("--buckets", choices=[*TABLES, SQUARE_MODE],
                   help="512/1024/2048: NVlabs Sana's aspect-ratio training buckets (default: the table of "
                        "--resolution, else 512's scaled to it: Sana's multi_scale); square: centre-crop to --resolution")
    p.add_argument("--max-upscale", type=float, default=2.0,
                   help="skip images that need more upscaling than this to cover their bucket (default 2)")
    p.add_argument("--max-text-tokens", type=int, default=300)
    p.add_argument("--chi", default="sana",
                   help="complex human instruction: sana (NVlabs Sana's, default), diffusers (SanaPipeline's), "
                        "none, or FILE (one line each)")
    p.add_argument("--caption-text", default="sana", choices=list(CAPTION_TEXT),
                   help="sana: the raw caption after the CHI (NVlabs Sana's train.py, default); diffusers: "
                        "lower-cased and stripped first (SanaPipeline's preprocessing)")
    p.add_argument("--validation-prompts", help="prompts for validation images, one a line, or none "
                                                "(default: those --out already records, else a built-in six)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--work-dir", help="staging/cache dir (default: a new temp dir)")
    p.add_argument("--merge-only", action="store_true", help="only (re)write index.json from finished shards")
    p.add_argument("--merge-timeout", type=float, default=6 * 3600.0)
    p.add_argument("--io-workers", type=int, default=4)
    a = p.parse_args(argv)
    return PrecomputeConfig(input=a.input, out=a.out, vae=a.vae, text_encoder=a.text_encoder,
                            tokenizer=a.tokenizer or a.text_encoder, resolution=a.resolution,
                            buckets=a.buckets, max_upscale=a.max_upscale,
                            max_text_tokens=a.max_text_tokens, chi=a.chi, caption_text=a.caption_text,
                            validation_prompts=a.validation_prompts, batch_size=a.batch_size,
                            samples_per_shard=a.samples_per_shard, device=a.device, dtype=a.dtype,
                            work_dir=a.work_dir, merge_only=a.merge_only, merge_timeout=a.merge_timeout,
                            io_workers=a.io_workers)


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    cfg = parse_args(argv)
    if cfg.merge_only:
        work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="sana-precompute-"))
        out = Output(cfg.out, work)
        no_caption: list[str] = []
        units = list_units(cfg.input, cfg.samples_per_shard, no_caption)
        previous = out.read_index()
        models = load_models(cfg, work, with_vae=False)
        check_settings(cfg, out, models, out.markers(), previous)
        return merge(cfg, out, units, models, previous=previous, no_caption=len(no_caption))
    return run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
