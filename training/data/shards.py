"""Writing feature shards and index.json (the format is described in training/data/__init__.py)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

FORMAT = "sana-features/1"
INDEX = "index.json"
NULL_CAPTION = "null_caption.safetensors"
VALIDATION_PROMPTS = "validation_prompts.safetensors"
_DTYPE = torch.bfloat16


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


def bucket_runs(buckets: Sequence[str]) -> list[list[Any]]:
    """Per-member bucket names -> ``[[name, count], ...]`` runs in member order (what a
    shard's index entry stores: one bucket per sample without a list entry per sample)."""
    runs: list[list[Any]] = []
    for name in buckets:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return runs


def write_shard(path: Path, samples: Sequence[tuple[str, bytes]],
                buckets: Sequence[str] | None = None) -> dict[str, Any]:
    """Write ``(key, encode_sample(...))`` pairs as one tar through a temp name; returns its
    index entry. The rename makes a shard either complete or absent (precompute resume).

    ``buckets``: each sample's bucket name, in the same order. The samples are stored
    grouped by bucket (stable: first appearance order) so the entry's ``buckets`` runs
    stay as short as the number of buckets in the shard."""
    path = Path(path)
    if buckets is not None:
        if len(buckets) != len(samples):
            raise ValueError(f"buckets: {len(buckets)} names for {len(samples)} samples")
        first = {name: i for i, name in reversed(list(enumerate(buckets)))}
        order = sorted(range(len(samples)), key=lambda i: first[buckets[i]])
        samples, buckets = [samples[i] for i in order], [buckets[i] for i in order]
    tmp = part_name(path)
    try:
        with open(tmp, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, payload in samples:
                info = tarfile.TarInfo(f"{key}.safetensors")
                info.size, info.mode, info.mtime = len(payload), 0o644, 0  # mtime 0: reproducible bytes
                tar.addfile(info, io.BytesIO(payload))
        os.replace(tmp, path)
    except BaseException as exc:  # a full disk (ENOSPC, EFBIG) or an interrupt: no stray part file
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)  # a failed write(2) names no file: say which one
        raise
    entry = {"name": path.name, "samples": len(samples), "bytes": path.stat().st_size, "sha256": _sha256(path)}
    if buckets is not None:
        entry["buckets"] = bucket_runs(buckets)
    return entry


def bucket_order(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The fixed order of buckets everywhere (index, loader, precompile): by aspect ratio
    h/w of the latents, then name."""
    return sorted(shapes, key=lambda n: (shapes[n][1] / shapes[n][2], n))


def write_index(out_dir: str | Path, *, shards: Sequence[dict[str, Any]], latent_shape: Sequence[int] | None = None,
                text_dim: int, max_text_tokens: int, vae_scaling_factor: float,
                null_caption: torch.Tensor | None = None, null_mask: torch.Tensor | None = None,
                created_by: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                bucket_shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Write index.json (last: it is what makes the directory readable) and, if given,
    null_caption.safetensors: ``{"text": [N, D], "mask": [N]}`` with ``null_mask`` (the
    empty caption's full encoding, what Sana's dropout swaps in: training/objective.py), or
    ``{"text": [n, D]}`` (its real rows only, the older format the loader still reads).
    ``extra``: further top-level keys (``text_conditioning``, ``validation``). Every file goes
    through a temp name and a rename, so a full disk leaves the previous file or none.
    Returns the index dict.

    ``bucket_shapes`` (bucket mode): name -> latent shape of every bucket the shards' runs
    name; the index gets ``buckets`` {name: {latent_shape, samples}} for the non-empty ones,
    and ``latent_shape`` is that of the most populous bucket (what single-shape readers,
    e.g. validation images, use)."""
    out = Path(out_dir)
    if null_caption is not None:
        if null_caption.ndim != 2 or null_caption.shape[1] != text_dim:
            raise ValueError(f"null_caption: expected [n, {text_dim}], got {list(null_caption.shape)}")
        payload = {"text": null_caption.detach().to("cpu", _DTYPE).contiguous()}
        if null_mask is not None:
            if null_caption.shape[0] != max_text_tokens or tuple(null_mask.shape) != (max_text_tokens,):
                raise ValueError(f"null_caption: with a mask, expected [{max_text_tokens}, {text_dim}] and "
                                 f"[{max_text_tokens}], got {list(null_caption.shape)} and {list(null_mask.shape)}")
            payload["mask"] = null_mask.detach().to("cpu", torch.int64).contiguous()
        atomic_write_bytes(out / NULL_CAPTION, st_save(payload))
    shards = sorted(shards, key=lambda s: s["name"])
    num = sum(s["samples"] for s in shards)
    total = sum(s["bytes"] for s in shards)
    buckets: dict[str, dict[str, Any]] | None = None
    if bucket_shapes is not None:
        counts: dict[str, int] = {}
        for s in shards:
            for name, n in s.get("buckets") or []:
                if name not in bucket_shapes:
                    raise ValueError(f"{s['name']}: bucket {name!r} has no shape in bucket_shapes")
                counts[name] = counts.get(name, 0) + int(n)
        buckets = {n: {"latent_shape": [int(x) for x in bucket_shapes[n]], "samples": counts[n]}
                   for n in bucket_order({k: bucket_shapes[k] for k in counts})}
        if buckets:
            latent_shape = max(buckets.values(), key=lambda b: b["samples"])["latent_shape"]
    if latent_shape is None:
        raise ValueError("write_index: latent_shape is required without non-empty buckets")
    index = {
        "format": FORMAT, "latent_shape": [int(x) for x in latent_shape], "text_dim": int(text_dim),
        "max_text_tokens": int(max_text_tokens), "dtype": "bfloat16",
        "vae_scaling_factor": float(vae_scaling_factor), "num_samples": num,
        "bytes_per_sample": round(total / num, 1) if num else 0.0,
        "shards": list(shards), "created_by": created_by or {}, **(extra or {}),
    }
    if buckets is not None:
        index["buckets"] = buckets
    atomic_write_bytes(out / INDEX, json.dumps(index, indent=1).encode())
    return index


def part_name(path: Path) -> Path:
    """The temp name ``path`` is written through (``.NAME.part-PID``, same directory)."""
    return path.with_name(f".{path.name}.part-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through ``part_name(path)`` and a rename; on any error
    (ENOSPC, EFBIG, EDQUOT...) the part file is removed and the error re-raised, so the
    directory holds the old file or the new one, never a half-written or stray one."""
    tmp = part_name(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)
        raise


class ShardWriter:
    """Append samples; every ``samples_per_shard`` a shard is written. ``close()`` writes
    the last partial shard, null_caption.safetensors and index.json, and returns the index.

    Square mode: every sample has ``latent_shape``. Bucket mode (``buckets`` given: name ->
    latent shape): each ``add`` names its bucket and the latents must have its shape."""

    def __init__(self, out_dir: str | Path, *, latent_shape: Sequence[int] | None = None, text_dim: int,
                 max_text_tokens: int, vae_scaling_factor: float, null_caption: torch.Tensor,
                 null_mask: torch.Tensor | None = None, samples_per_shard: int = 1000,
                 created_by: dict[str, Any] | None = None,
                 buckets: Mapping[str, Sequence[int]] | None = None) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard: must be >= 1, got {samples_per_shard}")
        if (latent_shape is None) == (buckets is None):
            raise ValueError("ShardWriter: give exactly one of latent_shape (square) or buckets")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.buckets = None if buckets is None else {n: tuple(int(x) for x in s) for n, s in buckets.items()}
        self.latent_shape = tuple(int(x) for x in latent_shape) if latent_shape is not None else None
        self.text_dim, self.max_text_tokens = int(text_dim), int(max_text_tokens)
        self.vae_scaling_factor = float(vae_scaling_factor)
        self.null_caption, self.null_mask = null_caption, null_mask
        self.samples_per_shard = samples_per_shard
        self.created_by = created_by or {"tool": "training.data.ShardWriter"}
        self.shards: list[dict[str, Any]] = []
        self._pending: list[tuple[str, bytes]] = []
        self._pending_buckets: list[str] = []
        self._keys: set[str] = set()

    def add(self, key: str, latents: torch.Tensor, text: torch.Tensor, bucket: str | None = None) -> None:
        """Add one sample: ``latents`` [C,H,W] (unscaled), ``text`` [n_real, D] with
        1 <= n_real <= max_text_tokens (real tokens only, no padding)."""
        if self.buckets is not None:
            if bucket not in self.buckets:
                raise ValueError(f"{key}: bucket {bucket!r} is not one of {sorted(self.buckets)}")
            expected = self.buckets[bucket]
        else:
            expected = self.latent_shape
        if tuple(latents.shape) != expected:
            raise ValueError(f"{key}: latents shape {list(latents.shape)} != {list(expected)}")
        if text.ndim != 2 or text.shape[1] != self.text_dim or not 1 <= text.shape[0] <= self.max_text_tokens:
            raise ValueError(f"{key}: text shape {list(text.shape)} is not [1..{self.max_text_tokens}, "
                             f"{self.text_dim}]")
        if key in self._keys or "/" in key or not key:
            raise ValueError(f"{key!r}: sample keys must be unique, non-empty and without '/'")
        self._keys.add(key)
        self._pending.append((key, encode_sample(latents, text)))
        self._pending_buckets.append(bucket or "")
        if len(self._pending) >= self.samples_per_shard:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            names = self._pending_buckets if self.buckets is not None else None
            self.shards.append(write_shard(self.out_dir / shard_name(len(self.shards)), self._pending, names))
            self._pending, self._pending_buckets = [], []

    def close(self) -> dict[str, Any]:
        self._flush()
        return write_index(self.out_dir, shards=self.shards, latent_shape=self.latent_shape,
                           text_dim=self.text_dim, max_text_tokens=self.max_text_tokens,
                           vae_scaling_factor=self.vae_scaling_factor, null_caption=self.null_caption,
                           null_mask=self.null_mask, created_by=self.created_by, bucket_shapes=self.buckets)


def write_synthetic_features(out_dir: str | Path, *, num_samples: int, latent_shape: Sequence[int] = (4, 8, 8),
                             text_dim: int = 32, max_text_tokens: int = 16,
                             text_tokens: tuple[int, int] = (1, 16), seed: int = 0,
                             samples_per_shard: int = 64, vae_scaling_factor: float = 0.41407,
                             buckets: Mapping[str, Sequence[int]] | None = None,
                             bucket_weights: Sequence[float] | None = None,
                             text_lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """Random features in the real format (tests, the loader benchmark).

    Sample ``i`` has key ``f"{i:08d}"`` and ``latents.flatten()[0] == i`` (exact in bf16
    for i <= 256, so tests can tell which samples a batch holds); ``text_tokens`` is the
    inclusive (min, max) real token count per sample, or ``text_lengths`` a list each
    sample's count is drawn from (seeded; e.g. real captions' lengths,
    training/data/caption_lengths.py), clipped to ``max_text_tokens``.

    ``buckets`` (name -> latent shape) writes bucket mode instead of ``latent_shape``: sample
    ``i`` goes to a bucket drawn from the seeded generator with ``bucket_weights`` (default
    equal), so every bucket is spread over the shards as precompute's would be.
    """
    gen = torch.Generator().manual_seed(seed)
    lo, hi = text_tokens
    hi = min(hi, max_text_tokens)
    # The empty caption's full encoding (<bos> row + N-1 padding rows, as precompute stores it);
    # the padding rows from their own generator so the samples' stream is unchanged.
    null = torch.cat([torch.randn(1, text_dim, generator=gen),
                      torch.randn(max_text_tokens - 1, text_dim, generator=torch.Generator().manual_seed(seed + 1))])
    null_mask = torch.zeros(max_text_tokens, dtype=torch.int64)
    null_mask[0] = 1
    names = list(buckets) if buckets is not None else []
    weights = torch.tensor(bucket_weights if bucket_weights is not None else [1.0] * len(names), dtype=torch.float64)
    writer = ShardWriter(out_dir, latent_shape=None if buckets is not None else latent_shape, buckets=buckets,
                         text_dim=text_dim, max_text_tokens=max_text_tokens, vae_scaling_factor=vae_scaling_factor,
                         null_caption=null, null_mask=null_mask, samples_per_shard=samples_per_shard,
                         created_by={"tool": "training.data.write_synthetic_features", "seed": seed})
    for i in range(num_samples):
        bucket = names[int(torch.multinomial(weights, 1, generator=gen))] if names else None
        shape = buckets[bucket] if bucket is not None else latent_shape
        if text_lengths:
            n = min(max_text_tokens, int(text_lengths[int(torch.randint(len(text_lengths), (1,), generator=gen))]))
        else:
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        latents = torch.randn(*shape, generator=gen, dtype=_DTYPE)  # bf16 directly: the cast is slow here
        latents.view(-1)[0] = float(i)
        writer.add(f"{i:08d}", latents, torch.randn(n, text_dim, generator=gen, dtype=_DTYPE), bucket)
    return writer.close()
