"""The loader: one rank's infinite stream of static-shape batches, with an exact position."""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load

from training.data.buckets import EpochPlan, plan_epoch, rank_slice
from training.data.decode import _BufferPool, _Decoder, _pin
from training.data.index import Bucket, FeatureIndex, _corrupt
from training.data.shards import NULL_CAPTION
from training.errors import UserError

log = logging.getLogger(__name__)

#: ``data.text_dtype`` -> the dtype host batches carry captions in (shards store bf16)
TEXT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    #: allocate batch buffers in pinned host memory (faster non_blocking copies to a GPU);
    #: a no-op where CUDA is not available (CPU runs, Trainium)
    pin_memory: bool = False
    #: > 0: serve the buckets one after another in the index's fixed order, this many
    #: optimizer steps each (x the loop's grad_accum_steps micro-batches), instead of the seeded shuffle (set by ``python -m training.trainium --precompile``
    #: so every bucket's graph is traced); 0 for training
    fixed_bucket_steps: int = 0
    #: dtype of the captions in host batches: "fp32", or "bf16" (as stored: half the bytes
    #: to pin and copy; the GPU backend casts to fp32 on the device, exactly; Trainium casts
    #: on the host before the transfer, so its step graph is unchanged)
    text_dtype: str = "fp32"
    #: NVlabs Sana's ``model.multi_scale`` (true in every config under configs/sana_config/):
    #: train on aspect-ratio buckets; features precomputed square (``--buckets square``) are
    #: then refused at start in one line instead of silently training one shape
    multi_scale: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise ValueError(f"data.path: must be a string path or s3:// URL, got {self.path!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"data.batch_size: must be an integer >= 1, got {self.batch_size!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data.seed: must be an integer >= 0, got {self.seed!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"data.prefetch: must be an integer >= 0, got {self.prefetch!r}")
        if self.text_dtype not in TEXT_DTYPES:
            raise ValueError(f"data.text_dtype: {self.text_dtype!r} is not one of {', '.join(TEXT_DTYPES)}")
        if not isinstance(self.fixed_bucket_steps, int) or self.fixed_bucket_steps < 0:
            raise ValueError(f"data.fixed_bucket_steps: must be an integer >= 0, got {self.fixed_bucket_steps!r}")


class _Reader:
    """Order + collate for one rank, shared by the caller's thread and the prefetch thread.

    Holds no reference to the FeatureLoader, so a loader dropped without ``close()`` is
    still collected and its ``__del__`` stops the thread.
    """

    def __init__(self, decoder: _Decoder, *, buckets: list[Bucket], members: list[torch.Tensor], batch_size: int,
                 rank: int, world_size: int, seed: int, pool_size: int, pin_memory: bool = False,
                 fixed_bucket_steps: int = 0, bucket_run: int = 1) -> None:
        self.decoder, self.batch_size, self.rank, self.seed = decoder, batch_size, rank, seed
        self.world_size = world_size
        self.buckets, self.members = buckets, members
        self.num_samples = decoder.index.num_samples
        self.global_batch = batch_size * world_size
        self.fixed_bucket_steps, self.bucket_run = fixed_bucket_steps, bucket_run
        self.steps_per_epoch = (fixed_bucket_steps * bucket_run * len(buckets) if fixed_bucket_steps
                                else sum(len(m) // (self.global_batch * bucket_run) * bucket_run for m in members))
        self.pool_size, self.pin_memory = pool_size, pin_memory
        self._plan: tuple[int, EpochPlan | None] = (-1, None)
        self._pool: _BufferPool | None = None

    def plan(self, epoch: int) -> EpochPlan:
        cached_epoch, plan = self._plan
        if cached_epoch != epoch or plan is None:
            plan = plan_epoch(self.members, global_batch=self.global_batch, seed=self.seed, epoch=epoch,
                              fixed_steps=self.fixed_bucket_steps, run=self.bucket_run)
            self._plan = (epoch, plan)
        return plan

    def permutation(self, epoch: int) -> torch.Tensor:
        if len(self.members) == 1 and not self.fixed_bucket_steps and self.bucket_run == 1:
            return self.plan(epoch).perms[0]  # every sample (the tail past whole steps too)
        plan = self.plan(epoch)
        g = self.global_batch
        return torch.cat([plan.perms[b][k * g:(k + 1) * g] for b, k in zip(plan.order, plan.within, strict=True)])

    def bucket_at(self, epoch: int, step: int) -> Bucket:
        return self.buckets[self.plan(epoch).order[step]]

    def indices(self, epoch: int, step: int) -> list[int]:
        return rank_slice(self.plan(epoch), step, rank=self.rank, batch_size=self.batch_size,
                          world_size=self.world_size)[1]

    def load(self, epoch: int, step: int) -> dict[str, torch.Tensor]:
        b, indices = rank_slice(self.plan(epoch), step, rank=self.rank, batch_size=self.batch_size,
                                world_size=self.world_size)
        shape = self.buckets[b].latent_shape
        if self._pool is None:
            pin = _pin(self.pin_memory)
            self._pool = _BufferPool(
                lambda s: self.decoder.empty_batch(self.batch_size, s, pin_memory=self.pin_memory), self.pool_size,
                make_latents=lambda s: torch.empty((self.batch_size, *s), dtype=torch.float32, pin_memory=pin))
        buffers = self._pool.get(shape)
        filled = buffers.clean_fill()
        filled = list(filled) if filled is not None else None
        self.decoder.batch(indices, out=buffers.tensors, filled=filled, latent_shape=shape)
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
    """Infinite iterator of static-shape batches for one rank; see training/data/__init__.py.

    Yields ``{"latents": f32 [B,C,H,W] (unscaled), "text": f32 [B,N,D] zero-padded,
    "text_mask": i64 [B,N]}``; with buckets, [H, W] is the step's bucket (one per batch,
    the same on every rank: ``bucket_at``). ``state_dict()`` is the position after the last batch
    *returned* (prefetched batches do not count), so a restored loader continues exactly.
    Call ``close()`` (or use it as a context manager) to stop the prefetch thread.
    """

    def __init__(self, source: str | os.PathLike[str] | FeatureIndex, *, batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, cache_dir: str | Path | None = None,
                 prefetch: int = 4, verify: bool = True, endpoint_url: str | None = None,
                 pin_memory: bool = False, fixed_bucket_steps: int = 0, bucket_run: int = 1,
                 text_dtype: str = "fp32") -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.index = source if isinstance(source, FeatureIndex) else FeatureIndex.load(source, endpoint_url)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.global_batch = batch_size * world_size
        if not isinstance(bucket_run, int) or bucket_run < 1:
            raise ValueError(f"bucket_run: must be an integer >= 1, got {bucket_run!r}")
        # one shape per optimizer step matters only with several shapes; a single bucket keeps
        # the micro-batch order it always had
        bucket_run = bucket_run if len(self.index.buckets) > 1 else 1
        step_samples = self.global_batch * bucket_run
        self.buckets, members, dropped = kept_buckets(self.index, step_samples)
        if not self.buckets:
            what = "" if len(self.index.buckets) == 1 else " in every bucket"
            raise UserError(f"{self.index.source}: {self.index.num_samples} samples is less than one global "
                            f"batch ({batch_size} x {world_size} ranks x {bucket_run} micro-batches){what}; "
                            "lower data.batch_size or add data")
        if dropped and rank == 0:
            log.warning("%s: %d buckets with fewer samples than one global batch (%d) are not trained on: %s",
                        self.index.source, len(dropped), step_samples,
                        ", ".join(f"{b.name} ({b.samples})" for b in dropped))
        self.dropped_buckets = dropped
        self.prefetch, self.pin_memory = prefetch, pin_memory
        if text_dtype not in TEXT_DTYPES:
            raise ValueError(f"text_dtype: {text_dtype!r} is not one of {', '.join(TEXT_DTYPES)}")
        self._decoder = _Decoder(self.index, cache_dir, verify, text_dtype=TEXT_DTYPES[text_dtype])
        self._warned_null = False
        if self.index.is_s3:
            self._decoder.prefetch_all()
        self._reader = _Reader(self._decoder, buckets=self.buckets, members=members, batch_size=batch_size,
                               rank=rank, world_size=world_size, seed=seed, pool_size=prefetch + 4,
                               pin_memory=pin_memory, fixed_bucket_steps=fixed_bucket_steps, bucket_run=bucket_run)
        self.steps_per_epoch = self._reader.steps_per_epoch
        self.epoch, self.step = 0, 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    @classmethod
    def from_config(cls, cfg: DataConfig, *, rank: int = 0, world_size: int = 1,
                    bucket_run: int = 1) -> FeatureLoader:
        """``bucket_run``: micro-batches per optimizer step (the loop passes grad_accum_steps)."""
        source: str | FeatureIndex = cfg.path
        if cfg.multi_scale:
            source = FeatureIndex.load(cfg.path)
            if not source.bucketed:
                raise UserError(f"data.multi_scale: true (Sana's multi-scale training), but data.path {cfg.path} "
                                "holds square crops of one shape; re-run python -m training.precompute with "
                                "--buckets 512|1024|2048 (its default), or set data.multi_scale: false")
        return cls(source, batch_size=cfg.batch_size, rank=rank, world_size=world_size, seed=cfg.seed,
                   cache_dir=cfg.cache_dir, prefetch=cfg.prefetch, verify=cfg.verify, pin_memory=cfg.pin_memory,
                   fixed_bucket_steps=cfg.fixed_bucket_steps, bucket_run=bucket_run, text_dtype=cfg.text_dtype)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's order of samples: a function of (seed, epoch) only. One bucket: all
        samples; several: the global batches of the epoch's steps, concatenated."""
        return self._reader.permutation(epoch)

    def bucket_at(self, epoch: int, step: int) -> Bucket:
        """The bucket of (epoch, step): the same on every rank."""
        return self._reader.bucket_at(epoch, step)

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
        """The empty caption ``[N, D]`` float32 and its own mask ``[N]`` int64.

        Precompute stores the full encoding (every padding position's row too: what Sana's
        dropout swaps in, training/objective.py) with its mask. An older directory stores the
        real rows only: they are zero-padded, and a warning says dropped captions then see
        zeros past ``<bos>`` where Sana's null encoding has the padding rows."""
        path = self.index.fetch(NULL_CAPTION, self._decoder.cache_dir)
        try:
            stored = st_load(path.read_bytes())
        except FileNotFoundError:
            raise UserError(f"{self.index.source}/{NULL_CAPTION}: missing; re-run the precompute merge step") from None
        except Exception as exc:
            raise _corrupt(str(path), str(exc)) from None
        text = stored.get("text")
        n_max, dim = self.index.max_text_tokens, self.index.text_dim
        if text is None or text.ndim != 2 or text.shape[1] != dim or not 1 <= text.shape[0] <= n_max:
            raise _corrupt(str(path), f"text shape {None if text is None else list(text.shape)}, "
                                      f"expected [1..{n_max}, {dim}]")
        if "mask" in stored:
            mask = stored["mask"].to(torch.int64)
            if text.shape[0] != n_max or tuple(mask.shape) != (n_max,):
                raise _corrupt(str(path), f"text {list(text.shape)} / mask {list(mask.shape)}, expected "
                                          f"[{n_max}, {dim}] / [{n_max}]")
            return text.float(), mask
        n = text.shape[0]
        padded = torch.zeros(n_max, dim)
        padded[:n] = text.float()
        mask = torch.zeros(n_max, dtype=torch.int64)
        mask[:n] = 1
        if n < n_max and not self._warned_null:
            self._warned_null = True
            log.warning("%s/%s holds the empty caption's %d real row(s) only (an older precompute): dropped "
                        "captions see zeros where Sana's null encoding has the padding rows; re-run precompute "
                        "--merge-only (same flags) to store the full encoding", self.index.source, NULL_CAPTION, n)
        return padded, mask


def kept_buckets(index: FeatureIndex, global_batch: int) -> tuple[list[Bucket], list[torch.Tensor], list[Bucket]]:
    """(buckets trained on, their members, buckets dropped): a bucket with fewer samples
    than one global batch cannot fill a static-shape step, so it is left out."""
    members = index.bucket_members()
    kept = [b for b in index.buckets.values() if b.samples >= global_batch]
    dropped = [b for b in index.buckets.values() if b.samples < global_batch]
    return kept, [members[b.name] for b in kept], dropped
