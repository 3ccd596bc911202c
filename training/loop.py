"""The one training loop, shared by every backend, in four layers (CONTRIBUTING.md, "One loop").

``run`` is what every entrypoint does around it (init the backend, the failure semantics of
training/failure/, the summary line, close), ``train`` owns the run (build, resume, step, log,
save), ``train_step`` one optimizer step (micro-batches, clip, update, schedule),
``forward_backward`` one micro-batch. Everything
accelerator-specific is a ``Backend`` call; nothing here reads a device value except through
``backend.on_host`` every ``log_every`` steps, so an XLA step stays one graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.backends.base import Backend, Batch
from training.checkpoint.checkpointer import Checkpointer
from training.checkpoint.train_state import TrainState
from training.config import TrainConfig
from training.data.index import FeatureIndex
from training.data.input_pipeline import LoaderPosition
from training.data.loader import FeatureLoader
from training.data.text_features import warn_if_unexpected
from training.data.text_trim import BatchTokens, StepTokens, TokenMeter, count_step, trimmed
from training.errors import UserError
from training.evaluation.validation import build_validation
from training.failure.board import FailureBoard, PeerWatch
from training.failure.leave import finish, leave, peer_failed
from training.failure.preemption import StopRequest
from training.metrics import MetricsLogger
from training.model import flops, lora
from training.model.build import ModelConfig, build_model
from training.objective import RectifiedFlow
from training.observability import build_sinks
from training.optim.ema import EMA
from training.optim.factory import OptimConfig, build_scheduler, optimizer_factory
from training.provenance import run_provenance

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class TrainResult:
    """What a run did (bench reads it)."""

    steps: int  # optimizer steps done by this call (not counting resumed ones)
    final_loss: float | None  # last logged loss (None if nothing was logged)
    step_times: list[float]  # host wall seconds per optimizer step, after each step's sync
    samples_per_step: int  # global samples per optimizer step
    checkpoint: Path | None  # last checkpoint written (or resumed from), if any
    stopped_by: int | None = None  # the signal that stopped the run early (SIGTERM, SIGUSR1), if any
    model: nn.Module | None = None  # the prepared model, for callers that go on using it (tests)
    #: per optimizer step, this rank's caption/image tokens and FLOPs (training/data/text_trim.py)
    step_tokens: list[StepTokens] = dataclasses.field(default_factory=list)


def forward_backward(model: nn.Module, objective: RectifiedFlow, batch: Batch, backend: Backend,
                     scale: float) -> torch.Tensor:
    """Loss of one micro-batch, backpropagated with weight ``scale``; returns it detached."""
    with backend.autocast():
        loss = objective(model, batch)
    (loss * scale).backward()
    return loss.detach()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, objective: RectifiedFlow,
               batches: Iterator[Batch], backend: Backend, cfg: OptimConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``grad_accum_steps`` micro-batches -> (mean loss, grad norm),
    both device tensors. Only the last micro-batch all-reduces gradients."""
    optimizer.zero_grad(set_to_none=True)
    n = cfg.grad_accum_steps
    losses = []
    for i in range(n):
        sync_grads = contextlib.nullcontext() if i == n - 1 else backend.no_sync(model)
        with sync_grads:
            losses.append(forward_backward(model, objective, next(batches), backend, 1.0 / n))
    grad_norm = backend.clip_and_step(model, optimizer, cfg.max_grad_norm)
    scheduler.step()
    return torch.stack(losses).mean(), grad_norm


def check_compatible(model_cfg: ModelConfig, model: nn.Module, index: FeatureIndex) -> None:
    """Fail before step 0 when the features cannot feed this transformer."""
    config = model.config
    channels = index.latent_shape[0]
    if config.in_channels != channels:
        raise UserError(f"model.preset: {model_cfg.preset} takes {config.in_channels} latent channels, "
                        f"data.path {index.source} has {channels}; pick a matching preset or features")
    if config.caption_channels != index.text_dim:
        raise UserError(f"model.preset: {model_cfg.preset} takes caption_channels={config.caption_channels}, "
                        f"data.path {index.source} has text_dim={index.text_dim}; pick a matching preset "
                        "or set model.overrides.caption_channels")
    _check_sample_size(model_cfg, config, index)


#: latent area / sample_size**2 that SanaPipeline's aspect-ratio bins span (ASPECT_RATIO_512_BIN
#: in diffusers pipelines/pixart_alpha/pipeline_pixart_alpha.py: 0.90 (352x672) to 1.0)
SAMPLE_AREA_RANGE = (0.85, 1.05)


def _check_sample_size(model_cfg: ModelConfig, config: Any, index: FeatureIndex) -> None:
    """The latents must match the transformer's ``sample_size``: SanaPipeline picks its
    resolution bins by it (diffusers pipelines/sana/pipeline_sana.py ``__call__``:
    sample_size 128/64/32/16 -> ASPECT_RATIO_4096/2048/1024/512_BIN), so a model trained on
    other latents is sampled at a resolution it never saw. The test-only ``tiny`` preset
    (random init) warns instead: its sample_size is nominal and tests feed it any size."""
    _, h, w = index.latent_shape
    size = int(config.sample_size)
    ratio = h * w / size**2
    if SAMPLE_AREA_RANGE[0] <= ratio <= SAMPLE_AREA_RANGE[1]:
        return
    msg = (f"data.path {index.source} has {h}x{w} latents but the model's sample_size is {size} "
           f"({size}x{size}; SanaPipeline bins its resolutions by it); use features made at that "
           "resolution, or for a from-scratch model set model.overrides.sample_size to the latent size")
    if model_cfg.preset == "tiny" and not model_cfg.pretrained:
        log.warning("%s", msg)
        return
    raise UserError(msg)


def _throughput_fn(cfg: TrainConfig, backend: Backend, model: nn.Module):
    """(per-step token counter, window -> {mfu, mfu_padded, tokens per sample}).

    FLOPs come from the batches each step actually ran (their latent size and caption
    length, training/data/text_trim.py ``TokenMeter``), rank 0's batches standing for all ranks
    as its loss does: ``mfu`` counts real caption tokens only (mask sums), ``mfu_padded``
    the caption length computed (trimmed or padded), the figure before issue 17."""
    kwargs = dict(model.config)
    accel = backend.describe().get("accelerator")

    def per_sample(hw: tuple[int, int], computed: int, real: float | None) -> float:
        if cfg.lora.enabled:  # frozen base: no weight gradients, fewer input gradients (training/model/lora.py)
            return lora.train_flops_per_sample(kwargs, computed, hw, cfg=cfg.lora, real_text_tokens=real)
        return flops.train_flops_per_sample(kwargs, computed, hw, real_text_tokens=real)

    def count(parts: list[BatchTokens]) -> StepTokens:
        return count_step(parts, per_sample, patch_size=int(model.config.patch_size))

    def rates(window: StepTokens, sps_per_device: float) -> dict[str, float | None]:
        return {"mfu": flops.mfu(window.per_sample("useful_flops"), sps_per_device, accel, cfg.precision),
                "mfu_padded": flops.mfu(window.per_sample("computed_flops"), sps_per_device, accel, cfg.precision),
                "tokens_per_sample": window.per_sample("image_tokens") + window.per_sample("computed_text_tokens"),
                "text_tokens_real": window.per_sample("real_text_tokens"),
                "text_tokens_computed": window.per_sample("computed_text_tokens")}

    return count, rates


def train(cfg: TrainConfig, backend: Backend) -> TrainResult:
    """Train to ``cfg.max_steps`` optimizer steps (resuming per ``cfg.checkpoint.resume``)."""
    torch.manual_seed(cfg.seed)  # same on every rank: init and the objective's global draw
    # bucket_run: the micro-batches of one optimizer step share a bucket (one shape per step graph)
    loader = FeatureLoader.from_config(cfg.data, rank=backend.rank, world_size=backend.world_size,
                                       bucket_run=cfg.optim.grad_accum_steps)
    raw = lora.apply_lora(build_model(cfg.model), cfg.lora)  # frozen base + adapters before any wrapping
    check_compatible(cfg.model, raw, loader.index)
    warn_if_unexpected(cfg.model.pretrained, raw, loader.index.text_conditioning, source=loader.index.source,
                       enabled=backend.is_main)
    model = backend.prepare_model(raw)
    inner = backend.unwrap(model)
    optimizer = backend.build_optimizer(model, optimizer_factory(cfg.optim, inner))
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=cfg.max_steps)
    ema = EMA(inner, cfg.ema) if cfg.ema.enabled else None
    null_text, null_mask = loader.null_caption()
    objective = RectifiedFlow(cfg.objective, vae_scaling_factor=loader.index.vae_scaling_factor,
                              null_text=null_text.to(backend.device), null_mask=null_mask.to(backend.device),
                              rank=backend.rank, world_size=backend.world_size)
    provenance = run_provenance(text_conditioning=loader.index.text_conditioning.to_dict())
    ckpt = Checkpointer(cfg.checkpoint, backend, output_dir=cfg.output_dir, run_config=cfg.to_dict(),
                        provenance=provenance, frozen_from=cfg.model.pretrained)
    state = TrainState()
    last_ckpt = ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler, ema=ema, loader=loader,
                             state=state)
    global_batch = cfg.data.batch_size * backend.world_size * cfg.optim.grad_accum_steps
    count_tokens, rates_of = _throughput_fn(cfg, backend, inner)
    # Prometheus gauges and the MLflow run (training/observability): rank 0 only, empty when off.
    sinks = build_sinks(prometheus=cfg.prometheus, tracking=cfg.tracking, output_dir=cfg.output_dir,
                        is_main=backend.is_main, start_step=state.step, run_config=cfg.to_dict(),
                        provenance=provenance)
    metrics = MetricsLogger(cfg.output_dir, enabled=backend.is_main, tensorboard=cfg.tensorboard,
                            total_steps=cfg.max_steps, start_step=state.step, sinks=sinks)
    try:
        validation = build_validation(cfg.validation, backend, loader=loader, model=inner, output_dir=cfg.output_dir,
                                      metrics=metrics, flow_shift=cfg.objective.flow_shift, lora=cfg.lora)
    except BaseException:
        metrics.close("FAILED")  # the exporter's port and discovery file, the MLflow run
        raise
    if backend.is_main:
        log.info("training %s on %s from step %d to %d, global batch %d", cfg.model.preset,
                 backend.describe(), state.step, cfg.max_steps, global_batch)
    step_times: list[float] = []
    final_loss: list[float] = []
    window_start, window_steps = time.perf_counter(), 0
    checkpoint_wait = 0.0  # seconds the loop waited on checkpoint saves in this logging window

    def report(step: int, seconds: float, steps: int, lr: float, samples_seen: int, window: StepTokens,
               checkpoint_stall: float, loss: float, grad_norm: float) -> None:
        sps = global_batch * steps / seconds
        final_loss[:] = [loss]
        peak = backend.peak_memory_bytes()
        rates = rates_of(window, sps / backend.world_size)
        metrics.log(step, {"loss": loss, "grad_norm": grad_norm, "lr": lr, "samples_per_s": sps,
                           "tokens_per_s": sps * rates.pop("tokens_per_sample"), **rates,
                           "step_time_s": seconds / steps, "samples_seen": samples_seen,
                           "checkpoint_stall_s": checkpoint_stall,
                           "peak_mem_gib": None if peak is None else peak / 2**30})

    # Caption padding cut per batch on the host, before the device copy (training/data/text_trim.py).
    meter = TokenMeter()
    trim = cfg.text_trim.lengths if backend.trims_text and cfg.text_trim.enabled else None
    # The backend may read ahead (a side-stream copy on CUDA): checkpoints save the position
    # after the last batch a step used, not the loader's own (training/data/input_pipeline.py).
    position = LoaderPosition(loader)
    batches = position.delivered(backend.device_batches(
        trimmed(position.pulled(loader), lengths=trim, floor=int(null_mask.sum()), meter=meter)))
    step_tokens: list[StepTokens] = []
    stopped_by = None
    stop = StopRequest(backend)
    ended = "FAILED"  # how the run ended, for the MLflow run (FINISHED / KILLED below)
    # The stop-signal handler stays in place until the cleanup below is done, failure path
    # included: torchrun SIGTERMs the other workers as soon as one exits, and the default
    # action would end a rank before it said why it stops (training/failure/).
    with stop:
        try:
            while state.step < cfg.max_steps:
                t0 = time.perf_counter()
                loss, grad_norm = train_step(model, optimizer, scheduler, objective, batches, backend, cfg.optim)
                if ema is not None:
                    ema.update(inner, state.step + 1)
                backend.sync()
                state.step += 1
                state.samples_seen += global_batch
                step_times.append(time.perf_counter() - t0)
                step_tokens.append(count_tokens(meter.take(cfg.optim.grad_accum_steps)))
                window_steps += 1
                metrics.advance(state.step)
                validation.maybe_run(state.step, model, ema)
                if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
                    now = time.perf_counter()
                    # Everything but the two device tensors is bound now: XLA runs this closure later.
                    backend.on_host(functools.partial(report, state.step, now - window_start, window_steps,
                                                      scheduler.get_last_lr()[0], state.samples_seen,
                                                      sum(step_tokens[-window_steps:], StepTokens()),
                                                      checkpoint_wait),
                                    loss, grad_norm)
                    window_start, window_steps, checkpoint_wait = now, 0, 0.0
                # Every step: any rank's stop signal, agreed one step later (training/failure/preemption.py).
                stopped_by = stop.poll()
                save_started = time.perf_counter()
                saved = ckpt.maybe_save(step=state.step, model=model, optimizer=optimizer, scheduler=scheduler,
                                        ema=ema, loader=position, state=state,
                                        force=state.step == cfg.max_steps or stopped_by is not None)
                checkpoint_wait += time.perf_counter() - save_started
                last_ckpt = saved or last_ckpt
                if stopped_by is not None:
                    break
            # Success only: these wait on every rank (training/failure/__init__.py).
            stop.finish()
            # XLA runs on_host reads at the next sync; after the last step only this one comes.
            backend.barrier()
            ckpt.close()
            ended = "FINISHED" if stopped_by is None else "KILLED"
        except BaseException as exc:
            # Leave the collectives: nothing here waits on another rank, the save in flight is
            # abandoned (never committed half), the caller reports and exits.
            ckpt.abandon()
            exc.add_note(f"(raised after training step {state.step} of {cfg.max_steps})")
            raise
        finally:
            loader.close()
            metrics.close(ended)
    return TrainResult(steps=len(step_times), final_loss=final_loss[0] if final_loss else None,
                       step_times=step_times, samples_per_step=global_batch, checkpoint=last_ckpt,
                       model=model, stopped_by=stopped_by, step_tokens=step_tokens)


def run(cfg: TrainConfig, backend: Backend, summary: Callable[[], dict[str, Any]] | None = None, *,
        reset_logging: bool = False) -> None:
    """Init the backend, train, print a one-line JSON summary on rank 0, close.

    In a distributed run (torchrun's WORLD_SIZE > 1) a failure on any rank ends every rank
    within seconds, the failed one first with its traceback (training/failure/): this
    function then never returns.

    Args:
        summary: extra fields for the summary line (e.g. Trainium's compile counts).
        reset_logging: replace the root logger's handlers. torch-xla's init has already given
            it a WARNING handler, which would make basicConfig a no-op and hide the
            step/loss/checkpoint log; elsewhere existing handlers (a caller's) are kept.

    Raises:
        SystemExit: 128 + signal number when SIGTERM/SIGUSR1 stopped the run early.
    """
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    board: FailureBoard | None = None
    watch: PeerWatch | None = None
    try:
        backend.init()
        logging.basicConfig(level=logging.INFO if backend.is_main else logging.WARNING,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr,
                            force=reset_logging)
        if distributed:
            board = FailureBoard.open(cfg.output_dir, rank=backend.rank, broadcast=backend.broadcast_object)
            watch = PeerWatch(board, lambda failure: peer_failed(failure, rank=backend.rank))
        result = train(cfg, backend)
    except BaseException as exc:
        if not distributed:
            backend.close()
            raise
        # No collective, no teardown that could wait on a peer: report, mark, exit.
        leave(exc, rank=int(os.environ.get("RANK", backend.rank)), board=board)
    if watch is not None:
        watch.stop()
    try:
        if backend.is_main:
            print(json.dumps({"steps": result.steps, "final_loss": result.final_loss,
                              "checkpoint": str(result.checkpoint) if result.checkpoint else None,
                              "output_dir": cfg.output_dir, **(summary() if summary else {})}), flush=True)
    finally:
        backend.close()
    code = 0 if result.stopped_by is None else 128 + result.stopped_by  # Slurm asked us to stop: say so
    if distributed:
        del result  # (the model: its process-group references go with it where torch lets them)
        finish(code)  # no interpreter finalisation beside gloo's threads (training/failure/leave.py)
    if code:
        raise SystemExit(code)
