"""Feature shards: the precomputed latents + caption embeddings the loop trains on.

Layout of a feature directory (local/FSx path or ``s3://`` prefix)::

    index.json                 shapes, dtype, per-shard sample count / bytes / sha256, and
                               text_conditioning (CHI, N, tokenizer, text encoder: see
                               training/text_features.py TextConditioning)
    null_caption.safetensors   {"text": [n, D] bf16}: the empty caption, for CFG dropout
                               (also the negative prompt of validation images)
    validation_prompts.safetensors  {"0000": [n, D] bf16, ...}: index.json validation.prompts,
                               encoded like the captions (optional; training/validation.py)
    shard-00000.tar ...        one member per sample: ``<key>.safetensors`` holding
                               "latents" [C,H,W] bf16 (UNscaled) and "text" [n_real, D] bf16

Why this shape: the text encoder (Gemma-2-2B) and the VAE cost more per sample than a
600M training step, so they run once (training/precompute.py). Embeddings keep only their
real tokens (a 20-token caption stores 20 rows, not 300): about 6x fewer bytes on S3/FSx;
padding and the attention mask are recreated in collate to ``max_text_tokens`` so every
batch has the same static shape (XLA compiles one graph; ``drop_last`` for the same reason).

Order: one global permutation per epoch from ``(seed, epoch)``; step ``s`` of an epoch
takes ``perm[s*G:(s+1)*G]`` with ``G = batch_size * world_size`` and rank ``r`` the
``r``-th slice of ``batch_size`` of it, so ranks are disjoint and the global batch is the
same for any world size. The position (epoch, step) is the loader's whole state.
Random access into the tars goes through mmap and member offsets read from the tar
headers, so a shuffled read is a page-cache copy, not a tar scan.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import fcntl
import hashlib
import io
import json
import mmap
import os
import queue
import sys
import tarfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from training import s3
from training.errors import UserError, exits_cleanly
from training.text_features import TextConditioning

FORMAT = "sana-features/1"
INDEX = "index.json"
NULL_CAPTION = "null_caption.safetensors"
VALIDATION_PROMPTS = "validation_prompts.safetensors"
_DTYPE = torch.bfloat16
MAX_MAPPED_SHARDS = 128
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(kw_only=True)
class DataConfig:
    """The ``data`` section of TrainConfig."""

    #: feature directory: local/FSx path (e.g. /fsx/data/features/run1) or s3://bucket/prefix
    path: str = ""
    #: samples per device per micro-batch (global batch = batch_size * world_size)
    batch_size: int = 8
    #: shuffle seed; epoch e uses (seed, e), so every rank computes the same permutation
    seed: int = 0
    #: where shards from an s3:// path are downloaded (default ~/.cache/sana/features/...)
    cache_dir: str | None = None
    #: batches prepared ahead by the background thread (0 = load in the caller's thread)
    prefetch: int = 4
    #: check each shard's sha256 against index.json on first use (one sequential read)
    verify: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise ValueError(f"data.path: must be a string path or s3:// URL, got {self.path!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"data.batch_size: must be an integer >= 1, got {self.batch_size!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed: must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"data.prefetch: must be an integer >= 0, got {self.prefetch!r}")


# ---------------------------------------------------------------------------- writing
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * 1024**2):
            digest.update(chunk)
    return digest.hexdigest()


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.tar"


def encode_sample(latents: torch.Tensor, text: torch.Tensor) -> bytes:
    """One sample as safetensors bytes, bf16, contiguous (what a tar member holds)."""
    return st_save({"latents": latents.detach().to("cpu", _DTYPE).contiguous(),
                    "text": text.detach().to("cpu", _DTYPE).contiguous()})


def write_shard(path: Path, samples: Sequence[tuple[str, bytes]]) -> dict[str, Any]:
    """Write ``(key, encode_sample(...))`` pairs as one tar through a temp name; returns its
    index entry. The rename makes a shard either complete or absent (precompute resume)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}")
    with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, payload in samples:
            info = tarfile.TarInfo(f"{key}.safetensors")
            info.size, info.mode, info.mtime = len(payload), 0o644, 0  # mtime 0: reproducible bytes
            tar.addfile(info, io.BytesIO(payload))
    os.replace(tmp, path)
    return {"name": path.name, "samples": len(samples), "bytes": path.stat().st_size, "sha256": _sha256(path)}


def write_index(out_dir: str | Path, *, shards: Sequence[dict[str, Any]], latent_shape: Sequence[int],
                text_dim: int, max_text_tokens: int, vae_scaling_factor: float,
                null_caption: torch.Tensor | None = None, created_by: dict[str, Any] | None = None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write index.json (last: it is what makes the directory readable) and, if given,
    null_caption.safetensors. ``extra``: further top-level keys (``text_conditioning``,
    ``validation``). Returns the index dict."""
    out = Path(out_dir)
    if null_caption is not None:
        if null_caption.ndim != 2 or null_caption.shape[1] != text_dim:
            raise ValueError(f"null_caption: expected [n, {text_dim}], got {list(null_caption.shape)}")
        (out / NULL_CAPTION).write_bytes(st_save({"text": null_caption.detach().to("cpu", _DTYPE).contiguous()}))
    shards = sorted(shards, key=lambda s: s["name"])
    num = sum(s["samples"] for s in shards)
    total = sum(s["bytes"] for s in shards)
    index = {
        "format": FORMAT, "latent_shape": [int(x) for x in latent_shape], "text_dim": int(text_dim),
        "max_text_tokens": int(max_text_tokens), "dtype": "bfloat16",
        "vae_scaling_factor": float(vae_scaling_factor), "num_samples": num,
        "bytes_per_sample": round(total / num, 1) if num else 0.0,
        "shards": list(shards), "created_by": created_by or {}, **(extra or {}),
    }
    tmp = out / f".{INDEX}.part-{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out / INDEX)
    return index


class ShardWriter:
    """Append samples; every ``samples_per_shard`` a shard is written. ``close()`` writes
    the last partial shard, null_caption.safetensors and index.json, and returns the index."""

    def __init__(self, out_dir: str | Path, *, latent_shape: Sequence[int], text_dim: int,
                 max_text_tokens: int, vae_scaling_factor: float, null_caption: torch.Tensor,
                 samples_per_shard: int = 1000, created_by: dict[str, Any] | None = None) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard: must be >= 1, got {samples_per_shard}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.latent_shape = tuple(int(x) for x in latent_shape)
        self.text_dim, self.max_text_tokens = int(text_dim), int(max_text_tokens)
        self.vae_scaling_factor = float(vae_scaling_factor)
        self.null_caption = null_caption
        self.samples_per_shard = samples_per_shard
        self.created_by = created_by or {"tool": "training.data.ShardWriter"}
        self.shards: list[dict[str, Any]] = []
        self._pending: list[tuple[str, bytes]] = []
        self._keys: set[str] = set()

    def add(self, key: str, latents: torch.Tensor, text: torch.Tensor) -> None:
        """Add one sample: ``latents`` [C,H,W] (unscaled), ``text`` [n_real, D] with
        1 <= n_real <= max_text_tokens (real tokens only, no padding)."""
        if tuple(latents.shape) != self.latent_shape:
            raise ValueError(f"{key}: latents shape {list(latents.shape)} != {list(self.latent_shape)}")
        if text.ndim != 2 or text.shape[1] != self.text_dim or not 1 <= text.shape[0] <= self.max_text_tokens:
            raise ValueError(f"{key}: text shape {list(text.shape)} is not [1..{self.max_text_tokens}, "
                             f"{self.text_dim}]")
        if key in self._keys or "/" in key or not key:
            raise ValueError(f"{key!r}: sample keys must be unique, non-empty and without '/'")
        self._keys.add(key)
        self._pending.append((key, encode_sample(latents, text)))
        if len(self._pending) >= self.samples_per_shard:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self.shards.append(write_shard(self.out_dir / shard_name(len(self.shards)), self._pending))
            self._pending = []

    def close(self) -> dict[str, Any]:
        self._flush()
        return write_index(self.out_dir, shards=self.shards, latent_shape=self.latent_shape,
                           text_dim=self.text_dim, max_text_tokens=self.max_text_tokens,
                           vae_scaling_factor=self.vae_scaling_factor, null_caption=self.null_caption,
                           created_by=self.created_by)


def write_synthetic_features(out_dir: str | Path, *, num_samples: int, latent_shape: Sequence[int] = (4, 8, 8),
                             text_dim: int = 32, max_text_tokens: int = 16,
                             text_tokens: tuple[int, int] = (1, 16), seed: int = 0,
                             samples_per_shard: int = 64, vae_scaling_factor: float = 0.41407
                             ) -> dict[str, Any]:
    """Random features in the real format (tests, the loader benchmark).

    Sample ``i`` has key ``f"{i:08d}"`` and ``latents.flatten()[0] == i`` (exact in bf16
    for i <= 256, so tests can tell which samples a batch holds); ``text_tokens`` is the
    inclusive (min, max) real token count per sample.
    """
    gen = torch.Generator().manual_seed(seed)
    lo, hi = text_tokens
    hi = min(hi, max_text_tokens)
    null = torch.randn(1, text_dim, generator=gen)
    writer = ShardWriter(out_dir, latent_shape=latent_shape, text_dim=text_dim,
                         max_text_tokens=max_text_tokens, vae_scaling_factor=vae_scaling_factor,
                         null_caption=null, samples_per_shard=samples_per_shard,
                         created_by={"tool": "training.data.write_synthetic_features", "seed": seed})
    for i in range(num_samples):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        latents = torch.randn(*latent_shape, generator=gen, dtype=_DTYPE)  # bf16 directly: the cast is slow here
        latents.view(-1)[0] = float(i)
        writer.add(f"{i:08d}", latents, torch.randn(n, text_dim, generator=gen, dtype=_DTYPE))
    return writer.close()


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    bytes: int
    sha256: str


@dataclass
class FeatureIndex:
    """index.json of a feature directory, plus where the directory is."""

    source: str
    latent_shape: tuple[int, ...]
    text_dim: int
    max_text_tokens: int
    vae_scaling_factor: float
    num_samples: int
    bytes_per_sample: float
    shards: list[ShardInfo]
    raw: dict[str, Any] = field(repr=False)
    endpoint_url: str | None = None

    @property
    def is_s3(self) -> bool:
        return s3.is_s3_url(self.source)

    @classmethod
    def load(cls, source: str | os.PathLike[str], endpoint_url: str | None = None) -> FeatureIndex:
        """Read and validate ``<source>/index.json``. Missing directory, bucket or index is
        a one-line UserError that says what to run or fix."""
        source = str(source)
        if not source:
            raise UserError("data.path: not set; point it at a feature directory written by "
                            "python -m training.precompute (local, /fsx/... or s3://...)")
        if s3.is_s3_url(source):
            url = s3.parse_s3_url(source.rstrip("/"))
            try:
                text = s3.get_bytes(url.join(INDEX), s3=s3.client(endpoint_url)).decode()
            except UserError as exc:
                raise UserError(f"{source}: cannot read {INDEX} ({exc}); run python -m "
                                "training.precompute --out to that prefix or fix data.path") from None
        else:
            path = Path(source) / INDEX
            if not path.is_file():
                what = "directory does not exist" if not Path(source).exists() else f"no {INDEX} in it"
                raise UserError(f"{source}: {what}; run python -m training.precompute --out {source} "
                                "or fix data.path")
            text = path.read_text()
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT!r}")
            shards = [ShardInfo(s["name"], int(s["samples"]), int(s["bytes"]), s["sha256"]) for s in raw["shards"]]
            index = cls(source=source.rstrip("/"), latent_shape=tuple(int(x) for x in raw["latent_shape"]),
                        text_dim=int(raw["text_dim"]), max_text_tokens=int(raw["max_text_tokens"]),
                        vae_scaling_factor=float(raw["vae_scaling_factor"]), num_samples=int(raw["num_samples"]),
                        bytes_per_sample=float(raw["bytes_per_sample"]), shards=shards, raw=raw,
                        endpoint_url=endpoint_url)
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{source}/{INDEX}: not a valid feature index ({exc}); re-run precompute") from None
        if raw.get("dtype") != "bfloat16":
            raise UserError(f"{source}/{INDEX}: dtype {raw.get('dtype')!r} unsupported; expected bfloat16")
        if index.num_samples != sum(s.samples for s in shards) or index.num_samples < 1:
            raise UserError(f"{source}/{INDEX}: num_samples {index.num_samples} does not match the shards "
                            f"({sum(s.samples for s in shards)}); re-run the precompute merge step")
        return index

    @property
    def text_conditioning(self) -> TextConditioning:
        """How the captions were encoded; ``chi == "unknown"`` for indexes that do not say."""
        return TextConditioning.from_index(self.raw)

    @property
    def validation_prompts(self) -> list[str]:
        """Prompts precompute encoded into VALIDATION_PROMPTS ([] if none / older index)."""
        validation = self.raw.get("validation") or {}
        return list(validation.get("prompts") or []) if validation.get("file") else []

    def summary(self) -> str:
        c, h, w = self.latent_shape
        return (f"{self.source}: {self.num_samples} samples in {len(self.shards)} shards, latents "
                f"{c}x{h}x{w}, text <= {self.max_text_tokens} x {self.text_dim}, "
                f"{self.bytes_per_sample / 1024:.1f} KiB/sample ({self.bytes_per_sample:.0f} bytes)")

    # -- files -------------------------------------------------------------
    def default_cache_dir(self) -> Path:
        url = s3.parse_s3_url(self.source)
        root = Path(os.environ.get("SANA_CACHE_DIR", Path.home() / ".cache" / "sana"))
        return root / "features" / url.bucket / url.key

    def fetch(self, name: str, cache_dir: str | Path | None = None, verify_sha: str | None = None) -> Path:
        """Local path of file ``name`` of this directory. For s3:// it is downloaded into the
        cache first (kept if its sha256 matches); a file lock makes the ranks of a node that
        share the cache download it once."""
        if not self.is_s3:
            return Path(self.source) / name
        target = Path(cache_dir or self.default_cache_dir()) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(f".{name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if target.exists() and (verify_sha is None or _sha256(target) == verify_sha):
                return target
            url = s3.parse_s3_url(self.source).join(name)
            s3.download_file(url, target, s3=s3.client(self.endpoint_url))
            if verify_sha is not None and (digest := _sha256(target)) != verify_sha:
                raise _corrupt(str(url), f"sha256 {digest[:12]}... != index {verify_sha[:12]}...")
        return target


def _corrupt(shard: str, what: str) -> UserError:
    return UserError(f"{shard}: corrupt feature shard ({what}); re-run python -m training.precompute "
                     "for it (delete the shard and its .json marker) or restore it from S3")


class _Shard:
    """One open shard: mmap + (offset, size) of every member's data."""

    def __init__(self, path: Path, info: ShardInfo, verify: bool) -> None:
        self.label = str(path)
        if not path.is_file():
            raise UserError(f"{path}: shard listed in {INDEX} is missing; restore it or re-run precompute")
        if verify:
            digest = _sha256(path)
            if digest != info.sha256:
                raise _corrupt(self.label, f"sha256 {digest[:12]}... != index {info.sha256[:12]}...")
        self.members: list[tuple[str, int, int]] = []
        try:
            with tarfile.open(path, mode="r:") as tar:
                for m in tar:
                    if m.isfile():
                        self.members.append((m.name, m.offset_data, m.size))
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise _corrupt(self.label, f"bad tar: {exc}") from None
        if len(self.members) != info.samples:
            raise _corrupt(self.label, f"{len(self.members)} samples, index says {info.samples}")
        self.path = path

    def map(self) -> mmap.mmap:
        with open(self.path, "rb") as f:
            # ACCESS_COPY: a private writable view, so torch.frombuffer needs no copy and
            # does not warn about read-only memory; nothing is ever written back.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


class _Decoder:
    """Reads samples straight out of the mmapped tars into batch tensors (one bf16->fp32 copy)."""

    def __init__(self, index: FeatureIndex, cache_dir: str | Path | None, verify: bool) -> None:
        self.index, self.cache_dir, self.verify = index, cache_dir, verify
        self.starts = [0]
        for s in index.shards:
            self.starts.append(self.starts[-1] + s.samples)
        self._open: dict[int, _Shard] = {}
        self._locks = [threading.Lock() for _ in index.shards]
        # NOTE: each mmap keeps a dup of its file descriptor (CPython < 3.13), so only the
        # most recently used shards stay mapped: thousands of shards would exhaust
        # `ulimit -n`. Reopening keeps the parsed member table; on Lustre it is one open.
        self._maps: collections.OrderedDict[int, mmap.mmap] = collections.OrderedDict()
        self._maps_lock = threading.Lock()

    def mapped(self, i: int) -> mmap.mmap:
        with self._maps_lock:
            mm = self._maps.get(i)
            if mm is None:
                mm = self._maps[i] = self.shard(i).map()
                if len(self._maps) > MAX_MAPPED_SHARDS:
                    self._maps.popitem(last=False)  # closed once no tensor views it any more
            else:
                self._maps.move_to_end(i)
            return mm

    def shard(self, i: int) -> _Shard:
        opened = self._open.get(i)
        if opened is None:
            with self._locks[i]:  # per shard: prefetch_all opens many at once
                opened = self._open.get(i)
                if opened is None:
                    info = self.index.shards[i]
                    sha = info.sha256 if self.verify else None
                    path = self.index.fetch(info.name, self.cache_dir, verify_sha=sha)
                    # fetch already checked a downloaded shard; a local one is checked here
                    opened = self._open[i] = _Shard(path, info, self.verify and not self.index.is_s3)
        return opened

    def prefetch_all(self, workers: int = 8) -> None:
        """Download (s3) / verify every shard now, in parallel, so training never waits on it."""
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(self.shard, range(len(self.index.shards))))

    def _tensors(self, shard: _Shard, mm: mmap.mmap, member: int) -> dict[str, torch.Tensor]:
        name, off, size = shard.members[member]
        try:
            hlen = int.from_bytes(mm[off:off + 8], "little")
            header = json.loads(bytes(mm[off + 8:off + 8 + hlen]))
            base = off + 8 + hlen
            out = {}
            for key in ("latents", "text"):
                meta = header[key]
                begin, end = meta["data_offsets"]
                dtype = _ST_DTYPES[meta["dtype"]]
                if base + end > off + size:
                    raise ValueError("tensor data runs past the member")
                count = (end - begin) // dtype.itemsize
                out[key] = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + begin).view(meta["shape"])
            return out
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise _corrupt(shard.label, f"member {name}: {exc}") from None

    def empty_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        ix = self.index
        return {"latents": torch.empty((batch_size, *ix.latent_shape), dtype=torch.float32),
                "text": torch.empty((batch_size, ix.max_text_tokens, ix.text_dim), dtype=torch.float32),
                "text_mask": torch.empty((batch_size, ix.max_text_tokens), dtype=torch.int64)}

    def batch(self, indices: Sequence[int], out: dict[str, torch.Tensor] | None = None,
              filled: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Collate the samples ``indices`` into ``out`` or new tensors.

        ``filled``: for a reused ``out`` whose text padding is known to be zero beyond
        ``filled[row]`` rows (what the previous call wrote, untouched since), only rows
        ``[n, filled[row])`` are zeroed; padding is ~75% of a 300-token batch, so this
        halves the memory traffic. Updated in place. None: every padding row is zeroed.
        """
        ix = self.index
        n_max, dim = ix.max_text_tokens, ix.text_dim
        out = self.empty_batch(len(indices)) if out is None else out
        latents, text, mask = out["latents"], out["text"], out["text_mask"]
        for row, g in enumerate(indices):
            s = bisect.bisect_right(self.starts, g) - 1
            shard = self.shard(s)
            t = self._tensors(shard, self.mapped(s), g - self.starts[s])
            lat, txt = t["latents"], t["text"]
            if tuple(lat.shape) != ix.latent_shape:
                raise _corrupt(shard.label, f"member {shard.members[g - self.starts[s]][0]}: latents shape "
                                            f"{list(lat.shape)}, index says {list(ix.latent_shape)}")
            n = txt.shape[0] if txt.ndim == 2 else -1
            if txt.ndim != 2 or txt.shape[1] != dim or not 1 <= n <= n_max:
                raise _corrupt(shard.label, f"member {shard.members[g - self.starts[s]][0]}: text shape "
                                            f"{list(txt.shape)}, expected [1..{n_max}, {dim}]")
            latents[row].copy_(lat)
            text[row, :n].copy_(txt)
            if filled is None:
                text[row, n:].zero_()
            else:
                if filled[row] > n:
                    text[row, n:filled[row]].zero_()
                filled[row] = n
            mask[row, :n] = 1
            mask[row, n:] = 0
        return {"latents": latents, "text": text, "text_mask": mask}


def _storage_refs(t: torch.Tensor) -> int:
    # NOTE: private API (present since torch 1.x); without it buffers are simply never reused.
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return use_count(t.untyped_storage()._cdata) if use_count else 1 << 30


class _BufferPool:
    """Batch tensors recycled once nobody else holds them.

    Why: a [32, 300, 2304] float32 text batch is 88 MB; glibc serves that with a fresh
    mmap, and first-touch page faults made collate ~7x slower than writing into memory
    already mapped (measured: 150 ms vs 20 ms per batch). The pool keeps the base tensors
    and hands out views; a buffer is reused only when no view of its storage is alive
    (the consumer's batch, a queued batch, a slice, a tensor autograd saved: all count),
    so a consumer that keeps a batch keeps it intact.
    """

    def __init__(self, make, capacity: int) -> None:
        self.make, self.capacity = make, capacity
        self.items: list[_Buffers] = []
        self.base = _storage_refs(torch.empty(1))  # refs of a storage only its own tensor holds

    def get(self) -> _Buffers:
        for item in self.items:
            if all(_storage_refs(t) == self.base for t in item.tensors.values()):
                return item
        item = _Buffers(self.make())
        if len(self.items) < self.capacity:
            self.items.append(item)
        return item


class _Buffers:
    """One batch's tensors plus what is known about their contents.

    ``filled[row]``: text rows of that row that may be non-zero; valid only while the
    tensors' version counters are the ones recorded after the last fill (views share the
    counter, so any in-place write by the consumer, e.g. caption dropout, invalidates it).
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.filled: list[int] | None = None
        self.versions: list[int] = []

    def clean_fill(self) -> list[int] | None:
        same = [t._version for t in self.tensors.values()] == self.versions
        return self.filled if same else None

    def done(self, filled: list[int]) -> dict[str, torch.Tensor]:
        self.filled, self.versions = filled, [t._version for t in self.tensors.values()]
        return {k: t.view(t.shape) for k, t in self.tensors.items()}


class _Reader:
    """Order + collate for one rank, shared by the caller's thread and the prefetch thread.

    Holds no reference to the FeatureLoader, so a loader dropped without ``close()`` is
    still collected and its ``__del__`` stops the thread.
    """

    def __init__(self, decoder: _Decoder, *, batch_size: int, rank: int, world_size: int, seed: int,
                 pool_size: int) -> None:
        self.decoder, self.batch_size, self.rank, self.seed = decoder, batch_size, rank, seed
        self.num_samples = decoder.index.num_samples
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = self.num_samples // self.global_batch
        self.pool_size = pool_size
        self._perm: tuple[int, torch.Tensor] = (-1, torch.empty(0))
        self._pool: _BufferPool | None = None

    def permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def indices(self, epoch: int, step: int, perm: torch.Tensor | None = None) -> list[int]:
        perm = self.permutation(epoch) if perm is None else perm
        start = step * self.global_batch + self.rank * self.batch_size
        return perm[start:start + self.batch_size].tolist()

    def load(self, epoch: int, step: int) -> dict[str, torch.Tensor]:
        if self._perm[0] != epoch:
            self._perm = (epoch, self.permutation(epoch))
        if self._pool is None:
            self._pool = _BufferPool(lambda: self.decoder.empty_batch(self.batch_size), self.pool_size)
        buffers = self._pool.get()
        filled = buffers.clean_fill()
        filled = list(filled) if filled is not None else None
        self.decoder.batch(self.indices(epoch, step, self._perm[1]), out=buffers.tensors, filled=filled)
        if filled is None:  # a full fill: every row's padding is now zero
            filled = [int(n) for n in buffers.tensors["text_mask"].sum(1).tolist()]
        return buffers.done(filled)

    def next_position(self, epoch: int, step: int) -> tuple[int, int]:
        step += 1
        return (epoch + 1, 0) if step == self.steps_per_epoch else (epoch, step)


def _produce(reader: _Reader, epoch: int, step: int, stop: threading.Event, out: queue.Queue) -> None:
    """Prefetch thread: batches from (epoch, step) on into ``out`` until ``stop``."""
    # One core for collate: the copies are memory-bound, and an OpenMP team spinning
    # beside the training step's own costs more than it gains (per-thread setting).
    torch.set_num_threads(1)

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        while put(((epoch, step), reader.load(epoch, step))):
            epoch, step = reader.next_position(epoch, step)
    except BaseException as exc:  # handed to the consumer, raised there with the shard's name
        put(exc)


class FeatureLoader:
    """Infinite iterator of static-shape batches for one rank; see the module docstring.

    Yields ``{"latents": f32 [B,C,H,W] (unscaled), "text": f32 [B,N,D] zero-padded,
    "text_mask": i64 [B,N]}``. ``state_dict()`` is the position after the last batch
    *returned* (prefetched batches do not count), so a restored loader continues exactly.
    Call ``close()`` (or use it as a context manager) to stop the prefetch thread.
    """

    def __init__(self, source: str | os.PathLike[str] | FeatureIndex, *, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, cache_dir: str | Path | None = None,
                 prefetch: int = 4, verify: bool = True, endpoint_url: str | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.index = source if isinstance(source, FeatureIndex) else FeatureIndex.load(source, endpoint_url)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.global_batch = batch_size * world_size
        self.steps_per_epoch = self.index.num_samples // self.global_batch
        if self.steps_per_epoch < 1:
            raise UserError(f"{self.index.source}: {self.index.num_samples} samples is less than one global "
                            f"batch ({batch_size} x {world_size} ranks); lower data.batch_size or add data")
        self.prefetch = prefetch
        self._decoder = _Decoder(self.index, cache_dir, verify)
        if self.index.is_s3:
            self._decoder.prefetch_all()
        self._reader = _Reader(self._decoder, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed,
                               pool_size=prefetch + 4)
        self.epoch, self.step = 0, 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    @classmethod
    def from_config(cls, cfg: DataConfig, *, rank: int = 0, world_size: int = 1) -> FeatureLoader:
        return cls(cfg.path, batch_size=cfg.batch_size, rank=rank, world_size=world_size, seed=cfg.seed,
                   cache_dir=cfg.cache_dir, prefetch=cfg.prefetch, verify=cfg.verify)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's order of all samples: a function of (seed, epoch) only."""
        return self._reader.permutation(epoch)

    def indices(self, epoch: int, step: int) -> list[int]:
        """Global sample indices of this rank's slice of (epoch, step)."""
        return self._reader.indices(epoch, step)

    # -- iteration -----------------------------------------------------------
    def __iter__(self) -> FeatureLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.prefetch == 0:
            batch = self._reader.load(self.epoch, self.step)
        else:
            if self._thread is None:
                self._stop = threading.Event()
                self._queue = queue.Queue(maxsize=self.prefetch)
                self._thread = threading.Thread(target=_produce, name="feature-loader", daemon=True,
                                                args=(self._reader, self.epoch, self.step, self._stop, self._queue))
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                self.close()
                raise item
            (epoch, step), batch = item
            assert (epoch, step) == (self.epoch, self.step), "prefetch thread out of step"
        self.epoch, self.step = self._reader.next_position(self.epoch, self.step)
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (iterating again restarts it at the current position)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None

    def __enter__(self) -> FeatureLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "num_samples": self.index.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. A different global batch size resumes at the
        same sample offset rounded down to a whole step; another dataset or seed is an error."""
        if state.get("num_samples") != self.index.num_samples or state.get("seed") != self.seed:
            raise UserError(f"{self.index.source}: checkpoint data position is for num_samples="
                            f"{state.get('num_samples')} seed={state.get('seed')}, this data has "
                            f"{self.index.num_samples} samples and seed {self.seed}; use the same data and "
                            "data.seed, or start fresh with --resume none")
        self.close()
        epoch, step = int(state["epoch"]), int(state["step"])
        if int(state["global_batch"]) != self.global_batch:
            step = step * int(state["global_batch"]) // self.global_batch
        self.epoch, self.step = epoch + step // self.steps_per_epoch, step % self.steps_per_epoch

    def fetch(self, name: str) -> Path:
        """Local path of a file of the feature directory (downloaded into data.cache_dir for s3://)."""
        return self.index.fetch(name, self._decoder.cache_dir)

    # -- CFG -----------------------------------------------------------------
    def null_caption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty-caption embedding padded to ``[N, D]`` float32 and its mask ``[N]`` int64."""
        path = self.index.fetch(NULL_CAPTION, self._decoder.cache_dir)
        try:
            text = st_load(path.read_bytes())["text"]
        except FileNotFoundError:
            raise UserError(f"{self.index.source}/{NULL_CAPTION}: missing; re-run the precompute merge step") from None
        except Exception as exc:
            raise _corrupt(str(path), str(exc)) from None
        n_max, dim = self.index.max_text_tokens, self.index.text_dim
        n = text.shape[0]
        if text.ndim != 2 or text.shape[1] != dim or not 1 <= n <= n_max:
            raise _corrupt(str(path), f"text shape {list(text.shape)}, expected [1..{n_max}, {dim}]")
        padded = torch.zeros(n_max, dim)
        padded[:n] = text.float()
        mask = torch.zeros(n_max, dtype=torch.int64)
        mask[:n] = 1
        return padded, mask


# ---------------------------------------------------------------------------- CLI
SANA_600M_512 = {"latent_shape": (32, 16, 16), "text_dim": 2304, "max_text_tokens": 300, "text_tokens": (20, 120)}


def bench(source: str | Path, *, batch_size: int = 32, seconds: float = 10.0, prefetch: int = 4,
          windows: int = 5) -> dict[str, float]:
    """Samples/s one loader process delivers to a consumer that only takes batches.

    The first batches (shard open + sha256) are excluded. The run is cut into ``windows``
    equal windows: ``samples_per_s`` is the whole run, ``best_window`` what the loader
    manages when the shared cores are not taken by others (timeit's min-of-repeats logic).
    """
    loader = FeatureLoader(source, batch_size=batch_size, prefetch=prefetch)
    try:
        for _ in range(max(1, prefetch)):
            next(loader)
        rates, total, t_start = [], 0, time.perf_counter()
        for _ in range(windows):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / windows:
                n += next(loader)["latents"].shape[0]
            rates.append(n / (time.perf_counter() - t0))
            total += n
        elapsed = time.perf_counter() - t_start
    finally:
        loader.close()
    return {"samples_per_s": total / elapsed, "best_window": max(rates), "samples": total, "seconds": elapsed,
            "bytes_per_sample": loader.index.bytes_per_sample}


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.data", description=__doc__.split("\n")[0])
    p.add_argument("--info", metavar="SOURCE", help="print the index summary (bytes per sample) of a feature dir")
    p.add_argument("--bench", metavar="DIR", help="loader benchmark on sana-600m-512-shaped synthetic features "
                                                  "in DIR (written there first if DIR has no index.json)")
    p.add_argument("--samples", type=int, default=2048, help="samples to write for --bench")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--prefetch", type=int, default=4)
    args = p.parse_args(argv)
    if args.info:
        index = FeatureIndex.load(args.info)
        print(index.summary())
        if not index.is_s3:  # on FSx: have all shards been imported from S3 yet?
            missing = [s.name for s in index.shards if not (Path(index.source) / s.name).is_file()]
            if missing:
                raise UserError(f"{index.source}: {len(missing)} of {len(index.shards)} shards not present yet "
                                f"(first: {missing[0]}); wait for the FSx import or re-run precompute")
            print(f"all {len(index.shards)} shards present")
    if args.bench:
        if not (Path(args.bench) / INDEX).exists():
            t0 = time.perf_counter()
            write_synthetic_features(args.bench, num_samples=args.samples, samples_per_shard=512, **SANA_600M_512)
            print(f"wrote {args.samples} synthetic samples in {time.perf_counter() - t0:.1f} s", flush=True)
        print(FeatureIndex.load(args.bench).summary(), flush=True)
        r = bench(args.bench, batch_size=args.batch_size, seconds=args.seconds, prefetch=args.prefetch)
        print(f"loader: {r['samples_per_s']:.0f} samples/s (best window {r['best_window']:.0f}; {r['samples']} "
              f"samples in {r['seconds']:.1f} s, batch {args.batch_size}, prefetch {args.prefetch}), "
              f"{r['bytes_per_sample']:.0f} bytes/sample")
    if not (args.info or args.bench):
        p.error("give --info SOURCE or --bench DIR")


if __name__ == "__main__":
    main(sys.argv[1:])
