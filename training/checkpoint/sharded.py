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

The wait is cheap for a shared filesystem (``wait_for_ranks``): one directory listing per
poll, never a stat per rank, polls backing off from 10 ms to 1 s, each record read once
(benchmarks/commit_wait_bench.py). A rank that fails anywhere, creating the directory
included, leaves ``rank-XXXXX.failed.json`` (beside the directory when it could not create
it), so rank 0 fails the save within one poll instead of waiting out ``RANK_TIMEOUT_S``;
a rank that dies silently ends the wait at the timeout, in one line naming the ranks.

A crash at any instant leaves a ``.tmp-step-*`` without a manifest (some ranks done, others
not, or all done and no manifest yet), which ``find_latest`` ignores and the next start
deletes, or one with a complete manifest but not renamed, whose rename the next start
finishes (training/checkpoint/layout.py ``recover_temp_dirs``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from training.checkpoint.layout import (
    FORMAT_SHARDED,
    MANIFEST,
    STATE_FILE,
    HashingWriter,
    commit_dir,
    done_file,
    failed_file,
    fault_point,
    fsync_dir,
    publish_json,
    rank_rng_file,
    read_manifest,
    shard_file,
    write_json,
)
from training.checkpoint.shards import write_shard
from training.optim.sharding import Piece

log = logging.getLogger("training.checkpoint")
#: how long one save's background part may take on a rank (rank 0: until every rank's done
#: record is there) before the save fails
RANK_TIMEOUT_S = 1800.0
#: rank 0's poll for done records: first interval, growth factor, longest interval
POLL_FIRST_S, POLL_GROWTH, POLL_MAX_S = 0.01, 1.5, 1.0
_RECORD_RE = re.compile(r"^rank-(\d{5})\.(done|failed)\.json$")
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
                # one more compiled graph per shape). The rows are CLONED and the full host copy
                # dropped before the next tensor: a slice (or .contiguous() of one, the same
                # view) would keep the whole copy alive until the write ends, and with the
                # weights and moments replicated on every NeuronCore (no ZeRO-1) each process
                # would hold all of the state. Host memory per process while staging: its own
                # rows plus one full tensor in flight (tests/training/checkpoint/test_checkpoint_memory.py).
                out[key] = (_own_rows(src.cpu(), piece), piece.row0, piece.shape)
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


def _own_rows(host: torch.Tensor, piece: Piece) -> torch.Tensor:
    if piece.lo is None or (piece.lo == 0 and piece.hi == host.shape[0]):
        return host  # all of it: nothing else to free
    return host[piece.lo:piece.hi].clone()


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_rank(tmp: Path, *, step: int, rank: int, staged: Staged, rng: Any,
               train_state: Mapping[str, Any] | None) -> None:
    """One rank's files, then its done record (each fsynced; hashes taken while writing).
    Any failure, creating ``tmp`` included, leaves this rank's failure record for rank 0."""
    try:
        fault_point(step, "mkdir", rank)
        tmp.mkdir(parents=True, exist_ok=True)  # every rank: on a shared filesystem it may exist already
        fault_point(step, "start", rank)
        files = {shard_file(rank): write_shard(tmp / shard_file(rank), staged)}
        fault_point(step, "after-shard", rank)
        out = HashingWriter(tmp / rank_rng_file(rank))
        out.write(_torch_bytes(rng))
        files[rank_rng_file(rank)] = out.close()
        if train_state is not None:
            files[STATE_FILE] = write_json(tmp / STATE_FILE, train_state)
        publish_json(tmp / done_file(rank), {"rank": rank, "step": step, "files": files})
        fault_point(step, "after-done", rank)
    except Exception as exc:
        reason = describe_os_error(exc, tmp) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        record_failure(tmp, rank, reason)
        raise


def record_failure(tmp: Path, rank: int, reason: str) -> None:
    """Tell rank 0 not to wait for us: ``rank-XXXXX.failed.json`` in ``tmp``, or, when ``tmp``
    cannot be written (it could not be created), ``<tmp name>.rank-XXXXX.failed.json`` beside
    it. Best effort: with no writable place at all, rank 0's wait ends at its timeout."""
    record = {"rank": rank, "error": reason}
    for path in (tmp / failed_file(rank), tmp.parent / f"{tmp.name}.{failed_file(rank)}"):
        with contextlib.suppress(OSError):
            publish_json(path, record)
            return
    log.error("checkpoint: rank %d could not record its failure anywhere under %s", rank, tmp.parent)


def describe_os_error(exc: OSError, where: Path) -> str:
    return f"{exc.strerror or exc} ({getattr(exc, 'filename', None) or where})"


def _names(directory: Path) -> list[str]:
    """One listing (a single readdir: one metadata round trip on Lustre for a few hundred entries)."""
    try:
        with os.scandir(directory) as entries:
            return [entry.name for entry in entries]
    except FileNotFoundError:
        return []


def wait_for_ranks(tmp: Path, *, world_size: int, timeout_s: float) -> dict[int, bytes]:
    """Rank 0: every rank's done record (its bytes), once all are there.

    Each poll lists ``tmp`` and its parent (where a rank that could not create ``tmp`` leaves
    its failure record) and reads only records that appeared since the last poll; polls back
    off from ``POLL_FIRST_S`` to ``POLL_MAX_S``, so at any world size the wait costs at most
    two listings per poll plus one read per rank, and adds at most ``POLL_MAX_S`` of latency
    after the last rank. Raises OSError with the first failed rank's own error, or after
    ``timeout_s`` naming the ranks that never reported.
    """
    deadline = time.monotonic() + timeout_s
    records: dict[int, bytes] = {}
    fallback = f"{tmp.name}."
    delay = POLL_FIRST_S
    while True:
        failed: list[Path] = [tmp.parent / n for n in _names(tmp.parent)
                              if n.startswith(fallback) and n.endswith(".failed.json")]
        for name in _names(tmp):
            match = _RECORD_RE.match(name)
            if match is None:
                continue
            rank = int(match.group(1))
            if match.group(2) == "failed":
                failed.append(tmp / name)
            elif rank not in records and rank < world_size:
                with contextlib.suppress(OSError):
                    records[rank] = (tmp / name).read_bytes()
        if failed:
            first = min(failed, key=lambda p: p.name)
            try:
                record = json.loads(first.read_bytes())
            except (OSError, ValueError):
                record = {"rank": first.name, "error": "failed (its failure record is unreadable)"}
            raise OSError(f"rank {record.get('rank')}: {record.get('error')}")
        if len(records) == world_size:
            return records
        now = time.monotonic()
        if now >= deadline:
            missing = sorted(set(range(world_size)) - set(records))
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise OSError(f"ranks {missing[:8]}{more} of {world_size} wrote no done record within "
                          f"{timeout_s:.0f} s (a stalled or dead rank; check its node's filesystem mount)")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * POLL_GROWTH, POLL_MAX_S)


def commit(tmp: Path, final: Path, *, step: int, world_size: int, extra: Mapping[str, Any],
           timeout_s: float = RANK_TIMEOUT_S) -> None:
    """Rank 0: wait for every rank's done record, write the manifest, rename into place."""
    records = wait_for_ranks(tmp, world_size=world_size, timeout_s=timeout_s)
    fault_point(step, "before-manifest", 0)
    files: dict[str, Any] = {}
    for rank in sorted(records):
        raw = records[rank]
        files.update(json.loads(raw)["files"])
        files[done_file(rank)] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    write_json(tmp / MANIFEST, {"format": FORMAT_SHARDED, "step": step, "files": files,
                                "world_size": world_size, **extra})
    fsync_dir(tmp)
    fault_point(step, "before-rename", 0)
    commit_dir(tmp, final)


def discard(tmp: Path) -> None:
    """Remove a failed save's temp dir and any failure record left beside it."""
    shutil.rmtree(tmp, ignore_errors=True)
    for stray in tmp.parent.glob(f"{tmp.name}.*"):
        stray.unlink(missing_ok=True)


class SaveJob:
    """This rank's background part of one save; ``wait()`` joins it (bounded) and returns its error."""

    def __init__(self, work: Callable[[], None], name: str, *, timeout_s: float = RANK_TIMEOUT_S) -> None:
        self.error: str | None = None
        self._work = work
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except OSError as exc:
            # an errno error names its file; the commit's own ("rank 3: ...") is already one line
            self.error = describe_os_error(exc, Path(".")) if exc.strerror else str(exc)
        except Exception as exc:  # noqa: BLE001 - surfaced on the training thread by wait()
            log.exception("checkpoint write failed")
            self.error = f"{type(exc).__name__}: {exc}"

    def wait(self) -> str | None:
        # A little past the job's own deadline: the commit wait times out by itself first; this
        # only catches a write that hangs in the kernel (a filesystem that stopped answering).
        self._thread.join(max(0.0, self._deadline - time.monotonic()) + 30.0)
        if self._thread.is_alive():
            return (f"the write did not finish within {self._timeout_s:.0f} s "
                    "(a hung filesystem write on this rank?)")
        return self.error


def shard_files(ckpt: Path) -> list[Path]:
    """The shard files a v2 checkpoint's manifest lists, rank order."""
    manifest = read_manifest(ckpt) or {}
    return [ckpt / n for n in sorted(manifest.get("files", {})) if n.startswith("shard-rank-")]
