"""Consistent bench results at cluster scale, for the report and projection tests."""

from __future__ import annotations

from training.perf.bench_result import BenchResult


def make_result(*, backend: str, instance_type: str, accelerator: str, nodes: int, per_node: int,
                sps_per_accel: float, peak: float | None = None, mfu: float | None = None, **extra) -> dict:
    """A consistent result dict (identities hold) for logic tests at cluster scale."""
    world = nodes * per_node
    per_device = 16
    steps = 50
    total = sps_per_accel * world
    seconds = per_device * world * steps / total
    data = dict(backend=backend, device_kind="cuda" if backend == "gpu" else "neuron",
                instance_type=instance_type, accelerator=accelerator, accelerators_per_node=per_node,
                nodes=nodes, world_size=world, model_preset="sana-600m-512", model_overrides={},
                resolution_px=512, latent_hw=[16, 16], text_tokens=300, precision="bf16-mixed",
                per_device_batch=per_device, grad_accum_steps=1, global_batch=per_device * world,
                data="synthetic", bytes_per_sample=300_000.0, warmup_steps=10, steps_timed=steps,
                timed_seconds=seconds, step_time_p50_s=seconds / steps, step_time_p90_s=seconds / steps * 1.05,
                step_time_mean_s=seconds / steps, samples_per_s_total=total,
                samples_per_s_per_accelerator=total / world, samples_per_s_per_instance=total / nodes,
                train_flops_per_sample=0.947e12, peak_tflops_per_accelerator=peak, peak_source="datasheet" if peak else None,
                mfu=mfu, peak_memory_bytes=40 * 2**30, compile_count=None, compile_seconds=None,
                compiles_in_timed_steps=None, final_loss=0.5, versions={"torch": "2.x"},
                timestamp="2026-01-01T00:00:00+00:00", command="python -m training.bench ...", notes="")
    data.update(extra)
    BenchResult.from_dict(data)  # the helper itself must produce valid results
    return data
