"""``python -m training.bench --compare-reference``: our step and the diffusers-style reference
step (training/perf/reference_step.py) timed interleaved in one process, turned into one
``BenchResult`` (ours, through training/perf/measure.py ``build_result``) whose field
``reference`` holds the reference side's throughput, MFU and the ratios, plus the one line
that prints them side by side.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from training.errors import UserError
from training.model import flops
from training.perf.bench_result import BenchResult
from training.perf.measure import build_result, resolve_accelerator


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
