"""Format ``sana-checkpoint/2``: every rank writes its own rows, in the background.

Layout of ``step-XXXXXXXX/`` (all files flat, so the S3 mirror and export treat it like v1)::

    shard-rank-00000.safetensors  rank 0's rows of model/*, optim/*/*, ema/* (training/checkpoint/shards.py)
    rng-rank-00000.pt             rank 0's RNG streams (every rank has its own)
    train_state.json              rank 0: step, data position, LR schedule, param groups, config
    rank-00000.done.json          rank 0's files with size + sha256 (fsynced after them)
    ... the same three per rank ...
    manifest.json                 WRITTEN LAST by rank 0: the merged done records

Save (``SaveJob``): the loop blocks only while ``stage`` copies this rank's rows off the device
(into pinned buffers on CUDA, reused from save to save, as torchtitan's
``AsyncMode.ASYNC_WITH_PINNED_MEM`` stages before its background write; on CPU "pinned"
means nothing and the copy is a plain one). A thread per rank then streams the shard to disk
through a hash, writes the RNG file and the done record; rank 0's thread waits for every
rank's done record (a filesystem poll, not a collective: a gloo collective from a second
thread would race the training step's collectives on the same group, which is why
torchtitan gives async checkpointing its own gloo group), writes the manifest, renames the
directory into place and hands it to the S3 mirror. No rank ever holds the full state, and
nothing is read back for a checksum.

A crash at any instant leaves a ``.tmp-step-*`` without a manifest (some ranks done, others
not, or all done and no manifest yet) or one with a manifest but not renamed: ``find_latest``
ignores both and the next start deletes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from training.backends.state import Piece
from training.checkpoint.layout import (
    FORMAT_SHARDED,
    MANIFEST,
    STATE_FILE,
    HashingWriter,
    done_file,
    failed_file,
    fault_point,
    fsync_dir,
    rank_rng_file,
    read_manifest,
    shard_file,
    write_json,
)
from training.checkpoint.shards import write_shard

log = logging.getLogger("training.checkpoint")
#: how long rank 0 waits for the other ranks' done records before giving up on a save
RANK_TIMEOUT_S = 1800.0
Staged = dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]


class Stager:
    """Copies pieces to host memory, reusing its buffers from one save to the next (the
    previous save's writer has finished with them before the next ``stage``)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, pieces: Mapping[str, Piece]) -> Staged:
        out: Staged = {}
        cuda = False
        for key, piece in pieces.items():
            src = piece.src.detach()
            if src.device.type not in ("cpu", "cuda"):
                # XLA: to the host one tensor at a time, sliced there (a device slice would be
                # one more compiled graph per shape).
                host = src.cpu()
                rows = host if piece.lo is None else host[piece.lo:piece.hi]
                out[key] = (rows.contiguous(), piece.row0, piece.shape)
                continue
            rows = src if piece.lo is None else src[piece.lo:piece.hi]
            buf = self._buffers.get(key)
            if buf is None or buf.shape != rows.shape or buf.dtype != rows.dtype:
                pin = rows.device.type == "cuda"
                buf = self._buffers[key] = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=pin)
            buf.copy_(rows, non_blocking=rows.device.type == "cuda")
            cuda = cuda or rows.device.type == "cuda"
            out[key] = (buf, piece.row0, piece.shape)
        if cuda:
            torch.cuda.synchronize()  # every non_blocking device-to-host copy has landed
        return out


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_rank(tmp: Path, *, step: int, rank: int, staged: Staged, rng: Any,
               train_state: Mapping[str, Any] | None) -> None:
    """One rank's files, then its done record (each fsynced; hashes taken while writing)."""
    tmp.mkdir(parents=True, exist_ok=True)  # every rank: on a shared filesystem it exists already
    try:
        fault_point(step, "start", rank)
        files = {shard_file(rank): write_shard(tmp / shard_file(rank), staged)}
        fault_point(step, "after-shard", rank)
        out = HashingWriter(tmp / rank_rng_file(rank))
        out.write(_torch_bytes(rng))
        files[rank_rng_file(rank)] = out.close()
        if train_state is not None:
            files[STATE_FILE] = write_json(tmp / STATE_FILE, train_state)
        write_json(tmp / done_file(rank), {"rank": rank, "step": step, "files": files})
        fault_point(step, "after-done", rank)
    except Exception as exc:
        reason = describe_os_error(exc, tmp) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):  # tell rank 0 not to wait for us
            write_json(tmp / failed_file(rank), {"rank": rank, "error": reason})
        raise


def describe_os_error(exc: OSError, where: Path) -> str:
    return f"{exc.strerror or exc} ({getattr(exc, 'filename', None) or where})"


def commit(tmp: Path, final: Path, *, step: int, world_size: int, extra: Mapping[str, Any],
           timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Rank 0: wait for every rank's done record, write the manifest, rename into place."""
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict[str, Any]] = {}
    while len(records) < world_size:
        for rank in range(world_size):
            if rank in records:
                continue
            if (tmp / failed_file(rank)).exists():
                reason = json.loads((tmp / failed_file(rank)).read_text()).get("error")
                raise OSError(f"rank {rank}: {reason}")
            # not written yet, or mid-write (json fails until it is whole): look again
            with contextlib.suppress(OSError, ValueError):
                records[rank] = json.loads((tmp / done_file(rank)).read_text())
        if len(records) < world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(records))
                raise OSError(f"ranks {missing[:8]} wrote no done record within {timeout_s:.0f} s")
            time.sleep(0.005)
    fault_point(step, "before-manifest", 0)
    files: dict[str, Any] = {}
    for rank in sorted(records):
        files.update(records[rank]["files"])
        files[done_file(rank)] = {"size": (tmp / done_file(rank)).stat().st_size,
                                  "sha256": _sha_small(tmp / done_file(rank))}
    write_json(tmp / MANIFEST, {"format": FORMAT_SHARDED, "step": step, "files": files,
                                "world_size": world_size, **extra})
    fsync_dir(tmp)
    fault_point(step, "before-rename", 0)
    if final.exists():  # an older attempt at this step (e.g. resumed from an earlier one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def _sha_small(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # a done record: a few hundred bytes


class SaveJob:
    """This rank's background part of one save; ``wait()`` joins it and returns its error."""

    def __init__(self, work: Callable[[], None], name: str) -> None:
        self.error: str | None = None
        self._work = work
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except OSError as exc:
            self.error = describe_os_error(exc, Path("."))
        except Exception as exc:  # noqa: BLE001 - surfaced on the training thread by wait()
            log.exception("checkpoint write failed")
            self.error = f"{type(exc).__name__}: {exc}"

    def wait(self) -> str | None:
        self._thread.join()
        return self.error


def shard_files(ckpt: Path) -> list[Path]:
    """The shard files a v2 checkpoint's manifest lists, rank order."""
    manifest = read_manifest(ckpt) or {}
    return [ckpt / n for n in sorted(manifest.get("files", {})) if n.startswith("shard-rank-")]
