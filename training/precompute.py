"""Raw image + caption pairs -> DC-AE latents + Gemma-2 caption embeddings, as feature shards.

    python -m training.precompute --input s3://data/raw/ --out s3://data/features/v1 \\
        --vae /fsx/models/dc-ae --text-encoder /fsx/models/gemma-2-2b --tokenizer /fsx/models/gemma-2-2b

    torchrun --nproc-per-node 8 -m training.precompute ...   # ranks split the shards

Input (local dir or s3:// prefix), either layout:
- a folder of images (.jpg .jpeg .png .webp) each with a same-stem ``.txt`` caption,
  searched recursively; samples sorted by relative path and cut into shards of
  ``--samples-per-shard``;
- WebDataset tars (``*.tar`` with ``<key>.<img ext>`` + ``<key>.txt`` members); one output
  shard per input tar.

Resumable: the assignment of samples to shards depends only on the input listing, a
shard is written through a temp name, and ``shard-NNNNN.json`` (its index entry) is
written after the tar: a shard with its marker is skipped on the next run. Rank r of
WORLD_SIZE (torchrun env) takes shards r, r+W, ...; rank 0 then waits for every marker
and writes null_caption.safetensors and, last, index.json (``--merge-only`` redoes just
that step). The run is thus restartable at any point, by any number of ranks.

Aspect-ratio buckets (``--buckets 512|1024|2048``; ``square``, the default, centre-crops
every image to ``--resolution``): each image goes to the bucket of NVlabs Sana's table with
the nearest h/w ratio, is resized to cover it and centre-cropped to it (training/data/
buckets.py); the table is scaled to ``--resolution`` (default: the table's own, e.g. 512).
Shards record each sample's bucket, index.json lists the buckets with counts and shapes.
Unreadable images, and images smaller than their target (it would take more than
``--max-upscale``, 2x by default, to cover it), are skipped: counted per reason, one summary
line each.

Text conditioning: captions get NVlabs Sana's complex human instruction by default
(``--chi sana``; ``diffusers`` for SanaPipeline's list, ``none``, or a file), and the
choice, its sha256, N, the tokenizer and the text encoder's identity go into index.json
``text_conditioning`` (training/text_features.py). The merge step also encodes the
validation prompts (``--validation-prompts``, a built-in list by default) with the same
settings into validation_prompts.safetensors, so training renders its validation images
without loading a text encoder (training/validation.py).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training import s3
from training.data import (
    INDEX,
    NULL_CAPTION,
    SQUARE,
    VALIDATION_PROMPTS,
    encode_sample,
    shard_name,
    write_index,
    write_shard,
)
from training.data.buckets import SQUARE_MODE, TABLES, aspect_ratio_table, cover_resize, nearest_bucket
from training.errors import UserError, exits_cleanly
from training.text_features import CHI_CHOICES, TextConditioning, dir_fingerprint, resolve_chi

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp")
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
    #: 1.0 bucket (the table is scaled to it). None: 512 (square) or the table's own (buckets)
    resolution: int | None = None
    #: "square" (one shape) or a Sana aspect-ratio table: "512", "1024", "2048"
    buckets: str = SQUARE_MODE
    #: skip an image as too small when covering its target size needs more upscaling than this
    max_upscale: float = 2.0
    #: N: caption tokens kept (Sana: 300)
    max_text_tokens: int = 300
    #: complex-human-instruction prefix: "sana" (NVlabs Sana's configs), "diffusers" (SanaPipeline's
    #: default list), "none", or a file with one line each
    chi: str = "sana"
    #: prompts to encode for validation images: a file (one a line), "none", or None = the built-in list
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
        if self.buckets not in (SQUARE_MODE, *TABLES):
            raise UserError(f"--buckets: {self.buckets!r}; choose {SQUARE_MODE} or a Sana table: {', '.join(TABLES)}")
        if self.resolution is None:
            self.resolution = 512 if self.buckets == SQUARE_MODE else int(self.buckets)
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


# ---------------------------------------------------------------------------- input
@dataclass(frozen=True)
class Unit:
    """One output shard's worth of input: image/caption pairs, or one WebDataset tar."""

    number: int
    pairs: tuple[tuple[str, str, str], ...] = ()  # (key, image ref, caption ref)
    tar: str | None = None

    @property
    def name(self) -> str:
        return shard_name(self.number)


def _key(rel: str) -> str:
    return rel.rsplit(".", 1)[0].replace("/", "__")


def list_units(source: str, samples_per_shard: int) -> list[Unit]:
    """Deterministic split of the input into shards (every rank computes the same list)."""
    if s3.is_s3_url(source):
        base = s3.parse_s3_url(source.rstrip("/"))
        rels = s3.list_keys(base)
        ref = lambda rel: str(base.join(rel))  # noqa: E731
    else:
        root = Path(source)
        if root.is_file() and root.suffix == ".tar":
            return [Unit(0, tar=str(root))]
        if not root.is_dir():
            raise UserError(f"--input {source}: no such directory; give a folder of images + .txt captions, "
                            "WebDataset .tar files, or an s3:// prefix")
        rels = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        ref = lambda rel: str(root / rel)  # noqa: E731
    tars = [r for r in rels if r.endswith(".tar")]
    if tars:
        return [Unit(i, tar=ref(r)) for i, r in enumerate(tars)]
    texts = {r for r in rels if r.endswith(".txt")}
    pairs, missing = [], 0
    for r in rels:
        if r.lower().endswith(IMAGE_EXTS):
            caption = r.rsplit(".", 1)[0] + ".txt"
            if caption in texts:
                pairs.append((_key(r), ref(r), ref(caption)))
            else:
                missing += 1
    if missing:
        print(f"warning: {missing} images under {source} have no .txt caption; skipped", file=sys.stderr)
    if not pairs:
        raise UserError(f"--input {source}: found no image + .txt caption pairs and no .tar files")
    return [Unit(i // samples_per_shard, pairs=tuple(pairs[i:i + samples_per_shard]))
            for i in range(0, len(pairs), samples_per_shard)]


def _read(ref: str) -> bytes:
    return s3.get_bytes(ref) if s3.is_s3_url(ref) else Path(ref).read_bytes()


def preprocess(data: bytes, resolution: int) -> torch.Tensor:
    """Image bytes -> [3, R, R] in [-1, 1]: shorter side to R (bicubic), center crop."""
    return preprocess_to(data, (resolution, resolution))


class Skip(Exception):
    """An input image that is not used; ``reason`` is the summary line it is counted under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}{f' ({detail})' if detail else ''}")
        self.reason = reason


#: skip reasons, as the summary prints them
UNREADABLE, TOO_SMALL = "unreadable or corrupt image", "too small for its bucket"


def _open_rgb(data: bytes):
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.load()  # decode now: a truncated file fails here, not mid-batch
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # PIL's errors
        raise Skip(UNREADABLE, str(exc)) from None


def preprocess_to(data: bytes, target: tuple[int, int], img=None) -> torch.Tensor:
    """Image bytes -> [3, h, w] in [-1, 1]: resized (bicubic) to cover ``target`` (h, w) with its
    aspect kept, then centre-cropped to it (NVlabs Sana's SanaWebDatasetMS.getdata)."""
    import numpy as np
    from PIL import Image

    img = _open_rgb(data) if img is None else img
    th, tw = target
    rh, rw = cover_resize(img.height, img.width, target)
    img = img.resize((rw, rh), Image.BICUBIC)
    left, top = (rw - tw) // 2, (rh - th) // 2
    img = img.crop((left, top, left + tw, top + th))
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    return x.float() / 127.5 - 1.0


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


def load_image(data: bytes, table: dict[str, tuple[int, int]], max_upscale: float) -> tuple[torch.Tensor, str]:
    """Image bytes -> (pixels at its bucket's size, bucket name); ``Skip`` if unusable."""
    img = _open_rgb(data)
    name = next(iter(table)) if len(table) == 1 else nearest_bucket(img.height, img.width, table)
    th, tw = table[name]
    upscale = max(th / img.height, tw / img.width)
    if upscale > max_upscale:
        raise Skip(TOO_SMALL, f"{img.width}x{img.height} -> {tw}x{th} is {upscale:.1f}x, over --max-upscale "
                              f"{max_upscale:g}")
    return preprocess_to(data, (th, tw), img), name


def unit_samples(unit: Unit, work: Path) -> Iterator[tuple[str, bytes, str]]:
    """(key, image bytes, caption) of a unit, in a fixed order."""
    if unit.tar is None:
        for key, image, caption in unit.pairs:
            yield key, image, caption
        return
    path = Path(unit.tar)
    if s3.is_s3_url(unit.tar):
        path = s3.download_file(unit.tar, work / "input" / unit.tar.rsplit("/", 1)[-1])
    stem = path.name[:-4]
    groups: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path) as tar:
            for m in tar:
                if not m.isfile():
                    continue
                directory, _, base = m.name.rpartition("/")
                key, _, ext = base.partition(".")
                groups.setdefault(f"{directory}/{key}" if directory else key, {})[ext.lower()] = (
                    tar.extractfile(m).read())
    except tarfile.TarError as exc:
        raise UserError(f"{unit.tar}: not a readable tar ({exc}); fix or remove it") from None
    finally:
        if path != Path(unit.tar):
            path.unlink(missing_ok=True)  # a downloaded input tar is read once
    for key in sorted(groups):
        parts = groups[key]
        image = next((parts[e] for e in ("jpg", "jpeg", "png", "webp") if e in parts), None)
        if image is None or "txt" not in parts:
            print(f"warning: {unit.tar}: sample {key} lacks an image or .txt; skipped", file=sys.stderr)
            continue
        yield f"{stem}__{key.replace('/', '__')}", image, parts["txt"].decode("utf-8")


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
    vae = None
    if with_vae:
        try:
            vae = AutoencoderDC.from_pretrained(_local_model(cfg.vae, work, "vae"), torch_dtype=dtype).to(device).eval()
        except (OSError, ValueError) as exc:
            raise UserError(f"--vae {cfg.vae}: cannot load AutoencoderDC ({exc})") from None
    chi = resolve_chi(cfg.chi)
    config = text_encoder.config
    conditioning = TextConditioning.of(
        chi, max_text_tokens=cfg.max_text_tokens,
        tokenizer={"path": cfg.tokenizer, "class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
                   "fingerprint": dir_fingerprint(tokenizer_dir)},
        text_encoder={"path": cfg.text_encoder, "class": type(text_encoder).__name__,
                      "name_or_path": getattr(config, "_name_or_path", None), "hidden_size": config.hidden_size,
                      "num_hidden_layers": config.num_hidden_layers, "dtype": str(dtype).removeprefix("torch."),
                      "fingerprint": dir_fingerprint(encoder_dir)})
    return Models(vae, text_encoder, tokenizer, device, dtype, chi, conditioning)


# ---------------------------------------------------------------------------- output
class Output:
    """The feature directory, local or S3: markers, shards, index."""

    def __init__(self, out: str, work: Path) -> None:
        self.out, self.work = out.rstrip("/"), work
        self.is_s3 = s3.is_s3_url(out)
        self.staging = work / "staging" if self.is_s3 else Path(out)
        self.staging.mkdir(parents=True, exist_ok=True)
        self._seen: dict[str, dict[str, Any]] = {}  # S3 markers already read (they never change)

    def markers(self) -> dict[str, dict[str, Any]]:
        """Finished shards: name -> marker (a marker whose tar is missing does not count)."""
        if self.is_s3:
            keys = set(s3.list_keys(self.out))  # a missing bucket is a one-line UserError here
            for name in (k[:-5] for k in keys if k.startswith("shard-") and k.endswith(".json")):
                if name not in self._seen:
                    self._seen[name] = json.loads(s3.get_bytes(f"{self.out}/{name}.json"))
            return {n: m for n, m in self._seen.items() if m["samples"] == 0 or f"{n}.tar" in keys}
        done = {}
        for path in self.staging.glob("shard-*.json"):
            marker = json.loads(path.read_text())
            tar = self.staging / marker["name"]
            if marker["samples"] == 0 or (tar.exists() and tar.stat().st_size == marker["bytes"]):
                done[marker["name"][:-4]] = marker
        return done

    def publish(self, marker: dict[str, Any]) -> None:
        """Tar first, then its marker: a marker always points at a complete shard."""
        tar = self.staging / marker["name"]
        body = json.dumps(marker, indent=1)
        if self.is_s3:
            if marker["samples"]:
                s3.upload_file(tar, f"{self.out}/{marker['name']}")
            s3.put_bytes(body.encode(), f"{self.out}/{marker['name'][:-4]}.json")
            tar.unlink(missing_ok=True)
        else:
            path = self.staging / f"{marker['name'][:-4]}.json"
            tmp = path.with_name(f".{path.name}.part-{os.getpid()}")
            tmp.write_text(body)
            os.replace(tmp, path)

    def write_index(self, markers: Sequence[dict[str, Any]], null: torch.Tensor, created_by: dict[str, Any],
                    extra: dict[str, Any], extra_files: Sequence[str] = ()) -> dict[str, Any]:
        first = next((m for m in markers if m["samples"]), markers[0])
        bucketed = "bucket_shapes" in first
        shape_key = "bucket_table" if bucketed else "latent_shape"
        for m in markers:
            for key in (shape_key, "text_dim", "max_text_tokens", "vae_scaling_factor", "chi_sha256"):
                if m["samples"] and m.get(key) != first.get(key):
                    raise UserError(f"{self.out}/{m['name']}: {key} {m.get(key)} differs from {first['name']}'s "
                                    f"{first.get(key)}; shards come from different settings - delete and redo them")
        keys = ("name", "samples", "bytes", "sha256", *(("buckets",) if bucketed else ()))
        shards = [{k: m[k] for k in keys} for m in markers if m["samples"]]
        if not shards:
            raise UserError(f"{self.out}: every shard is empty; check the input")
        shapes = {name: shape for m in markers if m["samples"] for name, shape in m.get("bucket_shapes", {}).items()}
        index = write_index(self.staging, shards=shards, latent_shape=None if bucketed else first["latent_shape"],
                            text_dim=first["text_dim"], max_text_tokens=first["max_text_tokens"],
                            vae_scaling_factor=first["vae_scaling_factor"], null_caption=null,
                            created_by=created_by, extra=extra, bucket_shapes=shapes if bucketed else None)
        if self.is_s3:
            for name in (NULL_CAPTION, *extra_files):
                s3.upload_file(self.staging / name, f"{self.out}/{name}")
            s3.upload_file(self.staging / INDEX, f"{self.out}/{INDEX}")  # last: makes the directory readable
        return index


# ---------------------------------------------------------------------------- work
@torch.no_grad()
def encode_unit(unit: Unit, models: Models, cfg: PrecomputeConfig, work: Path, pool: ThreadPoolExecutor,
                progress) -> Encoded:
    """Encode every sample of a unit (VAE batches are per bucket: one shape per forward)."""
    from training.text_features import encode_for_shards

    table = bucket_table(cfg, vae_stride(models.vae))

    def load(item: tuple[str, Any, str]) -> tuple[str, tuple[torch.Tensor, str] | Skip, str]:
        key, image, caption = item
        try:
            data = image if isinstance(image, bytes) else _read(image)
            text = caption if unit.tar is not None else _read(caption).decode("utf-8")
            return key, load_image(data, table, cfg.max_upscale), text.strip()
        except Skip as skip:
            print(f"warning: {key}: {skip}; skipped", file=sys.stderr)
            return key, skip, ""
        except (OSError, ValueError) as exc:  # an unreadable image / caption file (or its S3 object)
            print(f"warning: {key}: unreadable ({exc}); skipped", file=sys.stderr)
            return key, Skip(UNREADABLE, str(exc)), ""

    enc = Encoded()
    pending: dict[str, list[tuple[str, torch.Tensor, str]]] = {}

    def flush(name: str) -> None:
        batch = pending.pop(name)
        images = torch.stack([b[1] for b in batch]).to(models.device, models.dtype)
        latents = models.vae.encode(images).latent.float().cpu()
        texts = encode_for_shards([b[2] for b in batch], models.tokenizer, models.text_encoder,
                                  max_tokens=cfg.max_text_tokens, complex_human_instruction=models.chi)
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


def run(cfg: PrecomputeConfig) -> dict[str, Any] | None:
    """Precompute this rank's shards, then (rank 0) merge. Returns the index on rank 0."""
    from tqdm import tqdm

    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="sana-precompute-"))
    work.mkdir(parents=True, exist_ok=True)
    units = list_units(cfg.input, cfg.samples_per_shard)
    out = Output(cfg.out, work)
    done = out.markers()
    mine = [u for u in units if u.number % cfg.world_size == cfg.rank]
    todo = [u for u in mine if u.name[:-4] not in done]
    print(f"precompute rank {cfg.rank}/{cfg.world_size}: {len(units)} shards in total, {len(mine)} mine, "
          f"{len(mine) - len(todo)} already done", flush=True)
    models = load_models(cfg, work, with_vae=bool(todo))
    text_dim = models.text_encoder.config.hidden_size
    scaling = float(models.vae.config.scaling_factor) if models.vae is not None else None
    total = sum(len(u.pairs) for u in todo) if all(u.tar is None for u in todo) else None
    # In a batch job's log (no TTY) a progress line every 60 s rather than none at all.
    interactive = sys.stderr.isatty()
    with ThreadPoolExecutor(cfg.io_workers) as pool, tqdm(total=total, unit="img", desc=f"rank {cfg.rank}",
                                                          mininterval=0.5 if interactive else 60) as progress:
        for unit in todo:
            enc = encode_unit(unit, models, cfg, work, pool, progress)
            bucketed = cfg.buckets != SQUARE_MODE
            entry = (write_shard(out.staging / unit.name, enc.samples, enc.buckets if bucketed else None)
                     if enc.samples else {"name": unit.name, "samples": 0, "bytes": 0, "sha256": ""})
            marker = {**entry, "latent_shape": next(iter(enc.shapes.values()), []), "text_dim": text_dim,
                      "max_text_tokens": cfg.max_text_tokens, "vae_scaling_factor": scaling,
                      "chi_sha256": models.conditioning.chi_sha256, "skipped": enc.skipped,
                      "skipped_reasons": enc.reasons, "bucket_table": f"{cfg.buckets}@{cfg.resolution}"}
            if bucketed:
                marker["bucket_shapes"] = enc.shapes
                marker.setdefault("buckets", [])
            out.publish(marker)
    if cfg.rank != 0:
        return None
    return merge(cfg, out, units, models)


def merge(cfg: PrecomputeConfig, out: Output, units: Sequence[Unit], models: Models) -> dict[str, Any]:
    """Rank 0: wait until every shard has its marker, then write null caption + index.json."""
    from training.text_features import encode_for_shards, null_caption

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
    null = null_caption(models.tokenizer, models.text_encoder, max_tokens=cfg.max_text_tokens)
    prompts = validation_prompt_list(cfg.validation_prompts)
    extra: dict[str, Any] = {"text_conditioning": models.conditioning.to_dict(), "validation": {"prompts": prompts}}
    extra_files: list[str] = []
    if prompts:
        from safetensors.torch import save_file

        rows = encode_for_shards(prompts, models.tokenizer, models.text_encoder, max_tokens=cfg.max_text_tokens,
                                 complex_human_instruction=models.chi)
        save_file({f"{i:04d}": r.to(torch.bfloat16).contiguous() for i, r in enumerate(rows)},
                  str(out.staging / VALIDATION_PROMPTS))
        from training.files import honour_umask

        honour_umask(out.staging / VALIDATION_PROMPTS)  # save_file writes 0600 (training/files)
        extra["validation"]["file"] = VALIDATION_PROMPTS
        extra_files.append(VALIDATION_PROMPTS)
    created_by = {"tool": "training.precompute", "input": cfg.input, "vae": cfg.vae,
                  "text_encoder": cfg.text_encoder, "tokenizer": cfg.tokenizer, "resolution": cfg.resolution,
                  "buckets": cfg.buckets, "max_upscale": cfg.max_upscale,
                  "complex_human_instruction": list(models.chi) if models.chi else None,
                  "dtype": str(models.dtype).removeprefix("torch."),
                  "skipped": sum(len(m.get("skipped", [])) for m in markers)}
    reasons: dict[str, int] = {}
    for m in markers:
        for reason, n in m.get("skipped_reasons", {}).items():
            reasons[reason] = reasons.get(reason, 0) + n
    created_by["skipped_reasons"] = reasons
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
    p.add_argument("--buckets", default=SQUARE_MODE, choices=[SQUARE_MODE, *TABLES],
                   help="square: centre-crop to --resolution; 512/1024/2048: NVlabs Sana's aspect-ratio buckets")
    p.add_argument("--max-upscale", type=float, default=2.0,
                   help="skip images that need more upscaling than this to cover their bucket (default 2)")
    p.add_argument("--max-text-tokens", type=int, default=300)
    p.add_argument("--chi", default="sana",
                   help="complex human instruction: sana (NVlabs Sana's, default), diffusers (SanaPipeline's), "
                        "none, or FILE (one line each)")
    p.add_argument("--validation-prompts", help="prompts for validation images, one a line, or none "
                                                "(default: a built-in list of six)")
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
                            max_text_tokens=a.max_text_tokens, chi=a.chi,
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
        return merge(cfg, out, list_units(cfg.input, cfg.samples_per_shard),
                     load_models(cfg, work, with_vae=False))
    return run(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
