"""One measured bench run: ``warmup + steps`` optimizer steps of the production loop, the
device-synchronised clock around the last ``steps``, and the ``BenchResult`` they make.

The measured step is the production one: ``run_bench`` calls ``training.loop.train`` (the same
loop, objective, backend and data loader as ``python -m training.gpu`` / ``training.trainium``)
for ``warmup + steps`` optimizer steps and only times the last ``steps``. A benchmark loop
of its own would measure something nobody trains with.

Timing: the backend's ``sync()`` (end of each optimizer step) is wrapped so that at the end
of the warm-up and at the end of the last step the device is drained (CUDA synchronize /
XLA wait_device_ops) and the clock read. The timed window is exactly the device time of
``steps`` steps, yet the steps inside it keep their normal host/device overlap (no sync per
step). The p50/p90 come from the loop's per-step host times, which in steady state run at
the device's pace (the launch queue / XLA pipeline throttles the host).

Throughput is reported per accelerator (per rank), per instance and in total; MFU uses
``training.model.flops`` (analytic model x samples/s per accelerator / published dense peak)
on the real caption tokens of the timed steps' batches, ``mfu_padded`` on the tokens computed
(training/data/text_trim.py). ``build_result`` is shared with ``--compare-reference``
(training/perf/reference_result.py), so both kinds of run report the same arithmetic; the
command line that chooses between them is training/perf/bench.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

from training.data.text_trim import StepTokens
from training.errors import UserError
from training.model import flops
from training.perf.bench_result import BenchResult
from training.perf.timing import drain

#: DC-AE f32: one latent pixel = 32 image pixels (Sana's VAE), for the nominal resolution
VAE_DOWNSAMPLE = 32


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
