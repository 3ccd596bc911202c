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
    VALIDATION_PROMPTS,
    encode_sample,
    shard_name,
    write_index,
    write_shard,
)
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
    #: square training resolution: shorter side resized to it (bicubic), then center-cropped
    resolution: int = 512
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
    import numpy as np
    from PIL import Image

    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    scale = resolution / min(w, h)
    img = img.resize((max(resolution, round(w * scale)), max(resolution, round(h * scale))), Image.BICUBIC)
    w, h = img.size
    left, top = (w - resolution) // 2, (h - resolution) // 2
    img = img.crop((left, top, left + resolution, top + resolution))
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    return x.float() / 127.5 - 1.0


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
        for m in markers:
            for key in ("latent_shape", "text_dim", "max_text_tokens", "vae_scaling_factor", "chi_sha256"):
                if m["samples"] and m.get(key) != first.get(key):
                    raise UserError(f"{self.out}/{m['name']}: {key} {m[key]} differs from {first['name']}'s "
                                    f"{first[key]}; shards come from different settings - delete and redo them")
        shards = [{k: m[k] for k in ("name", "samples", "bytes", "sha256")} for m in markers if m["samples"]]
        if not shards:
            raise UserError(f"{self.out}: every shard is empty; check the input")
        index = write_index(self.staging, shards=shards, latent_shape=first["latent_shape"],
                            text_dim=first["text_dim"], max_text_tokens=first["max_text_tokens"],
                            vae_scaling_factor=first["vae_scaling_factor"], null_caption=null,
                            created_by=created_by, extra=extra)
        if self.is_s3:
            for name in (NULL_CAPTION, *extra_files):
                s3.upload_file(self.staging / name, f"{self.out}/{name}")
            s3.upload_file(self.staging / INDEX, f"{self.out}/{INDEX}")  # last: makes the directory readable
        return index


# ---------------------------------------------------------------------------- work
@torch.no_grad()
def encode_unit(unit: Unit, models: Models, cfg: PrecomputeConfig, work: Path, pool: ThreadPoolExecutor,
                progress) -> tuple[list[tuple[str, bytes]], list[int], list[str]]:
    """Encode every sample of a unit: (key, safetensors bytes) pairs, latent shape, skipped keys."""
    from training.text_features import encode_for_shards

    def load(item: tuple[str, Any, str]) -> tuple[str, torch.Tensor | None, str]:
        key, image, caption = item
        try:
            data = image if isinstance(image, bytes) else _read(image)
            text = caption if unit.tar is not None else _read(caption).decode("utf-8")
            return key, preprocess(data, cfg.resolution), text.strip()
        except (OSError, ValueError, SyntaxError) as exc:  # PIL: unreadable / truncated image
            print(f"warning: {key}: unreadable image ({exc}); skipped", file=sys.stderr)
            return key, None, ""

    out, skipped, latent_shape = [], [], []
    batch: list[tuple[str, torch.Tensor, str]] = []

    def flush() -> None:
        images = torch.stack([b[1] for b in batch]).to(models.device, models.dtype)
        latents = models.vae.encode(images).latent.float().cpu()
        texts = encode_for_shards([b[2] for b in batch], models.tokenizer, models.text_encoder,
                                  max_tokens=cfg.max_text_tokens, complex_human_instruction=models.chi)
        for (key, _, _), lat, txt in zip(batch, latents, texts, strict=True):
            out.append((key, encode_sample(lat, txt)))
        latent_shape[:] = list(latents.shape[1:])
        progress.update(len(batch))
        batch.clear()

    # Bounded read-ahead: the threads download + decode the next batches while the models
    # run (Executor.map would instead decode the whole unit into memory up front).
    samples, ahead = unit_samples(unit, work), collections.deque()

    def fill() -> None:
        while len(ahead) < 4 * cfg.batch_size and (item := next(samples, None)) is not None:
            ahead.append(pool.submit(load, item))

    fill()
    while ahead:
        key, image, text = ahead.popleft().result()
        fill()
        if image is None:
            skipped.append(key)
            continue
        batch.append((key, image, text))
        if len(batch) == cfg.batch_size:
            flush()
    if batch:
        flush()
    return out, latent_shape, skipped


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
            samples, latent_shape, skipped = encode_unit(unit, models, cfg, work, pool, progress)
            entry = (write_shard(out.staging / unit.name, samples) if samples
                     else {"name": unit.name, "samples": 0, "bytes": 0, "sha256": ""})
            out.publish({**entry, "latent_shape": latent_shape, "text_dim": text_dim,
                         "max_text_tokens": cfg.max_text_tokens, "vae_scaling_factor": scaling,
                         "chi_sha256": models.conditioning.chi_sha256, "skipped": skipped})
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
        extra["validation"]["file"] = VALIDATION_PROMPTS
        extra_files.append(VALIDATION_PROMPTS)
    created_by = {"tool": "training.precompute", "input": cfg.input, "vae": cfg.vae,
                  "text_encoder": cfg.text_encoder, "tokenizer": cfg.tokenizer, "resolution": cfg.resolution,
                  "complex_human_instruction": list(models.chi) if models.chi else None,
                  "dtype": str(models.dtype).removeprefix("torch."),
                  "skipped": sum(len(m.get("skipped", [])) for m in markers)}
    index = out.write_index(markers, null, created_by, extra, extra_files)
    print(f"precompute: {index['num_samples']} samples in {len(index['shards'])} shards -> {cfg.out}; "
          f"{index['bytes_per_sample']:.0f} bytes/sample", flush=True)
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
    p.add_argument("--resolution", type=int, default=512)
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
