"""Per-rank shard files: safetensors written tensor by tensor through a hash, read row by row.

The file is plain safetensors (https://github.com/huggingface/safetensors, README "Format":
8-byte little-endian header length, a JSON header mapping each name to dtype, shape and
``data_offsets`` into the byte buffer that follows, plus a ``__metadata__`` str->str map), so
``safe_open`` reads it with mmap and ``get_slice`` reads only the requested rows. We write it
ourselves instead of calling ``save_file`` so that (1) bytes stream out one tensor at a time
(no second copy of the shard in memory) and (2) the sha256 is computed on the way out, never
by re-reading. ``__metadata__["sana"]`` records, per tensor, its global shape and first row:
what resharding to another world size needs.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from training.checkpoint.layout import HashingWriter

#: torch dtype -> safetensors dtype tag (safetensors README "Format": the dtype strings)
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_META_KEY = "sana"


def write_shard(path: Path, tensors: Mapping[str, tuple[torch.Tensor, int, tuple[int, ...]]]) -> dict[str, Any]:
    """Write ``{key: (local CPU rows, first global row, global shape)}``; returns size + sha256."""
    header: dict[str, Any] = {}
    layout: dict[str, list[Any]] = {}
    offset = 0
    for key, (t, row0, shape) in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        layout[key] = [row0, list(shape)]
        offset += nbytes
    header["__metadata__"] = {_META_KEY: json.dumps(layout, separators=(",", ":"))}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the reference writer pads the header to 8-byte alignment
    out = HashingWriter(path)
    try:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for t, _, _ in tensors.values():
            if t.numel():
                out.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    except BaseException:
        out.abort()
        raise
    return out.close()


class ShardReader:
    """Every tensor of a sharded checkpoint, readable by global rows across rank files.

    ``reader(key, start, stop)`` returns rows [start, stop) (None, None: all) assembled from
    the files that hold them; only those rows are read from disk (mmap through ``safe_open``).
    """

    def __init__(self, files: list[Path]) -> None:
        self._stack = ExitStack()
        self._index: dict[str, list[tuple[Any, int, int]]] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for path in files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            layout = json.loads((handle.metadata() or {})[_META_KEY])
            for key, (row0, shape) in layout.items():
                rows = handle.get_slice(key).get_shape()
                self._index.setdefault(key, []).append((handle, row0, rows[0] if rows else 0))
                self._shape[key] = tuple(shape)

    def keys(self) -> set[str]:
        return set(self._index)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[key]

    def __call__(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        if key not in self._index:
            raise KeyError(f"checkpoint holds no tensor {key!r}")
        shape = self._shape[key]
        if not shape:
            return self._index[key][0][0].get_tensor(key)
        start = 0 if start is None else start
        stop = shape[0] if stop is None else stop
        parts = []
        for handle, row0, rows in sorted(self._index[key], key=lambda e: e[1]):
            lo, hi = max(start, row0), min(stop, row0 + rows)
            if lo < hi:
                parts.append(handle.get_slice(key)[lo - row0:hi - row0])
        if sum(p.shape[0] for p in parts) != stop - start:
            raise ValueError(f"checkpoint: rows [{start}, {stop}) of {key} are not all saved")
        if not parts:  # an empty range (a rank with no rows of this tensor)
            handle = self._index[key][0][0]
            return handle.get_slice(key)[0:0]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
