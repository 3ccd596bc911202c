"""The Checkpointer: when to save, what goes in, and the save's and the restore's
collectives, on every rank.

Everything needed to continue *bit-identically* goes in: weights, optimizer moments,
LR-schedule position, EMA, data-loader position, step counters and every RNG stream. The
default format is sharded and asynchronous (training/checkpoint/sharded.py); the old
single-writer format (``checkpoint.format: full``, training/checkpoint/full.py) is still
written on request (benchmarks compare the two) and read everywhere: a run resumed from one
saves its next checkpoint sharded. Same pattern as torchtitan's ``components/checkpointer``
(fixed keys per Stateful) with the commit record of ``torch.distributed.checkpoint``
(``.metadata`` written after the shards).

This class orchestrates; the rules live beside it: the config section
(training/checkpoint/config.py), counters, RNG, data position and the JSON record
(training/checkpoint/train_state.py), what a run resumes from (training/checkpoint/resume.py),
and the file layout (training/checkpoint/layout.py).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.backends.base import Backend
from training.checkpoint import full, sharded
from training.checkpoint.branch import Branch
from training.checkpoint.config import CheckpointConfig
from training.checkpoint.layout import (
    FORMAT_SHARDED,
    MANIFEST,
    RNG_FILE,
    STATE_FILE,
    TMP_PREFIX,
    done_file,
    list_complete,
    log,
    rank_rng_file,
    read_manifest,
    recover_temp_dirs,
    step_dir_name,
)
from training.checkpoint.resume import choose_resume, set_aside_later, warn_on_drift
from training.checkpoint.shards import ShardReader
from training.checkpoint.train_state import (
    Stateful,
    TrainState,
    capture_rng,
    jsonable,
    map_data_position,
    model_config,
    restore_rng,
)
from training.errors import UserError


class Checkpointer:
    """Called by the loop every step; decides itself when to write (CONTRIBUTING.md, 6).

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
        return jsonable({
            "step": step,
            "samples_seen": state.samples_seen,
            "train_state": state.state_dict(),
            "lr_scheduler": sched_sd,
            "dataloader": loader_sd,
            "backend": self.backend.describe(),
            "world_size": self.backend.world_size,
            "model_config": model_config(self.backend.unwrap(model)),
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
        tmp = self.root / f"{TMP_PREFIX}{step:08d}"
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
        tmp = self.root / f"{TMP_PREFIX}{step:08d}"
        if backend.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        backend.barrier()
        error: str | None = None
        if not backend.is_main:
            tmp.mkdir(parents=True, exist_ok=True)  # exists already on a shared filesystem
            full.torch_save(rng, tmp / full.rng_file(backend.rank))
        else:
            try:
                full.write_main(tmp, step=step, model_sd=model_sd, optim_sd=optim_sd, ema_sd=ema_sd, rng=rng,
                                train_state=lambda ema_meta: self._train_state(step, model, state, sched_sd,
                                                                               loader_sd, ema_meta=ema_meta))
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

    def _commit(self, tmp: Path, final: Path, step: int) -> None:
        """Rank 0: commit (manifest last, rename into place: full.py), then mirror and prune."""
        full.commit(tmp, final, step=step, world_size=self.backend.world_size, branch=self.branch)
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
                found = choose_resume(self.cfg, self.root)
                path = str(found) if found is not None else None
            except UserError as exc:
                error = str(exc)
        path, error = self.backend.broadcast_object((path, error))
        if error:
            raise UserError(error)
        return Path(path) if path else None

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
            set_aside_later(self.root, path)
        meta = json.loads((path / STATE_FILE).read_text())
        manifest = read_manifest(path) or {}
        if manifest.get("format") == FORMAT_SHARDED:
            self._load_sharded(path, meta, model=model, optimizer=optimizer, ema=ema)
            rng_path = path / rank_rng_file(backend.rank)
        else:  # sana-checkpoint/1: every rank reads the full files (fine for old checkpoints)
            full.restore_full(backend, path, meta, model=model, optimizer=optimizer, ema=ema)
            rng_path = path / full.rng_file(backend.rank)
        if scheduler is not None and meta.get("lr_scheduler") is not None:
            scheduler.load_state_dict(meta["lr_scheduler"])
        if loader is not None and meta.get("dataloader") is not None:
            loader.load_state_dict(map_data_position(meta["dataloader"], loader.state_dict()))
        state.load_state_dict(meta["train_state"])
        warn_on_drift(path, meta, self.run_config, backend)
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
