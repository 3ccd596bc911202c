"""The Checkpointer: when to save, what goes in, where a run resumes from.

Everything needed to continue *bit-identically* goes in: weights, optimizer moments,
LR-schedule position, EMA, data-loader position, step counters and every RNG stream. The
default format is sharded and asynchronous (training/checkpoint/sharded.py); the old
single-writer format (``checkpoint.format: full``, training/checkpoint/layout.py) is still
written on request (benchmarks compare the two) and read everywhere: a run resumed from one
saves its next checkpoint sharded. Same pattern as torchtitan's ``components/checkpointer``
(fixed keys per Stateful) with the commit record of ``torch.distributed.checkpoint``
(``.metadata`` written after the shards).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from training.backends.base import Backend
from training.checkpoint import sharded
from training.checkpoint.branch import Branch
from training.checkpoint.layout import (
    EMA_FILE,
    FORMAT,
    FORMAT_SHARDED,
    MANIFEST,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    STEP_RE,
    TMP_PREFIX,
    commit_dir,
    done_file,
    fault_point,
    find_latest,
    fsync_dir,
    fsync_file,
    list_complete,
    log,
    rank_rng_file,
    read_manifest,
    recover_temp_dirs,
    sha256_file,
    step_dir_name,
    verify,
)
from training.checkpoint.shards import ShardReader
from training.errors import UserError
from training.files import honour_umask

_STEP_RE = STEP_RE
_TMP_PREFIX = TMP_PREFIX
FORMAT_NAMES = ("sharded", "full")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often checkpoints are written, and what a run resumes from."""

    #: checkpoint root; relative paths are under the run's output_dir (default <output_dir>/checkpoints)
    dir: str = "checkpoints"
    #: save every N optimizer steps (0 = only when the loop forces a save, e.g. at the end)
    every_steps: int = 500
    #: keep the newest K complete local checkpoints (0 = keep all)
    keep_last: int = 3
    #: "auto" = newest complete checkpoint (local, else the S3 mirror) or a fresh start;
    #: "none" = always fresh; otherwise a checkpoint dir, a checkpoint root or an s3:// URL of either
    resume: str = "auto"
    #: s3://bucket/prefix to mirror every completed checkpoint to (None = no mirror)
    s3_mirror: str | None = None
    #: keep the newest K checkpoints under s3_mirror (0 = keep all; the bucket's lifecycle rules decide)
    s3_keep_last: int = 0
    #: False = write no checkpoint (not even the loop's final forced save) and resume from none;
    #: Trainium's --precompile sets it (neuron_parallel_compile's graphs return zeros)
    enabled: bool = True
    #: "sharded" (sana-checkpoint/2: every rank writes its own rows; reshardable N -> M) or
    #: "full" (sana-checkpoint/1: rank 0 gathers and writes everything; the old path)
    format: str = "sharded"
    #: sharded format: write in the background; the step blocks only for the device-to-host copy
    async_save: bool = True

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("checkpoint.dir: must not be empty; give a directory (default 'checkpoints')")
        for name in ("every_steps", "keep_last", "s3_keep_last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"checkpoint.{name}: must be an integer >= 0, got {value!r}")
        if not isinstance(self.resume, str) or not self.resume:
            raise ValueError("checkpoint.resume: use 'auto', 'none', a checkpoint path or an s3:// URL")
        if self.format not in FORMAT_NAMES:
            raise ValueError(f"checkpoint.format: {self.format!r} is not one of {FORMAT_NAMES}")
        if self.s3_mirror is not None and not (self.s3_mirror.startswith("s3://") and len(self.s3_mirror) > 5):
            raise ValueError(f"checkpoint.s3_mirror: {self.s3_mirror!r} is not an s3://BUCKET/PREFIX URL")


@dataclass(kw_only=True)
class TrainState:
    """Counters the loop advances; saved under the fixed key ``train_state``."""

    step: int = 0
    samples_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state.get("samples_seen", 0))
        self.extra = dict(state.get("extra", {}))


# ----- RNG -----------------------------------------------------------------------------
def capture_rng(backend: Backend | None = None) -> dict[str, Any]:
    """Every RNG stream the step can draw from (numpy state as a tensor: loads with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
        "backend": backend.rng_state() if backend is not None else {},
    }


def restore_rng(state: Mapping[str, Any], backend: Backend | None = None) -> None:
    """Inverse of ``capture_rng``."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["gauss"]))
    torch.set_rng_state(state["torch"])
    if backend is not None:
        backend.set_rng_state(state.get("backend", {}))


def _rng_file(rank: int) -> str:
    return RNG_FILE if rank == 0 else f"rng-rank-{rank:05d}.pt"


# ----- files (the v1 writer) ---------------------------------------------------------------
def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True, allow_nan=True)
        fh.flush()
        os.fsync(fh.fileno())


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _save_tensors(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses shared storage (tied weights): give each tensor its own."""
    seen: set[int] = set()
    own: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        value = value.detach().cpu().contiguous()
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen and value.numel():
            value = value.clone()
        seen.add(ptr)
        own[key] = value
    save_file(own, str(path))
    honour_umask(path)  # save_file writes 0600 whatever the umask (training/files)
    fsync_file(path)


def map_data_position(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """The loader position of a checkpoint, for a loader with another global batch (world size).

    Relies on the loader's ``state_dict`` fields ``epoch``, ``step`` (loader batches done this
    epoch) and ``global_batch`` (samples per loader batch over all ranks), and on its order
    being one global permutation per epoch that ranks split (so it does not depend on the
    world size). The position is ``step * global_batch`` samples into ``epoch``; when the new
    global batch divides it, the loader continues at exactly that sample (its own
    ``step * old // new``), else no whole step lands there and we refuse rather than skip or
    repeat samples.
    """
    old, new = int(saved["global_batch"]), int(current["global_batch"])
    if old == new:
        return dict(saved)
    offset = int(saved["step"]) * old
    if offset % new:
        raise UserError(f"checkpoint.resume: the data position ({offset} samples into epoch {saved['epoch']}, "
                        f"global batch {old}) is not a whole number of steps of the new global batch {new}; "
                        f"resume with a data.batch_size x world size that divides {offset}, or from another step")
    return {**saved, "samples_in_epoch": offset}


# ----- the checkpointer ------------------------------------------------------------------
def resolve_checkpoint(source: str, cache_dir: str | Path | None = None, *, key: str = "checkpoint") -> Path:
    """The complete checkpoint ``source`` names, for resuming and for export.

    ``source`` is a ``step-XXXXXXXX`` directory, a checkpoint root or a run directory (its
    newest complete checkpoint), local or ``s3://`` (fetched into ``cache_dir``). Anything
    else is a UserError that starts with ``key`` (the config key or argument it came from).
    """
    if source.startswith("s3://"):
        from training.checkpoint.mirror import fetch_checkpoint, fetch_latest

        cache = Path(cache_dir or tempfile.mkdtemp(prefix="sana-checkpoint-"))
        is_step = _STEP_RE.match(source.rstrip("/").rsplit("/", 1)[-1]) is not None
        found = fetch_checkpoint(source, cache) if is_step else fetch_latest(source, cache)
        if found is None:
            raise UserError(f"{key}: {source} holds no complete checkpoint (with manifest.json) of its live branch "
                            "(branch.json); check the URL, or give a step-XXXXXXXX URL to resume any one")
        return found
    path = Path(source)
    if (path / MANIFEST).exists():
        if verify(path) is None:
            raise UserError(f"{key}: {path} is incomplete or corrupt (files do not match manifest.json); "
                            "pick another step-* directory")
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir() and (found := find_latest(root)) is not None:
            return found
    raise UserError(f"{key}: {source} holds no complete checkpoint; give a step-XXXXXXXX directory, "
                    "a checkpoint root or a run directory")


class Checkpointer:
    """Called by the loop every step; decides itself when to write (STYLE.md rule 6).

    Collective calls run on every rank. In the sharded format every rank writes its own
    files and rank 0 the manifest; the checkpoint root must be a filesystem every rank sees
    (FSx for Lustre on the cluster).
    """

    def __init__(self, cfg: CheckpointConfig, backend: Backend, *, output_dir: str | Path,
                 run_config: Mapping[str, Any] | None = None,
                 provenance: Mapping[str, Any] | None = None, frozen_from: str | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        root = Path(cfg.dir)
        self.root = root if root.is_absolute() else Path(output_dir) / root
        self.run_config = dict(run_config or {})
        #: training/provenance.py: what code, env and text features produced this run
        self.provenance = dict(provenance or {})
        #: where frozen (requires_grad=False) parameters come from; they are not saved
        self.frozen_from = frozen_from
        self.last_saved_step: int | None = None
        self.mirror = None
        self._job: sharded.SaveJob | None = None
        self._job_final: Path | None = None
        self._job_tmp: Path | None = None
        self._stager = sharded.Stager()
        #: this run's trajectory (training/checkpoint/branch.py); ``restore`` forks it from the
        #: checkpoint it resumes, so S3 restores and prunes follow this run, not one it left
        self.branch = Branch.fresh()
        if backend.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if cfg.enabled:
                # A crashed commit: finish one whose manifest is complete, delete the rest.
                recover_temp_dirs(self.root)
            if cfg.s3_mirror and cfg.enabled:
                from training.checkpoint.mirror import S3Mirror

                self.mirror = S3Mirror(cfg.s3_mirror, keep_last=cfg.s3_keep_last)
        backend.barrier()

    # ----- save --------------------------------------------------------------------------
    def due(self, step: int, force: bool = False) -> bool:
        if not self.cfg.enabled or step == self.last_saved_step:
            return False  # disabled, or e.g. the final forced save right after a periodic one
        return force or (self.cfg.every_steps > 0 and step > 0 and step % self.cfg.every_steps == 0)

    def maybe_save(self, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: Stateful | None = None, ema: Stateful | None = None,
                   loader: Stateful | None = None, state: TrainState, force: bool = False) -> Path | None:
        """Save ``step`` when due (every ``every_steps``) or ``force``d. Returns the path or None
        (with ``async_save`` the path is complete once ``wait()`` or the next save returns)."""
        if not self.due(step, force):
            return None
        return self.save(step=step, model=model, optimizer=optimizer, scheduler=scheduler, ema=ema,
                         loader=loader, state=state)

    def save(self, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Stateful | None = None, ema: Stateful | None = None,
             loader: Stateful | None = None, state: TrainState) -> Path:
        self.wait()  # the previous save is complete (or its error raised) before a new one starts
        if self.cfg.format == "full":
            return self._save_full(step=step, model=model, optimizer=optimizer, scheduler=scheduler, ema=ema,
                                   loader=loader, state=state)
        return self._save_sharded(step=step, model=model, optimizer=optimizer, scheduler=scheduler, ema=ema,
                                  loader=loader, state=state)

    def _train_state(self, step: int, model: nn.Module, state: TrainState, sched_sd: Any, loader_sd: Any,
                     **extra: Any) -> dict[str, Any]:
        return _jsonable({
            "step": step,
            "samples_seen": state.samples_seen,
            "train_state": state.state_dict(),
            "lr_scheduler": sched_sd,
            "dataloader": loader_sd,
            "backend": self.backend.describe(),
            "world_size": self.backend.world_size,
            "model_config": _model_config(self.backend.unwrap(model)),
            "config": self.run_config,
            "provenance": self.provenance,
            **extra,
        })

    def _save_sharded(self, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: Stateful | None, ema: Any, loader: Stateful | None, state: TrainState) -> Path:
        """Stage this rank's rows on the host (the only part the loop waits for), then write
        them on a thread; rank 0's thread also commits (sharded.py)."""
        backend = self.backend
        rank, world = backend.rank, backend.world_size
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{_TMP_PREFIX}{step:08d}"
        try:
            sharded_state = backend.sharded_state(model, optimizer)
            pieces = dict(sharded_state.pieces)
            if ema is not None:
                pieces.update(ema.pieces(rank, world))
            staged = self._stager.stage(pieces)
        except Exception as exc:  # e.g. out of host memory on one rank: rank 0 must not wait for it
            sharded.record_failure(tmp, rank, f"staging failed: {type(exc).__name__}: {exc}")
            raise
        rng = capture_rng(backend)
        train_state = None
        if backend.is_main:
            sched_sd = scheduler.state_dict() if scheduler is not None else None
            loader_sd = loader.state_dict() if loader is not None else None
            train_state = self._train_state(
                step, model, state, sched_sd, loader_sd, format=FORMAT_SHARDED, has_ema=ema is not None,
                optim_values=sharded_state.values, param_groups=sharded_state.param_groups,
                frozen_from=self.frozen_from)
        extra = {"frozen_from": self.frozen_from, "branch": self.branch.to_json()}
        timeout_s = sharded.RANK_TIMEOUT_S
        deadline = time.monotonic() + timeout_s

        def work() -> None:
            sharded.write_rank(tmp, step=step, rank=rank, staged=staged, rng=rng, train_state=train_state)
            if backend.is_main:
                sharded.commit(tmp, final, step=step, world_size=world, extra=extra,
                               timeout_s=max(0.0, deadline - time.monotonic()))
                log.info("checkpoint saved: %s", final)
                if self.mirror is not None:
                    self.mirror.submit(final)
                self._prune()

        self.last_saved_step = step
        self._job = sharded.SaveJob(work, f"checkpoint-{step}", timeout_s=timeout_s)
        self._job_final, self._job_tmp = final, tmp
        if not self.cfg.async_save:
            self.wait()
        return final

    def wait(self) -> None:
        """Block until this rank's last save is written (rank 0: committed). Collective: a
        failed write on any rank fails every rank with the same one line."""
        job, final = self._job, self._job_final
        self._job = None
        if job is None:
            return
        error = job.wait()
        # Rank 0 saw every rank's done (or failed) record before committing; its outcome is
        # the save's outcome, and broadcasting it fences the save like a barrier.
        shared = self.backend.broadcast_object(error if self.backend.is_main else None)
        error = shared or error
        if error:
            if self.backend.is_main:
                sharded.discard(self._job_tmp)
            raise UserError(f"checkpoint.dir: writing {final} failed: {error}; free space or fix "
                            f"permissions under {self.root} (or lower checkpoint.keep_last), then resume")

    def _save_full(self, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: Stateful | None = None, ema: Stateful | None = None,
                   loader: Stateful | None = None, state: TrainState) -> Path:
        """``sana-checkpoint/1``: rank 0 gathers and writes everything (the old path)."""
        backend = self.backend
        # Collective on every rank, before anything touches the disk.
        model_sd = backend.model_state_dict(model)
        optim_sd = backend.optimizer_state_dict(model, optimizer)
        # EMA.state_dict gathers FSDP shards: collective too. The small states are taken here as
        # well so every rank runs the same code path.
        ema_sd = ema.state_dict() if ema is not None else None
        sched_sd = scheduler.state_dict() if scheduler is not None else None
        loader_sd = loader.state_dict() if loader is not None else None
        rng = capture_rng(backend)
        final = self.root / step_dir_name(step)
        tmp = self.root / f"{_TMP_PREFIX}{step:08d}"
        if backend.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        backend.barrier()
        error: str | None = None
        if not backend.is_main:
            tmp.mkdir(parents=True, exist_ok=True)  # exists already on a shared filesystem
            _torch_save(rng, tmp / _rng_file(backend.rank))
        else:
            try:
                self._write_main(tmp, step=step, model=model, model_sd=model_sd, optim_sd=optim_sd,
                                 ema_sd=ema_sd, sched_sd=sched_sd, loader_sd=loader_sd, rng=rng, state=state)
            except OSError as exc:  # disk full, quota, permissions: rank 0 tells everyone below
                error = f"{exc.strerror or exc} ({getattr(exc, 'filename', None) or tmp})"
        backend.barrier()  # every rank's RNG file is on disk
        if backend.is_main and error is None:
            try:
                self._commit(tmp, final, step)
            except OSError as exc:
                error = f"{exc.strerror or exc} ({getattr(exc, 'filename', None) or tmp})"
        # Rank 0's outcome reaches every rank (and fences the save like a barrier), so a failed
        # write stops all ranks with the same message instead of leaving them waiting.
        error = backend.broadcast_object(error)
        if error:
            if backend.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise UserError(f"checkpoint.dir: writing {final} failed: {error}; free space or fix "
                            f"permissions under {self.root} (or lower checkpoint.keep_last), then resume")
        self.last_saved_step = step
        return final


    def _write_main(self, tmp: Path, *, step: int, model: nn.Module, model_sd: Mapping[str, torch.Tensor],
                    optim_sd: Any, ema_sd: Mapping[str, Any] | None, sched_sd: Any, loader_sd: Any,
                    rng: Any, state: TrainState) -> None:
        """Rank 0: every file except the manifest, each fsynced."""
        fault_point(step, "start")
        _save_tensors(model_sd, tmp / MODEL_FILE)
        fault_point(step, "after-model")
        _torch_save(optim_sd, tmp / OPTIMIZER_FILE)
        ema_meta: dict[str, Any] | None = None
        if ema_sd is not None:
            ema_tensors, ema_meta = _split_tensors(ema_sd)
            _save_tensors(ema_tensors, tmp / EMA_FILE)
        _write_json(tmp / STATE_FILE, self._train_state(step, model, state, sched_sd, loader_sd, ema_meta=ema_meta))
        _torch_save(rng, tmp / _rng_file(0))

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: manifest last, rename into place, then mirror and prune."""
        fault_point(step, "before-manifest")
        files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
        _write_json(tmp / MANIFEST, {"format": FORMAT, "step": step, "files": files,
                                     "world_size": self.backend.world_size, "branch": self.branch.to_json()})
        fsync_dir(tmp)
        fault_point(step, "before-rename")
        commit_dir(tmp, final)
        log.info("checkpoint saved: %s", final)
        if self.mirror is not None:
            self.mirror.submit(final)
        self._prune()

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        complete = list_complete(self.root)
        busy = self.mirror.pending() if self.mirror is not None else set()
        for _, path in complete[:-self.cfg.keep_last]:
            if path.resolve() in busy:
                continue  # still uploading; pruned after a later save
            log.info("removing old checkpoint %s (keep_last=%d)", path, self.cfg.keep_last)
            # Manifest first: an interrupted delete leaves an incomplete dir, never a "complete" one
            # with missing files.
            (path / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)

    # ----- restore ------------------------------------------------------------------------
    def resolve_resume(self) -> Path | None:
        """Rank 0 decides what to resume from (fetching from S3 if needed); all ranks agree."""
        path: str | None = None
        error: str | None = None
        if self.backend.is_main:
            try:
                found = self._resolve_on_main()
                path = str(found) if found is not None else None
            except UserError as exc:
                error = str(exc)
        path, error = self.backend.broadcast_object((path, error))
        if error:
            raise UserError(error)
        return Path(path) if path else None

    def _resolve_on_main(self) -> Path | None:
        resume = self.cfg.resume
        if resume == "none" or not self.cfg.enabled:
            return None
        if resume == "auto":
            found = find_latest(self.root)
            if found is None and self.cfg.s3_mirror:
                from training.checkpoint.mirror import fetch_latest

                found = fetch_latest(self.cfg.s3_mirror, self.root)
            return found
        return resolve_checkpoint(resume, self.root, key="checkpoint.resume")

    def restore(self, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: Stateful | None = None, ema: Any = None,
                loader: Stateful | None = None, state: TrainState) -> Path | None:
        """Load everything from the checkpoint ``cfg.resume`` selects. Returns its path, or None
        for a fresh start. RNG streams are restored last so nothing here perturbs them.

        Also where a run's checkpointing starts: the model's placements are checked (a sharded
        checkpoint of a layout it cannot store fails here, before step 0, not at the first save)
        and this run's branch forks from the checkpoint (training/checkpoint/branch.py)."""
        self.check_placements(model, ema)
        path = self.resolve_resume()
        backend = self.backend
        if backend.is_main and self.cfg.enabled:
            self.branch = Branch.fork(read_manifest(path) if path is not None else None)
            if self.mirror is not None:
                self.mirror.announce(self.branch)
        if path is None:
            return None
        if backend.is_main:
            self._set_aside_later(path)
        meta = json.loads((path / STATE_FILE).read_text())
        manifest = read_manifest(path) or {}
        if manifest.get("format") == FORMAT_SHARDED:
            self._load_sharded(path, meta, model=model, optimizer=optimizer, ema=ema)
            rng_path = path / rank_rng_file(backend.rank)
        else:  # sana-checkpoint/1: every rank reads the full files (fine for old checkpoints)
            self._load_full(path, meta, model=model, optimizer=optimizer, ema=ema)
            rng_path = path / _rng_file(backend.rank)
        if scheduler is not None and meta.get("lr_scheduler") is not None:
            scheduler.load_state_dict(meta["lr_scheduler"])
        if loader is not None and meta.get("dataloader") is not None:
            loader.load_state_dict(map_data_position(meta["dataloader"], loader.state_dict()))
        state.load_state_dict(meta["train_state"])
        if backend.is_main and (changes := _config_changes(meta.get("config") or {}, self.run_config)):
            # Legitimate (a longer run, a new LR), but then the run is no longer the one saved.
            log.warning("resuming with a changed config: %s", "; ".join(changes[:20]))
        saved_threads = (meta.get("backend") or {}).get("intra_op_threads")
        threads = backend.describe().get("intra_op_threads")
        if backend.is_main and saved_threads is not None and threads is not None and saved_threads != threads:
            # CPU only: the thread count changes the reduction order of every op, so the bits.
            log.warning("%s: saved with %s intra-op CPU threads, resumed with %s: continuing is fine, "
                        "bit-identity is not (set OMP_NUM_THREADS=%s to match)", path, saved_threads, threads,
                        saved_threads)
        if not rng_path.exists() or meta.get("world_size") != backend.world_size:
            # A different world size than the saving run: continuing is fine, bit-identity is not.
            log.warning("%s: no RNG state for rank %d (saved with world size %s); using rank 0's",
                        path, backend.rank, meta.get("world_size"))
            rng_path = path / (rank_rng_file(0) if manifest.get("format") == FORMAT_SHARDED else RNG_FILE)
        restore_rng(torch.load(rng_path, map_location="cpu", weights_only=True), backend)
        self.last_saved_step = state.step
        log.info("resumed from %s at step %d", path, state.step)
        return path

    def check_placements(self, model: nn.Module, ema: Any = None) -> None:
        """Refuse, in one line, a model whose DTensor layout the sharded format cannot store."""
        if self.cfg.format != "sharded" or not self.cfg.enabled:
            return
        from training.optim.sharding import unsupported_placements

        shadows = getattr(ema, "shadow", None) or {}
        problems = unsupported_placements(self.backend.unwrap(model), {f"ema/{k}": v for k, v in shadows.items()})
        if problems:
            raise UserError(f"checkpoint.format: sharded checkpoints store Shard(0)/Replicate() layouts only "
                            f"(FSDP2, HSDP, DDP, ZeRO-1); {problems[0]}"
                            f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                            "set checkpoint.format=full for this layout")

    def _load_full(self, path: Path, meta: Mapping[str, Any], *, model: nn.Module,
                   optimizer: torch.optim.Optimizer, ema: Any) -> None:
        backend = self.backend
        backend.load_model_state_dict(model, load_file(str(path / MODEL_FILE)))
        backend.load_optimizer_state_dict(model, optimizer,
                                          torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
        if ema is not None:
            if not (path / EMA_FILE).exists():
                raise UserError(f"{path}: has no {EMA_FILE} but this run keeps an EMA; resume from a "
                                "checkpoint written with EMA on, or turn EMA off")
            ema.load_state_dict(_join_tensors(load_file(str(path / EMA_FILE)), meta.get("ema_meta")))

    def _load_sharded(self, path: Path, meta: Mapping[str, Any], *, model: nn.Module,
                      optimizer: torch.optim.Optimizer, ema: Any) -> None:
        """Each rank reads only the rows it holds (mmap'd safetensors), whatever the saving
        world size or wrapping was (DDP, FSDP2, ZeRO-1: training/optim/sharding.py)."""
        with ShardReader(sharded.shard_files(path)) as reader:
            keys = reader.keys()
            try:
                self.backend.load_sharded_state(model, optimizer, reader, keys=keys,
                                                values=meta.get("optim_values") or {},
                                                param_groups=meta["param_groups"])
            except ValueError as exc:
                raise UserError(f"checkpoint.resume: {path}: {exc}; resume with the same model preset/overrides "
                                "and trainable parameters") from None
            if ema is not None:
                if not meta.get("has_ema"):
                    raise UserError(f"{path}: has no EMA but this run keeps an EMA; resume from a "
                                    "checkpoint written with EMA on, or turn EMA off")
                ema.load_pieces(reader, keys)

    def _set_aside_later(self, resumed: Path) -> None:
        """Resuming from an older checkpoint of this root abandons the later ones: rename them
        so that a crash followed by ``--resume auto`` never jumps back onto that trajectory."""
        match = _STEP_RE.match(resumed.name)
        if match is None or resumed.resolve().parent != self.root.resolve():
            return
        step = int(match.group(1))
        for later, path in list_complete(self.root):
            if later > step:
                target = path.with_name(f"abandoned-{path.name}")
                n = 1
                while target.exists():
                    target, n = path.with_name(f"abandoned-{path.name}.{n}"), n + 1
                log.warning("resuming from step %d: renaming the later %s to %s", step, path.name, target.name)
                os.replace(path, target)

    def abandon(self) -> None:
        """The run failed on this rank (the loop's failure path): leave without waiting on any
        other rank. No collective, no join. A save in flight is left to its thread; a rank
        other than 0 leaves a failed record in it (as a failed write does), so rank 0's commit
        stops waiting for it instead of waiting out its timeout. What rank 0 commits is whole
        either way (the manifest goes in only after every rank's done record, each written
        after that rank's files: training/checkpoint/sharded.py); an uncommitted
        ``.tmp-step-*`` is what a crash leaves, handled at the next start. The S3 mirror
        stops without draining its queue (the local copies are complete)."""
        job, tmp = self._job, self._job_tmp
        self._job = None
        rank = self.backend.rank
        if job is not None and tmp is not None and rank != 0 and not (tmp / done_file(rank)).exists():
            sharded.record_failure(tmp, rank, "abandoned: this rank failed during the save")
        if self.mirror is not None:
            self.mirror.close(timeout_s=0)
            self.mirror = None

    def close(self) -> None:
        """Success path: finish the save in flight (a collective: every rank learns its
        outcome), then wait for the S3 mirror to finish every queued upload."""
        try:
            self.wait()
        finally:
            if self.mirror is not None:
                # An hour covers a 1.6B checkpoint (~19 GB) at ~6 MB/s; a blackholed S3 endpoint
                # must not hold the job (and its nodes) forever.
                self.mirror.close(timeout_s=3600)
                self._prune()
                self.mirror = None


# ----- helpers for state that is not a flat tensor dict ---------------------------------
def _split_tensors(state: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Nested state -> (flat ``a/b`` keyed tensors for safetensors, JSON description of the rest).

    Keys are joined with "/" because parameter names already contain dots.
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"tensors": [], "nested": {}, "values": {}}
    for key, value in state.items():
        key = str(key)
        if isinstance(value, torch.Tensor):
            tensors[prefix + key] = value
            meta["tensors"].append(key)
        elif isinstance(value, Mapping):
            sub_t, sub_m = _split_tensors(value, prefix + key + "/")
            tensors.update(sub_t)
            meta["nested"][key] = sub_m
        else:
            meta["values"][key] = value
    return tensors, meta


def _join_tensors(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any] | None,
                  prefix: str = "") -> dict[str, Any]:
    """Inverse of ``_split_tensors`` (``meta`` None: the file holds a flat tensor dict)."""
    if meta is None:
        return dict(tensors)
    out: dict[str, Any] = dict(meta["values"])
    out.update({key: tensors[prefix + key] for key in meta["tensors"]})
    out.update({key: _join_tensors(tensors, sub, prefix + key + "/") for key, sub in meta["nested"].items()})
    return out


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for each run-config value that differs (where to resume from aside)."""
    old, new = _flatten(saved), _flatten(_jsonable(current))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if key != "checkpoint.resume" and old.get(key) != new.get(key)]


def _model_config(model: nn.Module) -> dict[str, Any] | None:
    """The diffusers config of the model (what export needs to rebuild it), if it has one."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        # ``_use_default_values`` comes from a set: its order changes from process to process.
        return _jsonable({k: v for k, v in dict(config).items()
                          if not k.startswith("_") or k in ("_class_name", "_diffusers_version")})
    except TypeError:
        return None


def _jsonable(obj: Any) -> Any:
    """JSON-safe copy: tuples -> lists, Paths -> str; a tensor here is a bug in the caller."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 1:
            return obj.item()
        raise TypeError("train_state.json: a tensor in a scheduler/loader/config state; keep those small")
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    raise TypeError(f"train_state.json: cannot store {type(obj).__name__}")
