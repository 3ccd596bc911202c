"""``python -m training.report RESULT.json ... --out DIR``: the GPU vs Trainium cost-performance report.

Reads bench results (``training.perf.bench_result.BenchResult``, validated on load), prices
(``training/prices.yaml``, ``--prices FILE`` or ``--prices aws``: the AWS Price List API) and
optionally the feature index and the FSx settings, and writes ``DIR/report.md`` plus PNG
charts. The decision inputs around the bench numbers (price sources and staleness, price
scenarios, MFU evidence, quality parity) live in ``training/report/``. Every number and every
sentence of the recommendation is computed from those inputs; nothing is written in by
hand, so the report can be regenerated whenever a result or a price changes.

Definitions (the tests check these by hand):
- cost per million samples = USD/h per instance / (samples/s per instance x 3600) x 1e6
- time to target = dataset samples x epochs / total samples/s
- cost to target = time to target (h) x USD/h per instance x nodes
- scaling efficiency at n nodes = (samples/s at n / n) / (samples/s at n0 / n0), n0 = the
  fewest nodes measured for that platform
- FSx need = bytes per sample x total samples/s (every sample is read once per epoch)
- FSx provisioned (PERSISTENT_2) = storage TiB x throughput per TiB (MB/s/TiB)

Every report also has the projection section (``training/report/projection.py``): cost and time per
preset and instance type as a function of MFU, the GPU/Trainium break-even, budget answers,
and the measured runs placed on the same chart. ``--project`` with no result files writes
that section alone: the decision framed before any accelerator is benchmarked.

Refuses to compare runs that differ in preset, model overrides, resolution, text length
or precision (``--allow-mismatch`` to override, with a warning in the report), and stops
with one line naming an instance type that has no price.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly
from training.model import flops
from training.perf.bench_result import COMPARABLE_FIELDS, BenchResult
from training.report import assemble, projection
from training.report.prices import DEFAULT_PRICES, Price, PriceTable
from training.report.projection import duration

REPO = Path(__file__).resolve().parents[2]
__all__ = ["DEFAULT_PRICES", "Price", "PriceTable", "build", "main"]  # Price, PriceTable: training/report/prices.py
#: chart size in pixels (width, height): figsize x dpi, no tight bbox, so tests can check it
CHART_PX = (960, 540)
_DPI = 100


# ----- the numbers -------------------------------------------------------------------------

def cost_per_million_samples(usd_per_hour: float, samples_per_s_per_instance: float) -> float:
    return usd_per_hour / (samples_per_s_per_instance * 3600.0) * 1e6


def hours_to_target(samples: float, samples_per_s_total: float) -> float:
    return samples / samples_per_s_total / 3600.0


def fsx_provisioned_mbps(storage_gib: float, per_tib_mbps: float) -> float:
    """PERSISTENT_2 throughput capacity = storage (TiB) x throughput per unit of storage."""
    return storage_gib / 1024.0 * per_tib_mbps


@dataclasses.dataclass(kw_only=True)
class Run:
    """One result with its derived numbers."""

    path: Path
    result: BenchResult
    price: Price

    @property
    def platform(self) -> tuple[str, str, str]:
        r = self.result
        return (r.backend, r.instance_type, r.accelerator)

    @property
    def platform_name(self) -> str:
        r = self.result
        where = r.instance_type if r.instance_type != "local" else f"local {r.device_kind}"
        return f"{r.backend} on {where} ({r.accelerator})"

    @property
    def label(self) -> str:
        return f"{self.platform_name} x{self.result.nodes}"

    @property
    def usd_per_hour_total(self) -> float:
        return self.price.usd_per_hour * self.result.nodes

    @property
    def cost_per_million(self) -> float:
        return cost_per_million_samples(self.price.usd_per_hour, self.result.samples_per_s_per_instance)


@dataclasses.dataclass(kw_only=True)
class Options:
    dataset_samples: int | None = None
    epochs: float = 1.0
    allow_mismatch: bool = False
    bytes_per_sample: float | None = None  # from --features-index
    features_index: str | None = None
    fsx_mbps: float | None = None  # provisioned FSx throughput
    fsx_source: str = ""
    project_only: bool = False  # --project without result files
    assumptions: projection.Assumptions | None = None  # None: the defaults
    question: projection.Question | None = None  # None: the defaults + this target
    decision: assemble.DecisionOptions = dataclasses.field(default_factory=assemble.DecisionOptions)
    serving: tuple[str, ...] = ()  # --serving: serving bench JSONs (training/serve/bench.py)


def check_comparable(runs: Sequence[Run], allow: bool) -> list[str]:
    """Refuse (UserError naming the field) unless every run matches the first on
    COMPARABLE_FIELDS; with ``allow`` return the differences as warnings instead."""
    warnings = []
    first = runs[0]
    for run in runs[1:]:
        for name in COMPARABLE_FIELDS:
            a, b = getattr(first.result, name), getattr(run.result, name)
            if a != b:
                msg = f"{run.path}: field {name} is {b!r} but {first.path} has {a!r}"
                if not allow:
                    raise UserError(f"{msg}; compare like with like, or pass --allow-mismatch")
                warnings.append(msg)
    return warnings


def scaling_table(runs: Sequence[Run]) -> dict[tuple[str, str, str], list[tuple[int, float, float]]]:
    """platform -> [(nodes, samples/s total, efficiency)] for platforms measured at >= 2 node counts.
    Repeats at one node count: the fastest run counts."""
    best: dict[tuple[str, str, str], dict[int, float]] = {}
    for run in runs:
        per = best.setdefault(run.platform, {})
        n = run.result.nodes
        per[n] = max(per.get(n, 0.0), run.result.samples_per_s_total)
    out = {}
    for platform, per in best.items():
        if len(per) < 2:
            continue
        n0 = min(per)
        base = per[n0] / n0
        out[platform] = [(n, per[n], (per[n] / n) / base) for n in sorted(per)]
    return out


def reference_runs(runs: Sequence[Run]) -> list[Run]:
    """One run per platform for the head-to-head: the fewest nodes, fastest among repeats."""
    chosen: dict[tuple[str, str, str], Run] = {}
    for run in runs:
        cur = chosen.get(run.platform)
        key = (run.result.nodes, -run.result.samples_per_s_total)
        if cur is None or key < (cur.result.nodes, -cur.result.samples_per_s_total):
            chosen[run.platform] = run
    return sorted(chosen.values(), key=lambda r: r.cost_per_million)


def target_samples(opts: Options) -> tuple[float, str]:
    if opts.dataset_samples:
        return opts.dataset_samples * opts.epochs, (f"{opts.dataset_samples:,} samples x {opts.epochs:g} "
                                                    f"epoch{'s' if opts.epochs != 1 else ''}")
    return 1e6, "1,000,000 samples (give --dataset-samples and --epochs for your target)"


def recommendation(runs: Sequence[Run], opts: Options) -> str:
    """The recommendation paragraph, every clause computed from the runs."""
    refs = reference_runs(runs)
    cpu = any(r.result.is_cpu for r in runs)
    prefix = ("These are CPU figures from a local run, not accelerator figures: the paragraph shows "
              "how the recommendation is computed and says nothing about GPUs or Trainium. ") if cpu else ""
    if len(refs) < 2:
        only = refs[0]
        return (prefix + f"Only one platform was measured ({only.platform_name}: "
                f"${only.cost_per_million:,.2f} per million samples); run the bench on the other "
                "partition to get a comparison.")
    samples, what = target_samples(opts)
    cheap, runner = refs[0], refs[1]
    saving = (runner.cost_per_million - cheap.cost_per_million) / runner.cost_per_million
    parts = [f"{cheap.platform_name} is the cheaper platform: ${cheap.cost_per_million:,.2f} per million "
             f"training samples against ${runner.cost_per_million:,.2f} on {runner.platform_name}, "
             f"{saving:.1%} less (at {cheap.result.nodes} and {runner.result.nodes} node"
             f"{'s' if runner.result.nodes != 1 else ''}, on-demand prices from {cheap.price.checked} and "
             f"{runner.price.checked})."]
    fast = max(refs, key=lambda r: r.result.samples_per_s_per_instance)
    t_cheap = hours_to_target(samples, cheap.result.samples_per_s_total)
    c_cheap = t_cheap * cheap.usd_per_hour_total
    if fast is cheap:
        ratio = cheap.result.samples_per_s_per_instance / runner.result.samples_per_s_per_instance
        parts.append(f"It is also faster per instance ({ratio:.2f}x the samples/s of {runner.platform_name}), "
                     f"so there is no trade-off to weigh: for {what} it takes {duration(t_cheap)} and "
                     f"${c_cheap:,.2f}.")
    else:
        t_fast = hours_to_target(samples, fast.result.samples_per_s_total)
        c_fast = t_fast * fast.usd_per_hour_total
        ratio = fast.result.samples_per_s_per_instance / cheap.result.samples_per_s_per_instance
        parts.append(f"{fast.platform_name} is {ratio:.2f}x faster per instance: for {what} it needs "
                     f"{duration(t_fast)} and ${c_fast:,.2f} against {duration(t_cheap)} and ${c_cheap:,.2f}.")
        saved_h = t_cheap - t_fast
        extra = c_fast - c_cheap
        if saved_h > 0:
            parts.append(f"The crossover is the value of time: the faster platform pays off only when "
                         f"finishing one hour earlier is worth more than ${extra / saved_h:,.2f} "
                         f"(${extra:,.2f} more for {duration(saved_h)} less).")
        nodes_needed = math.ceil(fast.result.samples_per_s_total / cheap.result.samples_per_s_per_instance)
        parts.append(f"Matching {fast.result.nodes} {fast.result.instance_type} node"
                     f"{'s' if fast.result.nodes != 1 else ''} takes about {nodes_needed} "
                     f"{cheap.result.instance_type} nodes if scaling were linear.")
    scaling = scaling_table(runs)
    if scaling:
        parts.append(_scaling_sentence(runs, scaling))
    else:
        parts.append("No platform was measured at more than one node count, so the scaling "
                     "crossover is unknown; bench 2+ node counts to find where efficiency changes the order.")
    return prefix + " ".join(parts)


def _scaling_sentence(runs: Sequence[Run], scaling: dict) -> str:
    price = {r.platform: r.price.usd_per_hour for r in runs}
    name = {r.platform: r.platform_name for r in runs}
    bits = []
    for platform, points in scaling.items():
        n, _, eff = points[-1]
        bits.append(f"{name[platform]} keeps {eff:.0%} scaling efficiency at {n} nodes")
    # Cost ranking at each node count measured for every platform.
    counts = set.intersection(*({n for n, _, _ in pts} for pts in scaling.values())) if len(scaling) > 1 else set()
    order = []
    for n in sorted(counts):
        costs = {p: cost_per_million_samples(price[p], sps / n) for p, pts in scaling.items()
                 for m, sps, _ in pts if m == n}
        order.append((n, min(costs, key=costs.get)))
    flips = [(a, b) for a, b in zip(order, order[1:], strict=False) if a[1] != b[1]]
    text = "; ".join(bits) + "."
    if flips:
        (n0, p0), (n1, p1) = flips[0]
        text += (f" The cost order flips between {n0} and {n1} nodes: {name[p0]} is cheaper at {n0}, "
                 f"{name[p1]} at {n1}.")
    elif len(order) > 1:
        text += f" The cost order does not change between {order[0][0]} and {order[-1][0]} nodes."
    return text


# ----- charts ------------------------------------------------------------------------------

def _figure(ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(CHART_PX[0] / _DPI, CHART_PX[1] / _DPI), dpi=_DPI)
    return plt, fig, axes


def _save(plt, fig, path: Path, cpu: bool) -> Path:
    if cpu:
        fig.text(0.5, 0.01, "CPU figures from a local run - not accelerator figures", ha="center",
                 fontsize=9, color="firebrick")
    fig.subplots_adjust(bottom=0.3, top=0.88, wspace=0.35)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _bars(ax, labels: list[str], values: list[float], title: str, ylabel: str, fmt: str) -> None:
    xs = range(len(labels))
    bars = ax.bar(xs, values, color=["tab:green" if "gpu" in lab else "tab:orange" for lab in labels])
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=9)
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)


def make_charts(runs: Sequence[Run], out: Path) -> dict[str, Path]:
    cpu = any(r.result.is_cpu for r in runs)
    labels = [r.label for r in runs]
    charts = {}
    plt, fig, (a1, a2) = _figure(2)
    _bars(a1, labels, [r.result.samples_per_s_per_accelerator for r in runs], "per accelerator", "samples/s",
          "{:.3g}")
    _bars(a2, labels, [r.result.samples_per_s_per_instance for r in runs], "per instance", "samples/s", "{:.3g}")
    fig.suptitle("Training throughput")
    charts["throughput"] = _save(plt, fig, out / "throughput.png", cpu)

    plt, fig, ax = _figure()
    _bars(ax, labels, [r.cost_per_million for r in runs], "Cost per million training samples (on-demand)",
          "USD", "${:,.2f}")
    charts["cost"] = _save(plt, fig, out / "cost.png", cpu)

    with_mfu = [r for r in runs if r.result.mfu is not None]
    if with_mfu:
        plt, fig, ax = _figure()
        _bars(ax, [r.label for r in with_mfu], [100 * r.result.mfu for r in with_mfu],
              "Model FLOPs utilisation", "% of dense peak", "{:.1f}%")
        charts["mfu"] = _save(plt, fig, out / "mfu.png", cpu)

    scaling = scaling_table(runs)
    if scaling:
        name = {r.platform: r.platform_name for r in runs}
        plt, fig, (a1, a2) = _figure(2)
        for platform, points in scaling.items():
            ns = [n for n, _, _ in points]
            a1.plot(ns, [s for _, s, _ in points], marker="o", label=name[platform])
            a2.plot(ns, [100 * e for _, _, e in points], marker="o", label=name[platform])
        a1.set(title="Total samples/s", xlabel="nodes")
        a2.set(title="Scaling efficiency (%)", xlabel="nodes")
        a1.legend(fontsize=7)
        charts["scaling"] = _save(plt, fig, out / "scaling.png", cpu)
    return charts


# ----- markdown ----------------------------------------------------------------------------

def _gib(n: int | None) -> str:
    return f"{n / 2**30:.2f}" if n is not None else "n/a"


def _opt(v: Any, fmt: str) -> str:
    return fmt.format(v) if v is not None else "n/a"


def _pct(fraction: float) -> str:
    """Percent with 3 significant digits (a CPU run uses 0.0177% of FSx, not "0.0%")."""
    return f"{100 * fraction:.3g}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


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

    out += ["", "## Runs", "", _table(
        ["run", "nodes x accel/node", "global batch (per device)", "steps timed (warm-up)", "step p50 / p90 s",
         "data"],
        [[r.label, f"{r.result.nodes} x {r.result.accelerators_per_node}",
          f"{r.result.global_batch} ({r.result.per_device_batch})",
          f"{r.result.steps_timed} ({r.result.warmup_steps})",
          f"{r.result.step_time_p50_s:.4g} / {r.result.step_time_p90_s:.4g}", r.result.data] for r in runs])]

    out += ["", "## Throughput", "", _table(
        ["run", "samples/s per accelerator", "samples/s per instance", "samples/s total"],
        [[r.label, f"{r.result.samples_per_s_per_accelerator:,.3f}", f"{r.result.samples_per_s_per_instance:,.3f}",
          f"{r.result.samples_per_s_total:,.3f}"] for r in runs]), "", "![throughput](throughput.png)"]

    out += ["", "## Cost", "", _table(
        ["run", "USD/h per instance", "price checked", "cost per million samples"],
        [[r.label, f"${r.price.usd_per_hour:,.3f}", r.price.date_label() + ("" if r.price.verified else " (unverified)"),
          f"${r.cost_per_million:,.2f}"] for r in runs]), "", "![cost](cost.png)"]

    out += ["", "## Time and cost to target", "", f"Target: {what}.", "", _table(
        ["run", "hours", "USD"],
        [[r.label, f"{hours_to_target(samples, r.result.samples_per_s_total):,.2f}",
          f"${hours_to_target(samples, r.result.samples_per_s_total) * r.usd_per_hour_total:,.2f}"]
         for r in runs])]

    out += ["", "## Scaling efficiency", ""]
    scaling = scaling_table(runs)
    if scaling:
        name = {r.platform: r.platform_name for r in runs}
        rows = [[name[p], str(n), f"{sps:,.3f}", f"{eff:.1%}"] for p, pts in scaling.items() for n, sps, eff in pts]
        out += [_table(["platform", "nodes", "samples/s total", "efficiency"], rows), "", "![scaling](scaling.png)"]
    else:
        out += ["Each platform was measured at one node count only; bench the same config on 2, 4, ... "
                "nodes (runbooks/compare.md) to fill this section."]

    out += ["", "## Model FLOPs utilisation", "",
            f"Analytic FLOP model (`training/model/flops.py`): {first.train_flops_per_sample / 1e12:.4g} TFLOP per "
            "training sample (forward + backward = 3x forward; real caption tokens only, `mfu_padded` in the "
            "bench JSON counts the padding too), divided by each accelerator's dense peak.", "",
            _table(["run", "accelerator", "peak TFLOP/s", "MFU", "peak source"],
                   [[r.label, r.result.accelerator, _opt(r.result.peak_tflops_per_accelerator, "{:g}"),
                     _opt(r.result.mfu, "{:.1%}"), r.result.peak_source or "no published peak (CPU): MFU n/a"]
                    for r in runs])]
    if "mfu" in charts:
        out += ["", "![mfu](mfu.png)"]

    out += ["", "## Memory and compilation", "", _table(
        ["run", "peak memory GiB (rank 0)", "compiles", "compile s", "compiles in timed steps"],
        [[r.label, _gib(r.result.peak_memory_bytes), _opt(r.result.compile_count, "{}"),
          _opt(r.result.compile_seconds, "{:.1f}"), _opt(r.result.compiles_in_timed_steps, "{}")] for r in runs])]

    out += ["", "## Storage capacity note (FSx for Lustre)", "", *capacity_lines(runs, opts)]
    notes = [f"- {r.label}: {r.result.notes}" for r in runs if r.result.notes]
    if notes:
        out += ["", "## Notes from the runs", "", *notes]
    out += ["", "## Versions", "", _table(["run", "versions", "command"],
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
    lines.append(_table(["run", "bytes per sample", "samples/s per node x nodes", "MB/s needed",
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


# ----- entry point -------------------------------------------------------------------------

def fsx_from_cdk(path: Path) -> tuple[float, str] | None:
    """Provisioned MB/s from cdk.json context (fsxStorageGiB x fsxThroughputPerTiB), if present."""
    try:
        context = json.loads(path.read_text()).get("context", {})
    except (OSError, ValueError):
        return None
    gib, per = context.get("fsxStorageGiB"), context.get("fsxThroughputPerTiB")
    if not isinstance(gib, int | float) or not isinstance(per, int | float):
        return None
    return (fsx_provisioned_mbps(gib, per),
            f"{path.name} context: fsxStorageGiB {gib} x fsxThroughputPerTiB {per} MB/s/TiB")


def bytes_per_sample_from_index(source: str) -> float:
    from training.data.index import FeatureIndex

    src = source[: -len("/index.json")] if source.endswith("/index.json") else source
    index = FeatureIndex.load(src)
    if not index.bytes_per_sample:
        raise UserError(f"--features-index {source}: index has no bytes_per_sample")
    return float(index.bytes_per_sample)


def projection_prices(prices: PriceTable) -> tuple[PriceTable, str]:
    """The table the projection prices with: ``prices`` if it prices an accelerator instance
    type, else the shipped table (a demo's price file has only ``local``), with a note saying so."""
    if any(flops.instance_spec(name) for name in prices.prices):
        return prices, ""
    shipped = PriceTable.load(DEFAULT_PRICES)
    return shipped, (f"`{prices.path}` prices no accelerator instance type, so the projection uses "
                     f"`{shipped.path}` (list prices as of {shipped.as_of}).")


def build(result_paths: Sequence[str | Path], out: str | Path, *, prices_path: str | Path | None = None,
          opts: Options | None = None) -> Path:
    """Load, check, compute, draw and write ``out/report.md``; returns its path. ``prices_path``
    (one source) overrides ``opts.decision.prices``."""
    opts = opts or Options()
    if prices_path is not None:
        opts = dataclasses.replace(opts, decision=dataclasses.replace(opts.decision, prices=[str(prices_path)]))
    if not result_paths and not opts.project_only:
        raise UserError("report: give at least one bench result JSON, or --project for the projection alone")
    results = [(Path(p), BenchResult.load(p)) for p in result_paths]
    question = opts.question or projection.Question()
    prices, notes = assemble.resolve_prices(opts.decision, {r.instance_type for _, r in results} | {question.gpu,
                                                                                                   question.trn})
    runs = [Run(path=p, result=r, price=prices.get(r.instance_type)) for p, r in results]
    warnings = check_comparable(runs, opts.allow_mismatch) if runs else []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    accel = [r for r in runs if not r.result.is_cpu]  # CPU runs never set the projection's precision
    samples, what = target_samples(opts)
    question = dataclasses.replace(question, samples=samples, target=what)
    proj_prices, note = projection_prices(prices)
    assumptions = dataclasses.replace(opts.assumptions or projection.Assumptions(), price_as_of=(
        f"`{proj_prices.path}`, {proj_prices.as_of}"), **({"precision": accel[0].result.precision} if accel else {}))
    for flag, name, default in (("--gpu-instance", question.gpu, projection.DEFAULT_GPU),
                                ("--trn-instance", question.trn, projection.DEFAULT_TRN)):
        if name != default and name not in proj_prices.prices:
            raise UserError(f"{flag} {name}: no price in {proj_prices.path}; add prices.{name} there or pick one of "
                            f"{', '.join(n for n in proj_prices.prices if flops.instance_spec(n))}")
    lines = projection.section(runs, proj_prices.prices, assumptions, question, out, px=CHART_PX, dpi=_DPI)
    if note:
        lines[1:1] = ["", note]
    lines += serving_lines(opts.serving, prices, opts.decision.prices)
    extra = assemble.sections(opts.decision, table=prices, proj_table=proj_prices, notes=notes,
                              run_types={r.result.instance_type for r in runs}, runs=runs, a=assumptions, q=question,
                              out=out, px=CHART_PX, dpi=_DPI)
    report = out / "report.md"
    if not runs:
        report.write_text(render_projection_only(prices, lines, extra))
        return report
    charts = make_charts(runs, out)
    verdict = projection.verdict(runs, proj_prices.prices, assumptions, question)
    report.write_text(render(runs, prices, opts, charts, warnings, lines, verdict, extra))
    return report


def serving_lines(results: Sequence[str], table: PriceTable, sources: Sequence[str]) -> list[str]:
    """The "Serving" section (training/report/serving.py): projected cost per 1,000 images on inf2 vs
    GPU, plus the measured serving benches given with --serving. Endpoint prices: the ``serving``
    section of the shipped table, then of each --prices FILE, then the report's own prices (a
    measured run's instance type, e.g. ``local``)."""
    from training.report.aws_prices import parse_source
    from training.report.serving import section, serving_prices
    from training.serve.bench import ServeBenchResult

    files = [DEFAULT_PRICES, *(s for s in sources if parse_source(s)[0] == "file")]
    prices = {**serving_prices(files), **table.prices}
    return ["", *section([ServeBenchResult.load(p) for p in results], prices)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.report", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="*", metavar="RESULT.json", help="bench results (python -m training.bench)")
    p.add_argument("--out", required=True, help="output directory (report.md + PNG charts)")
    p.add_argument("--dataset-samples", type=int, help="dataset size for time/cost to target")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs for time/cost to target (default 1)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="compare runs that differ in preset/resolution/text tokens/precision")
    p.add_argument("--features-index", help="feature directory or its index.json (local or s3://): bytes/sample")
    p.add_argument("--fsx-throughput-mbps", type=float, help="provisioned FSx throughput, MB/s (overrides cdk.json)")
    p.add_argument("--fsx-storage-gib", type=float, help="FSx storage, GiB (with --fsx-throughput-per-tib)")
    p.add_argument("--fsx-throughput-per-tib", type=float, help="FSx MB/s per TiB (125/250/500/1000)")
    p.add_argument("--cdk-json", default=str(REPO / "cdk.json"), help="where to read FSx defaults from")
    p.add_argument("--serving", action="append", default=[], metavar="SERVE_BENCH.json",
                   help="serving bench result (python -m training.serve.bench); repeat for each endpoint")
    g = p.add_argument_group("projection (every report has it; --project alone needs no result files)")
    g.add_argument("--project", action="store_true", help="write the projection even without result files")
    g.add_argument("--preset", action="append", help=f"preset to project (repeat; default {', '.join(projection.DEFAULT_PRESETS)})")
    g.add_argument("--mfu-band", metavar="LO,HI", help="assumed MFU band for every platform (default: per "
                   "platform, --mfu-band-gpu / --mfu-band-trn)")
    g.add_argument("--scaling-per-doubling", type=float, default=0.95,
                   help="assumed scaling efficiency kept per doubling of nodes (default %(default)s)")
    g.add_argument("--real-text-tokens", type=float,
                   help="mean real caption length (default: read from --features-index when its length matches)")
    g.add_argument("--nodes", type=int, default=1, help="node count for the projected target (default 1)")
    g.add_argument("--budget-usd", type=float, help="budget in dollars for the target")
    g.add_argument("--budget-hours", type=float, help="wall-clock budget in hours for the target")
    g.add_argument("--max-nodes", type=int, default=16, help="most nodes a budget answer may use (default 16)")
    g.add_argument("--gpu-instance", default=projection.DEFAULT_GPU, help="GPU side of the break-even headline")
    g.add_argument("--trn-instance", default=projection.DEFAULT_TRN, help="Trainium side of the break-even headline")
    assemble.add_arguments(p)
    return p


def projection_inputs(args: argparse.Namespace) -> tuple[projection.Assumptions, projection.Question]:
    """The projection's assumptions and question from the command line; UserError naming the flag."""
    from training.model.build import PRESETS

    for preset in args.preset or ():
        if preset not in PRESETS:
            raise UserError(f"--preset {preset}: unknown; choose from {', '.join(sorted(PRESETS))}")
    for flag in ("nodes", "max_nodes"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')}: must be >= 1")
    for flag in ("budget_usd", "budget_hours", "real_text_tokens"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise UserError(f"--{flag.replace('_', '-')}: must be > 0")
    real, source = args.real_text_tokens, "--real-text-tokens (given)"
    if real is None and args.features_index:
        mean, n, padded = projection.mean_real_text_tokens(args.features_index)
        if padded == projection.DEFAULT_TEXT_TOKENS:
            real, source = mean, f"mean {mean:.1f} over {n} samples of {args.features_index}"
        else:
            source = (f"not applied: {args.features_index} pads captions to {padded} tokens (mean {mean:.1f} real), "
                      f"not the presets' {projection.DEFAULT_TEXT_TOKENS}; every padded token counted")
    assumptions = projection.Assumptions(
        **assemble.mfu_bands(args), scaling_per_doubling=args.scaling_per_doubling, real_text_tokens=real,
        **({"real_tokens_source": source} if real is not None or args.features_index else {}))
    question = projection.Question(presets=tuple(args.preset or projection.DEFAULT_PRESETS), nodes=args.nodes,
                                   budget_usd=args.budget_usd, budget_hours=args.budget_hours,
                                   max_nodes=args.max_nodes, gpu=args.gpu_instance, trn=args.trn_instance)
    return assumptions, question


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.dataset_samples is not None and args.dataset_samples < 1:
        raise UserError("--dataset-samples: must be >= 1")
    if not args.epochs > 0:
        raise UserError("--epochs: must be > 0")
    if not args.results and not args.project:
        raise UserError("report: give at least one bench result JSON, or --project for the projection alone")
    assumptions, question = projection_inputs(args)
    opts = Options(dataset_samples=args.dataset_samples, epochs=args.epochs, allow_mismatch=args.allow_mismatch,
                   project_only=args.project, assumptions=assumptions, question=question,
                   decision=assemble.options(args), serving=tuple(args.serving))
    if args.features_index:
        opts.bytes_per_sample = bytes_per_sample_from_index(args.features_index)
        opts.features_index = args.features_index
    if args.fsx_throughput_mbps:
        opts.fsx_mbps, opts.fsx_source = args.fsx_throughput_mbps, "--fsx-throughput-mbps"
    elif args.fsx_storage_gib or args.fsx_throughput_per_tib:
        if not (args.fsx_storage_gib and args.fsx_throughput_per_tib):
            raise UserError("--fsx-storage-gib and --fsx-throughput-per-tib: give both (or --fsx-throughput-mbps)")
        opts.fsx_mbps = fsx_provisioned_mbps(args.fsx_storage_gib, args.fsx_throughput_per_tib)
        opts.fsx_source = (f"--fsx-storage-gib {args.fsx_storage_gib:g} x --fsx-throughput-per-tib "
                           f"{args.fsx_throughput_per_tib:g} MB/s/TiB")
    elif (found := fsx_from_cdk(Path(args.cdk_json))) is not None:
        opts.fsx_mbps, opts.fsx_source = found
    report = build(args.results, args.out, opts=opts)
    print(f"report: {report} (charts in {report.parent})", flush=True)


if __name__ == "__main__":
    main()
