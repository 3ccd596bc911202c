"""Reading samples out of mmapped shard tars into reusable batch tensors."""

from __future__ import annotations

import bisect
import collections
import json
import mmap
import tarfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from training.data.index import FeatureIndex, ShardInfo, _corrupt
from training.data.shards import INDEX, _sha256
from training.errors import UserError

MAX_MAPPED_SHARDS = 128
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


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
    """Reads samples straight out of the mmapped tars into batch tensors (latents: one
    bf16->fp32 copy; captions: into ``text_dtype``, fp32 or the stored bf16)."""

    def __init__(self, index: FeatureIndex, cache_dir: str | Path | None, verify: bool,
                 text_dtype: torch.dtype = torch.float32) -> None:
        self.index, self.cache_dir, self.verify = index, cache_dir, verify
        self.text_dtype = text_dtype
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

    def empty_batch(self, batch_size: int, latent_shape: Sequence[int] | None = None,
                    pin_memory: bool = False) -> dict[str, torch.Tensor]:
        ix = self.index
        shape = tuple(latent_shape or ix.latent_shape)
        pin = _pin(pin_memory)
        return {"latents": torch.empty((batch_size, *shape), dtype=torch.float32, pin_memory=pin),
                "text": torch.empty((batch_size, ix.max_text_tokens, ix.text_dim), dtype=self.text_dtype,
                                    pin_memory=pin),
                "text_mask": torch.empty((batch_size, ix.max_text_tokens), dtype=torch.int64, pin_memory=pin)}

    def batch(self, indices: Sequence[int], out: dict[str, torch.Tensor] | None = None,
              filled: list[int] | None = None, latent_shape: Sequence[int] | None = None
              ) -> dict[str, torch.Tensor]:
        """Collate the samples ``indices`` into ``out`` or new tensors.

        ``filled``: for a reused ``out`` whose text padding is known to be zero beyond
        ``filled[row]`` rows (what the previous call wrote, untouched since), only rows
        ``[n, filled[row])`` are zeroed; padding is ~75% of a 300-token batch, so this
        halves the memory traffic. Updated in place. None: every padding row is zeroed.
        ``latent_shape``: the batch's bucket shape (default: the index's single shape); every
        sample must have it.
        """
        ix = self.index
        n_max, dim = ix.max_text_tokens, ix.text_dim
        expected = tuple(latent_shape or ix.latent_shape)
        out = self.empty_batch(len(indices), expected) if out is None else out
        latents, text, mask = out["latents"], out["text"], out["text_mask"]
        for row, g in enumerate(indices):
            s = bisect.bisect_right(self.starts, g) - 1
            shard = self.shard(s)
            t = self._tensors(shard, self.mapped(s), g - self.starts[s])
            lat, txt = t["latents"], t["text"]
            if tuple(lat.shape) != expected:
                raise _corrupt(shard.label, f"member {shard.members[g - self.starts[s]][0]}: latents shape "
                                            f"{list(lat.shape)}, index says {list(expected)}")
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

    Buckets: ``get(shape)`` prefers a free buffer whose latents have ``shape``; else a free
    buffer of another bucket gets new latents (1 MB at 600M-512) and keeps its text and
    mask tensors (the 88 MB that matter), so memory stays ``capacity`` batches for any
    number of buckets.
    """

    def __init__(self, make: Callable[[tuple[int, ...]], dict[str, torch.Tensor]], capacity: int,
                 make_latents: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> None:
        self.make, self.capacity, self.make_latents = make, capacity, make_latents
        self.items: list[_Buffers] = []
        self.base = _storage_refs(torch.empty(1))  # refs of a storage only its own tensor holds

    def get(self, shape: tuple[int, ...] = ()) -> _Buffers:
        free = [item for item in self.items if all(_storage_refs(t) == self.base for t in item.tensors.values())]
        for item in free:
            if item.shape == shape:
                return item
        if free and len(self.items) >= self.capacity and self.make_latents is not None:
            item = free[0]
            item.tensors["latents"] = self.make_latents(shape)
            item.shape, item.versions = shape, []  # versions [] -> the next fill is a full one
            return item
        item = _Buffers(self.make(shape), shape)
        if len(self.items) < self.capacity:
            self.items.append(item)
        return item


class _Buffers:
    """One batch's tensors plus what is known about their contents.

    ``filled[row]``: text rows of that row that may be non-zero; valid only while the
    tensors' version counters are the ones recorded after the last fill (views share the
    counter, so any in-place write by the consumer, e.g. caption dropout, invalidates it).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], shape: tuple[int, ...] = ()) -> None:
        self.tensors, self.shape = tensors, shape
        self.filled: list[int] | None = None
        self.versions: list[int] = []

    def clean_fill(self) -> list[int] | None:
        same = [t._version for t in self.tensors.values()] == self.versions
        return self.filled if same else None

    def done(self, filled: list[int]) -> dict[str, torch.Tensor]:
        self.filled, self.versions = filled, [t._version for t in self.tensors.values()]
        return {k: t.view(t.shape) for k, t in self.tensors.items()}


def _pin(pin_memory: bool) -> bool:
    """Pinned (page-locked) host memory only where CUDA exists: it speeds the GPU's
    non_blocking host-to-device copy; on a CPU-only or XLA host it is a no-op by design."""
    return bool(pin_memory) and torch.cuda.is_available()
