"""``python -m training.bench``: training throughput, step-time spread, memory and MFU -> JSON.

    python -m training.bench --backend gpu --config training/configs/sana-600m-512.yaml \\
        --steps 50 --warmup 10 --synthetic --instance-type ml.p5.48xlarge --out result.json
    python -m training.bench --overhead          # loop-vs-bare-step overhead check (CPU)
    python -m training.bench --config training/configs/sana-600m-512.yaml --synthetic \
        --compare-reference --warmup 3 --steps 5 --repetitions 4 --out cmp.json  # vs diffusers-style step
    python -m training.bench --memory-table      # per-GPU memory, every GPU config x mesh x checkpointing

The measured step is the production one: bench calls ``training.loop.train`` (the same loop,
objective, backend and data loader as ``python -m training.gpu`` / ``training.trainium``)
for ``warmup + steps`` optimizer steps and only times the last ``steps``. A benchmark loop
of its own would measure something nobody trains with.

Timing: the backend's ``sync()`` (end of each optimizer step) is wrapped so that at the end
of the warm-up and at the end of the last step the device is drained (CUDA synchronize /
XLA wait_device_ops) and the clock read. The timed window is exactly the device time of
``steps`` steps, yet the steps inside it keep their normal host/device overlap (no sync per
step). The p50/p90 come from the loop's per-step host times, which in steady state run at
the device's pace (the launch queue / XLA pipeline throttles the host).

Throughput is reported per accelerator (per rank), per instance and in total; MFU uses
``training.model.flops`` (analytic model x samples/s per accelerator / published dense peak) on the
real caption tokens of the timed steps' batches, ``mfu_padded`` on the tokens computed
(training/data/text_trim.py). On the GPU backend the per-GPU memory estimate (training/perf/memory.py)
is printed and checked before anything is built. ``--compare-reference`` times our step and
training/perf/reference_step.py's diffusers-style step interleaved in one process.
The JSON schema is ``training.perf.bench_result.BenchResult``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from training.data.text_trim import StepTokens
from training.errors import UserError, exits_cleanly
from training.model import flops
from training.perf.bench_result import BenchResult
from training.perf.timing import drain

log = logging.getLogger(__name__)

#: DC-AE f32: one latent pixel = 32 image pixels (Sana's VAE), for the nominal resolution
VAE_DOWNSAMPLE = 32
#: caption length for synthetic features: Sana's Gemma-2 max_length (first token + last 299)
DEFAULT_TEXT_TOKENS = 300


# ----- the clock around the loop ------------------------------------------------------------

@dataclasses.dataclass
class StepClock:
    """Device-synchronised timestamps at the end of the warm-up and of the last step.

    ``install`` wraps ``backend.sync`` on that instance only; the loop is unchanged.
    """

    warmup: int
    total: int
    steps_seen: int = 0
    t_start: float | None = None
    t_end: float | None = None
    compiles_at_start: dict[str, Any] | None = None
    compiles_at_end: dict[str, Any] | None = None

    def install(self, backend: Any) -> None:
        inner_sync = backend.sync
        stats: Callable[[], dict[str, Any]] | None = getattr(backend, "compile_stats", None)

        def sync() -> None:
            inner_sync()
            self.steps_seen += 1
            if self.steps_seen in (self.warmup, self.total):
                drain(backend.device)
                now = time.perf_counter()
                # XLA graph compiles (Trainium), dynamo graphs with gpu.compile (None when off)
                snapshot = stats() if stats is not None else None
                if self.steps_seen == self.warmup:
                    self.t_start, self.compiles_at_start = now, snapshot
                if self.steps_seen == self.total:
                    self.t_end, self.compiles_at_end = now, snapshot

        backend.sync = sync


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ----- building the run ---------------------------------------------------------------------

def make_backend(name: str, cfg: Any) -> Any:
    """The backend the matching entrypoint would build (training.gpu / training.trainium)."""
    if name == "gpu":
        from training.backends.gpu import GpuBackend

        return GpuBackend(cfg.gpu, precision=cfg.precision)
    if name == "trainium":
        from training.backends.neuron import NeuronBackend

        return NeuronBackend(cfg.trainium, precision=cfg.precision)
    raise UserError(f"--backend {name}: must be 'gpu' or 'trainium'")


def synthetic_spec(model_kwargs: dict[str, Any], text_tokens: int, captions: Any = None) -> dict[str, Any]:
    """Feature shapes that feed this transformer: [C, S, S] latents, caption_channels text,
    and the real caption lengths (training/data/caption_lengths.py ``CaptionLengths``; None
    or ``full``: every caption at the padded ``text_tokens``)."""
    from training.data.caption_lengths import clipped

    size = int(model_kwargs.get("sample_size", 32))
    spec: dict[str, Any] = {"latent_shape": (int(model_kwargs.get("in_channels", 32)), size, size),
                            "text_dim": int(model_kwargs.get("caption_channels", 2304)),
                            "max_text_tokens": int(text_tokens)}
    lengths = getattr(captions, "lengths", None)
    if lengths:
        spec["text_lengths"] = clipped(lengths, int(text_tokens))
    else:
        spec["text_tokens"] = (int(text_tokens), int(text_tokens))
    return spec


def resolve_caption_lengths(choice: str, cfg: Any) -> Any:
    """``--caption-lengths``: ``auto`` = the config's ``data.path`` when it is a local feature
    directory (real captions: the lengths training will see), else ``full``."""
    from training.data import caption_lengths

    if choice == "auto":
        path = Path(str(cfg.data.path))
        choice = str(path) if (path / "index.json").is_file() else caption_lengths.FULL
    return caption_lengths.load(choice)


def ensure_synthetic_features(root: Path, spec: dict[str, Any], num_samples: int, *, write: bool) -> Path:
    """A synthetic feature directory for ``spec`` under ``root`` (written once per node)."""
    from training.data.shards import INDEX, write_synthetic_features

    key = hashlib.sha256(json.dumps([spec, num_samples], sort_keys=True, default=list).encode()).hexdigest()[:12]
    path = root / f"synthetic-{key}"
    if write and not (path / INDEX).is_file():
        tmp = root / f".tmp-synthetic-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_synthetic_features(tmp, num_samples=num_samples, seed=0, **spec)
        try:
            tmp.rename(path)
        except OSError:  # another process on this node won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def versions() -> dict[str, str]:
    """Versions that decide the numbers (strings; absent packages are left out)."""
    out = {"python": platform.python_version()}
    for module in ("torch", "diffusers", "torch_xla", "torch_neuronx", "neuronxcc"):
        try:
            mod = __import__(module)
        except Exception:  # noqa: BLE001 - any import failure means "not part of this run"
            continue
        out[module] = str(getattr(mod, "__version__", "unknown"))
    try:
        import torch

        if torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
    except ImportError:
        pass
    return out


def device_kind(backend: Any, info: dict[str, Any]) -> str:
    if backend.device.type == "cuda":
        return "cuda"
    if backend.device.type == "xla":
        return "neuron" if info.get("pjrt_device") == "NEURON" else "xla-cpu"
    return "cpu"


def resolve_accelerator(instance_type: str, info: dict[str, Any]) -> tuple[str, str | None]:
    """(accelerator name, note). The backend's own report wins when it is a known key (it
    measured the device); else the instance type's layout; else what the backend said."""
    reported = str(info.get("accelerator") or info.get("device") or "unknown")
    from_instance = flops.accelerator_for_instance(instance_type) if instance_type != "local" else None
    if reported in flops.ACCELERATORS:
        note = None
        if from_instance and from_instance != reported:
            note = f"backend reports {reported}, {instance_type} implies {from_instance}; used {reported}"
        return reported, note
    if from_instance:
        return from_instance, None
    return reported, None


# ----- the benchmark -----------------------------------------------------------------------

def run_bench(cfg: Any, backend: Any, *, steps: int, warmup: int, instance_type: str = "local",
              data_label: str | None = None, command: str = "", notes: str = "",
              memory_estimate: dict[str, Any] | None = None, caption_lengths: str | None = None
              ) -> BenchResult | None:
    """Train ``warmup + steps`` steps through ``training.loop.train`` and measure the last
    ``steps``. ``backend`` must be initialised. Returns the result on rank 0, None elsewhere."""
    from training.loop import train

    if steps < 1 or warmup < 1:
        raise UserError("--steps and --warmup: must both be >= 1 (the first step allocates and compiles)")
    cfg.max_steps = warmup + steps
    cfg.checkpoint.enabled = False  # no resume from an earlier run, no save (a 600M save is ~7 GB)
    cfg.checkpoint.resume = "none"
    clock = StepClock(warmup=warmup, total=warmup + steps)
    clock.install(backend)
    result = train(cfg, backend)
    if not backend.is_main:
        return None
    if result.steps != warmup + steps or clock.t_start is None or clock.t_end is None:
        raise RuntimeError(f"bench: the loop ran {result.steps} steps, expected {warmup + steps}")
    return build_result(cfg, backend, seconds=clock.t_end - clock.t_start, steps=steps, warmup=warmup,
                        step_times=result.step_times[warmup:], samples_per_step=result.samples_per_step,
                        window=sum(result.step_tokens[warmup:], StepTokens()),  # the timed steps' batches
                        final_loss=result.final_loss, compiles=(clock.compiles_at_start, clock.compiles_at_end),
                        instance_type=instance_type, data_label=data_label, command=command, notes=notes,
                        memory_estimate=memory_estimate, caption_lengths=caption_lengths)


def build_result(cfg: Any, backend: Any, *, seconds: float, steps: int, warmup: int, step_times: Sequence[float],
                 samples_per_step: int, window: StepTokens, final_loss: float | None,
                 compiles: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None),
                 instance_type: str = "local", data_label: str | None = None, command: str = "",
                 notes: str = "", memory_estimate: dict[str, Any] | None = None,
                 reference: dict[str, Any] | None = None, caption_lengths: str | None = None) -> BenchResult:
    """The result of ``steps`` timed steps (``seconds`` device-synchronised wall time) that ran
    on the batches counted in ``window``."""
    from training.data.index import FeatureIndex

    timed = list(step_times)
    info = backend.describe()
    index = FeatureIndex.load(cfg.data.path)
    _, lat_h, lat_w = index.latent_shape
    flops_per_sample = window.per_sample("useful_flops")
    flops_computed = window.per_sample("computed_flops")
    accelerator, accel_note = resolve_accelerator(instance_type, info)
    per_node = int(info.get("per_node") or os.environ.get("LOCAL_WORLD_SIZE", 1))
    if backend.world_size % per_node:
        per_node = backend.world_size
    nodes = backend.world_size // per_node
    total = samples_per_step * steps / seconds
    per_accel = total / backend.world_size
    peak = flops.peak_tflops(accelerator, cfg.precision)
    spec = flops.instance_spec(instance_type) if instance_type != "local" else None
    note_parts = [n for n in (notes, accel_note) if n]
    if spec and per_node != spec.devices:
        note_parts.append(f"ran {per_node} ranks per node; {instance_type} has {spec.devices} devices, so "
                          "per-instance throughput and cost understate a full node")
    compile_start, compile_end = compiles
    compile_end = compile_end or {}
    return BenchResult(
        backend=backend.name,
        device_kind=device_kind(backend, info),
        instance_type=instance_type,
        accelerator=accelerator,
        accelerators_per_node=per_node,
        nodes=nodes,
        world_size=backend.world_size,
        model_preset=cfg.model.preset,
        model_overrides=dict(cfg.model.overrides),
        resolution_px=int(lat_h) * VAE_DOWNSAMPLE,
        latent_hw=[int(lat_h), int(lat_w)],
        text_tokens=int(index.max_text_tokens),
        precision=cfg.precision,
        per_device_batch=cfg.data.batch_size,
        grad_accum_steps=cfg.optim.grad_accum_steps,
        global_batch=samples_per_step,
        data=data_label or str(cfg.data.path),
        bytes_per_sample=float(index.bytes_per_sample) if index.bytes_per_sample else None,
        warmup_steps=warmup,
        steps_timed=steps,
        timed_seconds=seconds,
        step_time_p50_s=percentile(timed, 50),
        step_time_p90_s=percentile(timed, 90),
        step_time_mean_s=seconds / steps,
        samples_per_s_total=total,
        samples_per_s_per_accelerator=per_accel,
        samples_per_s_per_instance=total / nodes,
        train_flops_per_sample=flops_per_sample,
        peak_tflops_per_accelerator=peak,
        peak_source=flops.ACCELERATORS[accelerator].source if peak is not None else None,
        mfu=flops.mfu(flops_per_sample, per_accel, accelerator, cfg.precision),
        mfu_padded=flops.mfu(flops_computed, per_accel, accelerator, cfg.precision),
        train_flops_per_sample_computed=flops_computed,
        text_tokens_real=window.per_sample("real_text_tokens"),
        text_tokens_computed=window.per_sample("computed_text_tokens"),
        memory_estimate=memory_estimate,
        peak_memory_bytes=backend.peak_memory_bytes(),
        compile_count=compile_end.get("compiles"),
        compile_seconds=compile_end.get("compile_seconds"),
        compiles_in_timed_steps=(compile_end["compiles"] - compile_start["compiles"]
                                 if compile_end and compile_start else None),
        graph_breaks=compile_end.get("graph_breaks"),
        graph_break_reasons=compile_end.get("graph_break_reasons"),
        recompile_reasons=compile_end.get("recompile_reasons"),
        caption_lengths=caption_lengths,
        final_loss=final_loss,
        reference=reference,
        versions=versions(),
        timestamp=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=command,
        notes="; ".join(note_parts),
    )


# ----- loop overhead vs a bare step (issue 4 part 8) -----------------------------------------

#: the overhead check's default config: a small model whose bare fp32 CPU step takes >= 0.2 s
OVERHEAD_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "bench-overhead-cpu.yaml"
OVERHEAD_LIMIT = 1.10


@dataclasses.dataclass(kw_only=True)
class OverheadResult:
    """Loop step vs bare step, as CPU seconds per step of this process (all threads).

    Why CPU time: this check runs on shared CI machines (here 2 cores and 8 busy
    neighbours) where wall-clock ratios of two identical runs swung between 0.65x and 1.36x;
    neighbours do not add to this process's CPU time. Why paired: a bare step runs right
    after every loop step (inside the loop's end-of-step ``sync``), so each pair sees the
    same machine state; the ratio is of the medians over the pairs. Torch runs one intra-op
    thread during the check (no spinning OpenMP workers) and the loader decodes in the
    step's own thread (``data.prefetch: 0``), so the loop's data loading is counted in full
    instead of overlapping as it does on a node. Wall-clock medians are kept for the record.
    """

    bare_step_s: float  # median CPU seconds of a bare forward+backward+optimizer step
    loop_step_s: float  # median CPU seconds of a full loop step (loader, objective, clip, schedule, log)
    ratio: float  # loop_step_s / bare_step_s (the checked number)
    bare_wall_s: float  # median wall seconds, bare (informational)
    loop_wall_s: float  # median wall seconds, loop (informational)
    pairs: int  # measured (loop step, bare step) pairs

    def line(self) -> str:
        return (f"loop step {self.loop_step_s * 1e3:.1f} ms / bare step {self.bare_step_s * 1e3:.1f} ms CPU "
                f"= {self.ratio:.3f}x (limit {OVERHEAD_LIMIT:.2f}x; medians of {self.pairs} adjacent pairs; "
                f"wall medians {self.loop_wall_s * 1e3:.1f} / {self.bare_wall_s * 1e3:.1f} ms)")


class BareStep:
    """A bare training step on one fixed batch: zero_grad, objective forward, backward, AdamW
    step - no loader, no clipping, no scheduler, no logging. Same model config, objective and
    optimizer as the loop builds."""

    def __init__(self, cfg: Any, batch: dict[str, Any]) -> None:
        import torch

        from training.model.build import build_model
        from training.objective import RectifiedFlow
        from training.optim.factory import optimizer_factory

        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.model)
        self.optimizer = optimizer_factory(cfg.optim, self.model)(self.model.parameters())
        n_tokens, dim = batch["text"].shape[1:]
        self.objective = RectifiedFlow(cfg.objective, vae_scaling_factor=1.0,
                                       null_text=torch.zeros(n_tokens, dim),
                                       null_mask=torch.zeros(n_tokens, dtype=torch.long))
        self.batch = batch

    def __call__(self) -> tuple[float, float]:
        """One step; returns (CPU seconds, wall seconds)."""
        c0, t0 = time.process_time(), time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.objective(self.model, self.batch).backward()
        self.optimizer.step()
        return time.process_time() - c0, time.perf_counter() - t0


#: the bare step must cost at least this much CPU time for the ratio to mean anything (issue 4)
MIN_BARE_STEP_S = 0.2


def calibrate_batch(cfg: Any, spec: dict[str, Any], *, target_s: float = 1.25 * MIN_BARE_STEP_S,
                    max_batch: int = 128) -> int:
    """The config's batch, doubled until a bare step (1 thread, CPU time) takes ``target_s``:
    a faster CI machine than ours keeps the check meaningful instead of failing it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch = cfg.data.batch_size
        while True:
            c, h, w = spec["latent_shape"]
            n, d = spec["max_text_tokens"], spec["text_dim"]
            data = {"latents": torch.randn(batch, c, h, w), "text": torch.randn(batch, n, d),
                    "text_mask": torch.ones(batch, n, dtype=torch.long)}
            step = BareStep(cfg, data)
            step()  # allocates AdamW state
            seconds = min(step()[0], step()[0])
            if seconds >= target_s or batch * 2 > max_batch:
                return batch
            batch *= 2
    finally:
        torch.set_num_threads(threads)


def measure_overhead(cfg: Any, *, steps: int = 10, work_dir: Path) -> OverheadResult:
    """Full ``training.loop.train`` steps (GpuBackend on CPU, world size 1) paired with bare
    steps on the same data, in one process.

    A loop step is measured from the end of the previous pair's bare step to the loop's next
    end-of-step ``sync``: it holds everything the loop does per step (loader, objective,
    clip, scheduler, logging at the config's ``log_every`` - every step in
    bench-overhead-cpu.yaml, the worst case - and the checkpoint check). The first loop step
    (allocation) is outside the measured windows; checkpoints are off.
    """
    import torch

    from training.backends.gpu import GpuBackend
    from training.data.loader import FeatureLoader
    from training.loop import train

    if cfg.precision != "fp32":
        raise UserError(f"precision: the overhead check runs in fp32 on CPU, got {cfg.precision}")
    loader = FeatureLoader(cfg.data.path, batch_size=cfg.data.batch_size, prefetch=0)
    batch = next(loader)
    loader.close()
    run = dataclasses.replace(cfg, output_dir=str(work_dir / "loop"), max_steps=steps + 2)
    run.checkpoint = dataclasses.replace(cfg.checkpoint, resume="none", enabled=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bare = BareStep(cfg, batch)
        bare()  # allocates AdamW state
        backend = GpuBackend(cfg.gpu, precision="fp32")
        loop_cpu: list[float] = []
        loop_wall: list[float] = []
        bare_cpu: list[float] = []
        bare_wall: list[float] = []
        start: list[float] = []
        inner_sync = backend.sync

        def sync() -> None:
            inner_sync()
            c, w = time.process_time(), time.perf_counter()
            if len(start) == 2 and len(loop_cpu) < steps:
                loop_cpu.append(c - start[0])
                loop_wall.append(w - start[1])
                bc, bw = bare()
                bare_cpu.append(bc)
                bare_wall.append(bw)
            start[:] = [time.process_time(), time.perf_counter()]

        backend.sync = sync
        backend.init()
        try:
            train(run, backend)
        finally:
            backend.close()
    finally:
        torch.set_num_threads(threads)
    bare_s, loop_s = statistics.median(bare_cpu), statistics.median(loop_cpu)
    return OverheadResult(bare_step_s=bare_s, loop_step_s=loop_s, ratio=loop_s / bare_s,
                          bare_wall_s=statistics.median(bare_wall), loop_wall_s=statistics.median(loop_wall),
                          pairs=len(loop_cpu))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.bench", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("gpu", "trainium"), default="gpu")
    p.add_argument("--config", help="training YAML (training/configs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as for the training entrypoints; repeatable")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps first (compile, allocator)")
    p.add_argument("--out", help="result JSON path (rank 0 writes it)")
    p.add_argument("--synthetic", action="store_true",
                   help="train on random features of the model's shapes instead of data.path")
    p.add_argument("--text-tokens", type=int, default=DEFAULT_TEXT_TOKENS,
                   help="padded caption length of synthetic features")
    p.add_argument("--caption-lengths", default="auto",
                   help="real caption lengths of synthetic features: a feature directory (its stored caption "
                        "tokens), a JSON from python -m training.data.caption_lengths, 'full' (every caption at "
                        "--text-tokens: caption trimming gains nothing), or 'auto' (default: data.path of the "
                        "config when it is a local feature directory, else full)")
    p.add_argument("--synthetic-samples", type=int, default=0,
                   help="synthetic samples to write (default: 2 global batches, at least 16)")
    p.add_argument("--work-dir", help="scratch for synthetic features and the run dir "
                   "(default: $TMPDIR; node-local disk is right)")
    p.add_argument("--instance-type", default=os.environ.get("SANA_INSTANCE_TYPE", "local"),
                   help="SageMaker instance type, e.g. ml.p5.48xlarge (default $SANA_INSTANCE_TYPE or 'local')")
    p.add_argument("--notes", default="", help="free text stored in the result")
    p.add_argument("--dry-run", action="store_true",
                   help="instead: print the memory estimate of --config (training/perf/memory.py: per NeuronCore "
                        "with --backend trainium, per GPU with --backend gpu) for --world-size ranks and exit; "
                        "exit 2 if it cannot fit")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks the estimate shards over (default: 32, one trn1.32xlarge, for trainium; 8, one "
                        "p5.48xlarge, for gpu; 16 for --memory-table)")
    p.add_argument("--overhead", action="store_true",
                   help=f"instead: loop step vs bare step on CPU fp32 (limit {OVERHEAD_LIMIT}x)")
    p.add_argument("--compare-reference", action="store_true",
                   help="time our step and a diffusers-style reference step (training/perf/reference_step.py) on the "
                        "same model, batches and precision, interleaved --repetitions times x --steps; the "
                        "result JSON gets both (field reference) and the ratio")
    p.add_argument("--repetitions", type=int, default=5,
                   help="--compare-reference: interleaved (ours, reference) blocks of --steps steps each")
    p.add_argument("--memory-table", action="store_true",
                   help="instead: print the per-GPU memory estimate (training/perf/memory.py) of every GPU config "
                        "(or --config) for each mesh and activation-checkpointing mode at --world-size ranks")
    return p


def _load_cfg(args: argparse.Namespace, config: str, output_dir: Path) -> Any:
    from training.config import load_config

    argv = ["--config", config, "--output-dir", str(output_dir)]
    for item in args.overrides:
        argv += ["--set", item]
    return load_config(argv, prog="python -m training.bench")


def prepare_overhead_run(cfg: Any, work: Path, *, text_tokens: int = 32) -> Any:
    """Size the batch so the bare step takes >= MIN_BARE_STEP_S here, and write matching
    synthetic features; returns ``cfg`` updated (data.batch_size, data.path)."""
    spec = synthetic_spec(cfg.model.model_kwargs(), text_tokens)
    cfg.data.batch_size = calibrate_batch(cfg, spec)
    cfg.data.path = str(ensure_synthetic_features(work, spec, max(16, 2 * cfg.data.batch_size), write=True))
    return cfg


def main_dry_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The memory estimate of ``--config`` (per NeuronCore or per GPU) and one JSON line; nothing runs."""
    from training.perf.memory import check_gpu_config, check_trainium_config

    if not args.config:
        raise UserError("--dry-run: needs --config (e.g. training/configs/trn-sana-600m-512.yaml)")
    world = args.world_size or (32 if args.backend == "trainium" else 8)
    if world < 1:
        raise UserError(f"--world-size: {world} < 1; give the number of ranks (NeuronCores / GPUs)")
    cfg = _load_cfg(args, args.config, work / "run")
    if args.backend == "gpu":
        gpu = check_gpu_config(cfg, world_size=world, out=sys.stdout)
        summary = {"dry_run": True, "config": args.config, "memory_gib": gpu.as_gib()}
        print(json.dumps(summary), flush=True)
        return summary
    instance = None if args.instance_type == "local" else args.instance_type
    est = check_trainium_config(cfg, world_size=world, instance_type=instance, out=sys.stdout)
    summary = {"dry_run": True, "config": args.config, "hbm_gib": est.as_gib()}
    print(json.dumps(summary), flush=True)
    return summary


#: the GPU configs --memory-table covers by default (training/configs/sana-*.yaml)
GPU_CONFIGS = "sana-*.yaml"


def memory_tables(configs: Sequence[str | Path], *, world_size: int, overrides: Sequence[str] = ()) -> str:
    """Markdown: one per-GPU memory table (training/perf/memory.py) per config, mesh x checkpointing."""
    from training.config import load_config
    from training.perf.memory import DEFAULT_GPU_GIB, gpu_memory_table

    out = []
    for path in configs:
        argv = ["--config", str(path)]
        for item in overrides:
            argv += ["--set", item]
        cfg = load_config(argv, prog="python -m training.bench")
        kw = cfg.model.model_kwargs()
        out += [f"**{cfg.model.preset}** (`{Path(path).name}`: batch {cfg.data.batch_size} per GPU, {cfg.precision}, "
                f"{int(kw.get('sample_size', 32)) * VAE_DOWNSAMPLE} px, {world_size} GPUs; GiB per GPU, "
                f"activations in brackets, over = above {DEFAULT_GPU_GIB:g} GiB)", "",
                gpu_memory_table(cfg, world_size=world_size), ""]
    return "\n".join(out).rstrip() + "\n"


def main_memory_table(args: argparse.Namespace) -> str:
    configs = [args.config] if args.config else sorted((Path(__file__).resolve().parents[1] / "configs").glob(GPU_CONFIGS))
    text = memory_tables(configs, world_size=args.world_size or 16, overrides=args.overrides)
    print(text, end="", flush=True)
    return text


def compare_and_save(args: argparse.Namespace, cfg: Any, backend: Any, *, data_label: str | None,
                     command: str, memory_estimate: dict[str, Any] | None,
                     caption_lengths: str | None = None) -> BenchResult | None:
    """``--compare-reference``: both steps interleaved (training/perf/reference_step.py), one result."""
    from training.perf.reference_step import compare

    if args.steps < 1 or args.warmup < 1 or args.repetitions < 1:
        raise UserError("--steps, --warmup and --repetitions: must all be >= 1")
    comp = compare(cfg, backend, repetitions=args.repetitions, steps=args.steps, warmup=args.warmup)
    if not backend.is_main:
        return None
    steps = args.steps * args.repetitions
    ours = comp.samples_per_s(comp.seconds_ours)
    theirs = comp.samples_per_s(comp.seconds_reference)
    info = backend.describe()
    accelerator, _ = resolve_accelerator(args.instance_type, info)
    per_accel = theirs / backend.world_size
    ref_tokens = comp.reference_tokens
    reference = {
        "samples_per_s_total": theirs, "samples_per_s_per_accelerator": per_accel, "ratio": ours / theirs,
        "mfu": flops.mfu(ref_tokens.per_sample("useful_flops"), per_accel, accelerator, cfg.precision),
        "mfu_padded": flops.mfu(ref_tokens.per_sample("computed_flops"), per_accel, accelerator, cfg.precision),
        "text_tokens_computed": ref_tokens.per_sample("computed_text_tokens"),
        "text_tokens_real": ref_tokens.per_sample("real_text_tokens"),  # = ours: the same batches
        "repetitions": args.repetitions, "steps_per_repetition": args.steps,
        "seconds_ours": comp.seconds_ours, "seconds_reference": comp.seconds_reference,
        "ratios": comp.ratios(), "ratio_median": statistics.median(comp.ratios()),
        "compiled": comp.compiled,  # both sides compiled, or both eager
        "final_loss": comp.final_loss_reference, "weight_update_norm": comp.update_reference,
        "weight_update_norm_ours": comp.update_ours,
        "description": comp.reference_description,
    }
    per_step = [t / args.steps for t in comp.seconds_ours for _ in range(args.steps)]
    result = build_result(cfg, backend, seconds=sum(comp.seconds_ours), steps=steps, warmup=args.warmup,
                          step_times=per_step, samples_per_step=comp.samples_per_step, window=comp.tokens,
                          final_loss=comp.final_loss_ours, instance_type=args.instance_type, data_label=data_label,
                          command=command, notes=args.notes, memory_estimate=memory_estimate, reference=reference,
                          compiles=comp.compiles, caption_lengths=caption_lengths)
    both = "both compiled" if comp.compiled else "both eager"
    print(f"compare-reference ({both}): ours {ours:.3f} samples/s, reference {theirs:.3f} samples/s, ratio "
          f"{ours / theirs:.3f}x (per repetition {', '.join(f'{r:.3f}' for r in comp.ratios())}; median "
          f"{reference['ratio_median']:.3f}x); MFU ours {_pct(result.mfu)} (padded {_pct(result.mfu_padded)}), "
          f"reference {_pct(reference['mfu'])} (padded {_pct(reference['mfu_padded'])}); real caption tokens "
          f"{result.text_tokens_real:.1f} per sample on both sides, computed ours "
          f"{result.text_tokens_computed:.1f} / reference {reference['text_tokens_computed']:.1f}; "
          f"{args.repetitions} interleaved repetitions x {args.steps} steps", flush=True)
    return result


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def main_overhead(args: argparse.Namespace, work: Path) -> OverheadResult:
    cfg = prepare_overhead_run(_load_cfg(args, args.config or str(OVERHEAD_CONFIG), work / "run"), work,
                               text_tokens=args.text_tokens)
    result = measure_overhead(cfg, work_dir=work)
    print(result.line(), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dataclasses.asdict(result), indent=2) + "\n")
    return result


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    root = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir()) / "sana-bench"
    root.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    try:
        if args.overhead:
            main_overhead(args, work)
            return
        if args.dry_run:
            main_dry_run(args, work)
            return
        if args.memory_table:
            main_memory_table(args)
            return
        if not args.config or not args.out:
            raise UserError("--config and --out: required (or use --overhead)")
        cfg = _load_cfg(args, args.config, work / "run")
        memory_estimate = None
        if args.backend == "gpu":  # before anything is built: a config that cannot fit fails here
            from training.perf.memory import check_gpu_config

            memory_estimate = check_gpu_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)),
                                               out=sys.stdout if int(os.environ.get("RANK", 0)) == 0 else None
                                               ).as_gib()
        backend = make_backend(args.backend, cfg)
        try:
            backend.init()
            data_label = None
            caption_label = f"real features ({cfg.data.path})"
            if args.synthetic:
                world = int(os.environ.get("WORLD_SIZE", backend.world_size))
                samples = args.synthetic_samples or max(16, 2 * cfg.data.batch_size * world
                                                        * cfg.optim.grad_accum_steps)
                captions = resolve_caption_lengths(args.caption_lengths, cfg)
                caption_label = captions.describe()
                if backend.is_main:
                    print(f"bench: synthetic captions, lengths from {caption_label}", flush=True)
                spec = synthetic_spec(cfg.model.model_kwargs(), args.text_tokens, captions)
                path = ensure_synthetic_features(root, spec, samples, write=backend.local_rank == 0)
                backend.barrier()  # local rank 0 wrote the node's copy
                cfg.data.path = str(path)
                data_label = "synthetic"
            command = "python -m training.bench " + shlex.join(sys.argv[1:] if argv is None else list(argv))
            if args.compare_reference:
                result = compare_and_save(args, cfg, backend, data_label=data_label, command=command,
                                          memory_estimate=memory_estimate, caption_lengths=caption_label)
            else:
                result = run_bench(cfg, backend, steps=args.steps, warmup=args.warmup,
                                   instance_type=args.instance_type, data_label=data_label, command=command,
                                   notes=args.notes, memory_estimate=memory_estimate,
                                   caption_lengths=caption_label)
        finally:
            backend.close()
        if result is not None:
            result.save(args.out)
            print(json.dumps({"out": str(args.out), "samples_per_s_total": round(result.samples_per_s_total, 3),
                              "samples_per_s_per_accelerator": round(result.samples_per_s_per_accelerator, 3),
                              "step_time_p50_s": round(result.step_time_p50_s, 4), "mfu": result.mfu,
                              "mfu_padded": result.mfu_padded,
                              **({"reference_ratio": round(result.reference["ratio"], 4)} if result.reference
                                 else {})}),
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
