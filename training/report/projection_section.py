"""The report's projection section in Markdown: the assumptions, the per-preset table at the
band's low/mid/high MFU (or the measured one), the break-even, the measured runs against it,
the budget answer, and the one sentence (``verdict``) the recommendation quotes. The numbers
come from training/report/projection.py; this module only decides what is said about them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from training.report.budget import budget_lines
from training.report.markdown import duration, table, usd
from training.report.measured_points import (
    MeasuredPoint,
    RunLike,
    best_measured,
    chart_workload,
    measured_points,
)
from training.report.projection import (
    Assumptions,
    Platform,
    PriceLike,
    Question,
    break_even_cost_ratio,
    break_even_time_ratio,
    cost_per_million,
    hours_to_target,
    pair,
    platforms,
    samples_per_s_per_instance,
    workload,
)
from training.report.projection_chart import make_chart


def section(runs: Sequence[RunLike], prices: Mapping[str, PriceLike], a: Assumptions, q: Question, out: Path,
            *, px: tuple[int, int], dpi: int) -> list[str]:
    """The projection section of the report (and its chart, ``out/projection.png``)."""
    plats = platforms(prices, a.precision)
    if not plats:
        return ["## Projection", "", "No instance type in the price table has a known accelerator layout "
                "(training/model/flops.py INSTANCE_TYPES), so nothing can be projected."]
    gpu, trn = pair(plats, q)
    unverified = sorted(p.short for p in plats if not p.price_verified)
    w = chart_workload(runs, a, q.presets[0])
    points, other = measured_points(runs, w)
    best = best_measured(points)
    measured_list = ", ".join(f"{k.removeprefix('ml.')} ({v.mfu:.1%}, `{v.path.name}`)" for k, v in best.items())
    bands = ([("MFU", a.typical_mfu, a.typical_source)] if a.typical_mfu == a.typical_mfu_trn else
             [("MFU, GPU", a.typical_mfu, a.typical_source), ("MFU, Trainium", a.typical_mfu_trn, a.typical_source_trn)])
    lines = ["## Projection: cost and time as a function of MFU", "",
             "Computed from the FLOP model (`training/model/flops.py`), each accelerator's dense peak (datasheet cited "
             "there) and the price table, before any accelerator has been measured. **Assumptions** (each "
             "figure below names the ones it uses):", "",
             *(f"- **{name}** {lo:.0%}-{hi:.0%}, mid {(lo + hi) / 2:.1%}: {src}." for name, (lo, hi), src in bands),
             *([f"- **Measured MFU replaces the band** for {measured_list} in the {w.name} rows, the break-even "
                "diamond, the verdict and the budget."] if best else []),
             f"- **Scaling efficiency** {a.scaling_per_doubling:.0%} kept per doubling of nodes (assumed; "
             f"{a.scaling_efficiency(2):.0%} at 2, {a.scaling_efficiency(4):.1%} at 4, "
             f"{a.scaling_efficiency(8):.1%} at 8 nodes) until runs at several node counts are measured.",
             f"- **Prices** on-demand, {a.price_as_of}"
             + (f", unverified: {', '.join(unverified)}" if unverified else "") + " (sources: section Prices).",
             f"- **Captions** padded to {a.text_tokens} tokens; real tokens: {a.real_tokens_source}.",
             f"- **Precision** `{a.precision}` (peaks for it).", ""]
    rows = []
    for preset in q.presets:
        wp = workload(preset, a)
        for p in plats:
            lo, hi = a.band(p.backend)
            m = best[p.instance_type].mfu if p.instance_type in best and w.name == preset else None
            mfus = (m,) if m is not None else (lo, (lo + hi) / 2, hi)
            h = hours_to_target(wp, p, mfus[len(mfus) // 2], q.samples, q.nodes, a)
            rows.append([preset, p.short, f"{wp.flops_per_sample / 1e12:.3g}", f"{wp.padding_share:.0%}",
                         f"measured {m:.1%}" if m is not None else f"{lo:.0%}-{hi:.0%}",
                         " / ".join(f"{samples_per_s_per_instance(wp, p, x):,.0f}" for x in mfus),
                         " / ".join(f"${cost_per_million(wp, p, x):,.2f}" for x in mfus),
                         f"{duration(h)}, {usd(h * q.nodes * p.usd_per_hour)}",
                         f"MFU {'measured' if m is not None else 'assumed'}; {a.scaling_label(q.nodes)}; price "
                         f"{p.price_checked or 'undated'}" + ("" if p.price_verified else " unverified")])
    lines += [f"Target: {q.target} on {q.nodes} node{'s' if q.nodes != 1 else ''}.", "",
              table(["preset", "instance", "TFLOP/sample", "padding", "MFU band", "samples/s per instance at "
                     "band low / mid / high", "USD per 1M samples at low / mid / high", "target at mid MFU",
                     "assumes"], rows), ""]

    if gpu is not None and trn is not None:
        lines += _break_even_lines(plats, gpu, trn, a, q)
    ref_gpu = best[gpu.instance_type].mfu if gpu is not None and gpu.instance_type in best else a.mid("gpu")
    make_chart(out / "projection.png", w, plats, a, points, [r.label for r in other], gpu=gpu, trn=trn,
               ref_gpu_mfu=ref_gpu, px=px, dpi=dpi)
    lines += ["", "![projection](projection.png)", "",
              f"The chart draws {w.name} ({w.flops_per_sample / 1e12:.3g} TFLOP per sample); the shaded bands are "
              f"the assumed MFU; the diamond is where {trn.short if trn else 'Trainium'} matches "
              f"{gpu.short if gpu else 'the GPU'}'s cost at "
              + (f"its measured {ref_gpu:.1%} MFU." if gpu and gpu.instance_type in best
                 else f"its band's mid {ref_gpu:.1%} (assumed).")]
    lines += ["", "### Measured runs on the projection", "", *_measured_lines(points, other, best, gpu, trn, a)]
    measured = {k: v.mfu for k, v in best.items()}
    lines += ["", "### Budget", "", *budget_lines(w, plats, a, q, measured)]
    return lines


def _break_even_lines(plats: Sequence[Platform], gpu: Platform, trn: Platform, a: Assumptions,
                      q: Question) -> list[str]:
    r = break_even_cost_ratio(gpu, trn)
    t1 = break_even_time_ratio(gpu, trn, 1, 1, a)
    match = t1  # trn nodes per gpu node at equal MFU and no scaling loss
    lines = ["### Break-even", "",
             f"**Cost per sample:** {trn.short} costs the same per sample as {gpu.short} when its MFU is "
             f"**{r:.2f}x** the GPU's (= (USD/h / peak FLOP/s) of {trn.short}, ${trn.usd_per_hour:,.2f} / "
             f"{trn.instance_peak_flops / 1e15:.2f} PFLOP/s, over that of {gpu.short}, ${gpu.usd_per_hour:,.2f} / "
             f"{gpu.instance_peak_flops / 1e15:.2f} PFLOP/s). Above that ratio Trainium is cheaper per sample, "
             f"below it the GPU; e.g. at {a.mid('gpu'):.1%} GPU MFU Trainium must reach {r * a.mid('gpu'):.1%}. "
             f"The ratio depends only on prices and peaks (prices {gpu.price_checked or 'undated'}/"
             f"{trn.price_checked or 'undated'}"
             + ("" if gpu.price_verified and trn.price_verified else ", unverified") + "), not on the preset.",
             "",
             f"**Time to target:** on the same node count {trn.short} needs **{t1:.2f}x** the GPU's MFU to finish "
             f"as fast; at equal MFU it takes about {math.ceil(match - 1e-9)} {trn.short} nodes per {gpu.short} "
             f"node (more with the assumed scaling loss). The ratio moves in proportion to the price ratio and "
             "to nothing else here: section Price scenarios shows it under a plan discount and your own prices.", ""]
    rows = []
    for g in (p for p in plats if p.backend == "gpu"):
        for t in (p for p in plats if p.backend == "trainium"):
            n = q.nodes
            rows.append([g.short, t.short, f"{break_even_cost_ratio(g, t):.2f}",
                         f"{break_even_time_ratio(g, t, n, n, a):.2f}",
                         f"price {g.price_checked or 'undated'}/{t.price_checked or 'undated'}; "
                         f"{a.scaling_label(n)} both"])
    lines.append(table(["GPU", "Trainium", "MFU ratio trn/gpu for equal cost per sample",
                        f"MFU ratio for equal time on {q.nodes} node{'s' if q.nodes != 1 else ''} each",
                        "assumes"], rows))
    return lines


def verdict(runs: Sequence[RunLike], prices: Mapping[str, PriceLike], a: Assumptions, q: Question) -> str | None:
    """The break-even sentence for the recommendation paragraph, or None while no accelerator
    run of the headline pair is measured (CPU runs never count)."""
    plats = platforms(prices, a.precision)
    gpu, trn = pair(plats, q)
    if gpu is None or trn is None:
        return None
    points, other = measured_points(runs, chart_workload(runs, a, q.presets[0]))
    best = best_measured(points)
    if gpu.instance_type not in best and trn.instance_type not in best:
        return None
    return _measured_lines(points, [], best, gpu, trn, a)[-1]


def _measured_lines(points: Sequence[MeasuredPoint], other: Sequence[RunLike], best: Mapping[str, MeasuredPoint],
                    gpu: Platform | None, trn: Platform | None, a: Assumptions) -> list[str]:
    lines = []
    if other:
        lines.append("CPU runs (labelled, not placed on the chart, and never part of the recommendation: a CPU has "
                     "no published accelerator peak, so it has no MFU): "
                     + ", ".join(f"{r.label} (`{r.path.name}`)" for r in other) + ".")
        lines.append("")
    if points:
        lines.append(table(["run", "measured MFU (chart FLOP count)", "measured USD per 1M samples", "file"],
                           [[p.label, f"{p.mfu:.1%}", f"${p.cost_per_million:,.2f}", f"`{p.path.name}`"]
                            for p in points]))
        lines.append("")
    if gpu is None or trn is None:
        return lines + ["Only one accelerator family is priced, so there is no break-even to compare against."]
    r = break_even_cost_ratio(gpu, trn)
    g, t = best.get(gpu.instance_type), best.get(trn.instance_type)
    if g and t:
        ratio = t.mfu / g.mfu
        side = "Trainium" if ratio > r else "GPU"
        lines.append(f"Measured: {trn.short} at {t.mfu:.1%} MFU and {gpu.short} at {g.mfu:.1%}, a ratio of "
                     f"{ratio:.2f} against the break-even {r:.2f}: {ratio / r - 1:+.0%} from it, on the "
                     f"**{side}** side; {side} is cheaper per sample by "
                     f"{abs(1 - min(t.cost_per_million, g.cost_per_million) / max(t.cost_per_million, g.cost_per_million)):.0%} "
                     f"(${t.cost_per_million:,.2f} vs ${g.cost_per_million:,.2f} per million samples, prices "
                     f"{trn.price_checked}/{gpu.price_checked}).")
    elif g:
        need = r * g.mfu
        where = "inside" if a.typical_mfu_trn[0] <= need <= a.typical_mfu_trn[1] else "outside"
        lines.append(f"Measured {gpu.short} at {g.mfu:.1%} MFU: {trn.short} is cheaper per sample only if it reaches "
                     f"{need:.1%} MFU ({where} the assumed band); bench {trn.short} to settle it.")
    elif t:
        need = t.mfu / r
        lines.append(f"Measured {trn.short} at {t.mfu:.1%} MFU: {gpu.short} is cheaper per sample only if it reaches "
                     f"{need:.1%} MFU" + (" (above 100%: it cannot)" if need > 1 else "")
                     + f"; bench {gpu.short} to settle it.")
    else:
        lines.append(f"No accelerator run yet: the recommendation rests on the assumed band. Bench {gpu.short} and "
                     f"{trn.short} (runbooks/compare.md) and their runs land on these curves.")
    return lines
