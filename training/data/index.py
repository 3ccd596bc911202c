"""index.json: reading and validating a feature directory's index, and fetching its files."""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training import s3
from training.data.shards import FORMAT, INDEX, _sha256
from training.data.text_features import TextConditioning
from training.errors import UserError


@dataclass(frozen=True)
class ShardInfo:
    name: str
    samples: int
    bytes: int
    sha256: str
    #: bucket of each member as ``((name, count), ...)`` runs in member order; None: the
    #: shard is single-shape (square mode / an index without buckets)
    buckets: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True)
class Bucket:
    """One static latent shape of a feature directory and how many samples have it."""

    name: str
    latent_shape: tuple[int, ...]
    samples: int


#: the single bucket of an index without ``buckets`` (square mode, older directories)
SQUARE = "square"


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
    #: name -> Bucket in the fixed bucket order (shards.bucket_order); one ``SQUARE`` bucket
    #: of ``latent_shape`` when index.json has none. With buckets, ``latent_shape`` is the
    #: most populous bucket's (what single-shape readers such as validation images use).
    buckets: dict[str, Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.buckets:
            self.buckets = {SQUARE: Bucket(SQUARE, tuple(self.latent_shape), self.num_samples)}

    @property
    def bucketed(self) -> bool:
        """Whether index.json lists buckets (samples of several shapes)."""
        return "buckets" in self.raw

    def bucket_members(self) -> dict[str, torch.Tensor]:
        """Global sample indices (int64, ascending) of each bucket, from the shards' runs."""
        if not self.bucketed:
            return {SQUARE: torch.arange(self.num_samples)}
        spans: dict[str, list[torch.Tensor]] = {name: [] for name in self.buckets}
        start = 0
        for shard in self.shards:
            for name, count in shard.buckets or ():
                spans[name].append(torch.arange(start, start + count))
                start += count
        return {name: torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
                for name, parts in spans.items()}

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
            bucketed = "buckets" in raw
            shards = [ShardInfo(s["name"], int(s["samples"]), int(s["bytes"]), s["sha256"],
                                tuple((str(n), int(c)) for n, c in s["buckets"]) if bucketed else None)
                      for s in raw["shards"]]
            buckets = {str(n): Bucket(str(n), tuple(int(x) for x in b["latent_shape"]), int(b["samples"]))
                       for n, b in (raw.get("buckets") or {}).items()}
            index = cls(source=source.rstrip("/"), latent_shape=tuple(int(x) for x in raw["latent_shape"]),
                        text_dim=int(raw["text_dim"]), max_text_tokens=int(raw["max_text_tokens"]),
                        vae_scaling_factor=float(raw["vae_scaling_factor"]), num_samples=int(raw["num_samples"]),
                        bytes_per_sample=float(raw["bytes_per_sample"]), shards=shards, raw=raw,
                        endpoint_url=endpoint_url, buckets=buckets)
            if bucketed:
                _check_buckets(index)
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
        shapes = f"latents {c}x{h}x{w}"
        if self.bucketed:
            shapes = f"{len(self.buckets)} buckets (" + ", ".join(
                f"{b.name}: {b.samples} x {'x'.join(map(str, b.latent_shape))}" for b in self.buckets.values()) + ")"
        return (f"{self.source}: {self.num_samples} samples in {len(self.shards)} shards, {shapes}, "
                f"text <= {self.max_text_tokens} x {self.text_dim}, "
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


def _check_buckets(index: FeatureIndex) -> None:
    """Bucket counts and shard runs agree with the shards' sample counts (ValueError if not)."""
    counts = dict.fromkeys(index.buckets, 0)
    for shard in index.shards:
        runs = shard.buckets or ()
        if sum(c for _, c in runs) != shard.samples:
            raise ValueError(f"{shard.name}: bucket runs cover {sum(c for _, c in runs)} of {shard.samples} samples")
        for name, count in runs:
            if name not in counts:
                raise ValueError(f"{shard.name}: bucket {name!r} is not in buckets")
            counts[name] += count
    for name, bucket in index.buckets.items():
        if counts[name] != bucket.samples or len(bucket.latent_shape) != 3:
            raise ValueError(f"bucket {name!r}: {bucket.samples} samples listed, shards hold {counts[name]}")
