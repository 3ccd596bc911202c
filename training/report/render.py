"""The report's Markdown: the measured report (header, recommendation, the projection and
decision sections in their place, then runs, throughput, cost, time and cost to target,
scaling, MFU, memory and compilation, the FSx capacity note, notes and versions) and the
projection-only report of ``--project`` without result files.

Definitions (tests/training/report/test_report.py checks these by hand):
- FSx need = bytes per sample x total samples/s (every sample is read once per epoch)
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.report import assemble
from training.report.inputs import Options, target_samples
from training.report.markdown import table
from training.report.prices import PriceTable
from training.report.recommendation import recommendation
from training.report.runs import Run, hours_to_target, scaling_table


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.2f}" if n is not None else "n/a"


def _opt(v: Any, fmt: str) -> str:
    return fmt.format(v) if v is not None else "n/a"


def _pct(fraction: float) -> str:
    """Percent with 3 significant digits (a CPU run uses 0.0177% of FSx, not "0.0%")."""
    return f"{100 * fraction:.3g}%"


def render_projection_only(prices: PriceTable, projection_lines: Sequence[str], extra: assemble.Sections) -> str:
    out = ["# Sana training: projected GPU vs Trainium cost-performance (no runs measured)", "",
           f"Generated {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} by "
           f"`python -m training.report --project` with prices `{prices.path}` ({prices.region}, as of "
           f"{prices.as_of}). Every figure is a projection from assumptions named beside it; bench both "
           "platforms (runbooks/compare.md) and re-run with the result files to place measured runs on it.", "",
           *(line for w in extra.warnings for line in (w, "")), extra.quality, ""]
    return "\n".join([*out, *projection_lines, *extra.after_projection, "", *extra.prices, ""])


def render(runs: Sequence[Run], prices: PriceTable, opts: Options, charts: dict[str, Path],
           warnings: Sequence[str], projection_lines: Sequence[str], verdict: str | None,
           extra: assemble.Sections) -> str:
    cpu = any(r.result.is_cpu for r in runs)
    first = runs[0].result
    samples, what = target_samples(opts)
    out: list[str] = ["# Sana training: GPU vs Trainium cost-performance report", ""]
    if cpu:
        out += ["> **CPU figures, not accelerator figures.** At least one result below was measured on a "
                "local CPU (tests / `make demo`). The numbers exercise the report; they say nothing about "
                "GPU or Trainium performance.", ""]
    out += [f"Generated {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} by "
            "`python -m training.report` from:", ""]
    out += [f"- `{r.path}` ({r.result.timestamp})" for r in runs]
    unverified = sorted({r.price.instance_type for r in runs if not r.price.verified})
    out += ["", f"Prices: `{prices.path}` (on-demand list prices as of {prices.as_of}, {prices.currency}, "
            f"{prices.region})." + (f" **Unverified entries used: {', '.join(unverified)}** - check them "
                                    "against the source before deciding." if unverified else "")]
    out += ["", f"Compared at: preset `{first.model_preset}`"
            + (f" with overrides `{json.dumps(first.model_overrides)}`" if first.model_overrides else "")
            + f", {first.resolution_px} px (latent {first.latent_hw[0]}x{first.latent_hw[1]}), "
            f"{first.text_tokens} text tokens, precision `{first.precision}`."]
    if warnings:
        out += ["", "**Mismatched runs compared (--allow-mismatch):**", ""] + [f"- {w}" for w in warnings]

    out += [line for w in extra.warnings for line in ("", w)]
    out += ["", "## Recommendation", "", recommendation(runs, opts) + (f" Against the projection: {verdict}"
                                                                       if verdict else "") + f" {extra.quality}"]
    out += ["", *extra.prices, "", *projection_lines, *extra.after_projection]

    out += ["", "## Runs", "", table(
        ["run", "nodes x accel/node", "global batch (per device)", "steps timed (warm-up)", "step p50 / p90 s",
         "data"],
        [[r.label, f"{r.result.nodes} x {r.result.accelerators_per_node}",
          f"{r.result.global_batch} ({r.result.per_device_batch})",
          f"{r.result.steps_timed} ({r.result.warmup_steps})",
          f"{r.result.step_time_p50_s:.4g} / {r.result.step_time_p90_s:.4g}", r.result.data] for r in runs])]

    out += ["", "## Throughput", "", table(
        ["run", "samples/s per accelerator", "samples/s per instance", "samples/s total"],
        [[r.label, f"{r.result.samples_per_s_per_accelerator:,.3f}", f"{r.result.samples_per_s_per_instance:,.3f}",
          f"{r.result.samples_per_s_total:,.3f}"] for r in runs]), "", "![throughput](throughput.png)"]

    out += ["", "## Cost", "", table(
        ["run", "USD/h per instance", "price checked", "cost per million samples"],
        [[r.label, f"${r.price.usd_per_hour:,.3f}", r.price.date_label() + ("" if r.price.verified else " (unverified)"),
          f"${r.cost_per_million:,.2f}"] for r in runs]), "", "![cost](cost.png)"]

    out += ["", "## Time and cost to target", "", f"Target: {what}.", "", table(
        ["run", "hours", "USD"],
        [[r.label, f"{hours_to_target(samples, r.result.samples_per_s_total):,.2f}",
          f"${hours_to_target(samples, r.result.samples_per_s_total) * r.usd_per_hour_total:,.2f}"]
         for r in runs])]

    out += ["", "## Scaling efficiency", ""]
    scaling = scaling_table(runs)
    if scaling:
        name = {r.platform: r.platform_name for r in runs}
        rows = [[name[p], str(n), f"{sps:,.3f}", f"{eff:.1%}"] for p, pts in scaling.items() for n, sps, eff in pts]
        out += [table(["platform", "nodes", "samples/s total", "efficiency"], rows), "", "![scaling](scaling.png)"]
    else:
        out += ["Each platform was measured at one node count only; bench the same config on 2, 4, ... "
                "nodes (runbooks/compare.md) to fill this section."]

    out += ["", "## Model FLOPs utilisation", "",
            f"Analytic FLOP model (`training/model/flops.py`): {first.train_flops_per_sample / 1e12:.4g} TFLOP per "
            "training sample (forward + backward = 3x forward; real caption tokens only, `mfu_padded` in the "
            "bench JSON counts the padding too), divided by each accelerator's dense peak.", "",
            table(["run", "accelerator", "peak TFLOP/s", "MFU", "peak source"],
                  [[r.label, r.result.accelerator, _opt(r.result.peak_tflops_per_accelerator, "{:g}"),
                    _opt(r.result.mfu, "{:.1%}"), r.result.peak_source or "no published peak (CPU): MFU n/a"]
                   for r in runs])]
    if "mfu" in charts:
        out += ["", "![mfu](mfu.png)"]

    out += ["", "## Memory and compilation", "", table(
        ["run", "peak memory GiB (rank 0)", "compiles", "compile s", "compiles in timed steps"],
        [[r.label, _gib(r.result.peak_memory_bytes), _opt(r.result.compile_count, "{}"),
          _opt(r.result.compile_seconds, "{:.1f}"), _opt(r.result.compiles_in_timed_steps, "{}")] for r in runs])]

    out += ["", "## Storage capacity note (FSx for Lustre)", "", *capacity_lines(runs, opts)]
    notes = [f"- {r.label}: {r.result.notes}" for r in runs if r.result.notes]
    if notes:
        out += ["", "## Notes from the runs", "", *notes]
    out += ["", "## Versions", "", table(["run", "versions", "command"],
                                         [[r.label, ", ".join(f"{k} {v}" for k, v in r.result.versions.items()),
                                           f"`{r.result.command}`"] for r in runs]), ""]
    return "\n".join(out)


def capacity_lines(runs: Sequence[Run], opts: Options) -> list[str]:
    lines = ["Reading every sample once per epoch, a run needs bytes per sample x total samples/s "
             "from FSx. The first epoch also lazy-loads from S3 through the data repository association, "
             "which is slower than this steady state.", ""]
    rows = []
    for r in runs:
        bps = opts.bytes_per_sample or r.result.bytes_per_sample
        src = (f"index {opts.features_index}" if opts.bytes_per_sample
               else ("bench's synthetic features" if r.result.data == "synthetic" else "bench's features"))
        if bps is None:
            rows.append([r.label, "n/a", "n/a", "n/a", "n/a"])
            continue
        need = bps * r.result.samples_per_s_total / 1e6
        share = _pct(need / opts.fsx_mbps) if opts.fsx_mbps else "n/a"
        rows.append([r.label, f"{bps:,.0f} ({src})", f"{r.result.samples_per_s_per_instance:,.3f} x "
                     f"{r.result.nodes}", f"{need:,.3f}", share])
    lines.append(table(["run", "bytes per sample", "samples/s per node x nodes", "MB/s needed",
                        "share of provisioned"], rows))
    lines.append("")
    if opts.fsx_mbps:
        lines.append(f"Provisioned: {opts.fsx_mbps:,.1f} MB/s ({opts.fsx_source}).")
        worst = max((opts.bytes_per_sample or r.result.bytes_per_sample or 0) * r.result.samples_per_s_total / 1e6
                    for r in runs)
        if worst > opts.fsx_mbps:
            lines.append(f"**The fastest run needs {worst:,.1f} MB/s, more than provisioned: raise "
                         "fsxThroughputPerTiB or fsxStorageGiB in cdk.json, or training will wait on I/O.**")
        else:
            lines.append(f"The most demanding run uses {_pct(worst / opts.fsx_mbps)} of it.")
    else:
        lines.append("Provisioned FSx throughput unknown: pass --fsx-throughput-mbps, or run from the repo "
                     "(cdk.json context fsxStorageGiB x fsxThroughputPerTiB).")
    if not opts.bytes_per_sample:
        lines.append("Bytes per sample come from the bench's own features; pass --features-index with the real "
                     "feature directory for the real caption lengths.")
    return lines
