"""The projection chart (``projection.png``): cost per million samples against MFU, one curve
per priced instance type, the assumed MFU bands shaded, the GPU/Trainium break-even marked
and the measured runs as points. Drawn with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from training.model import flops
from training.report.measured_points import MeasuredPoint
from training.report.projection import (
    Assumptions,
    Platform,
    Workload,
    break_even_cost_ratio,
    cost_per_million,
)

#: chart x range (MFU); the assumed bands and their evidence: training/report/mfu_evidence.py
MFU_AXIS = (0.05, 0.70)


def make_chart(path: Path, w: Workload, plats: Sequence[Platform], a: Assumptions, points: Sequence[MeasuredPoint],
               cpu_labels: Sequence[str], *, gpu: Platform | None, trn: Platform | None, ref_gpu_mfu: float,
               px: tuple[int, int], dpi: int) -> Path:
    """Cost per million samples against MFU, one curve per instance type, the typical band
    shaded, the break-even marked, measured runs as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(px[0] / dpi, px[1] / dpi), dpi=dpi)
    xs = [MFU_AXIS[0] + i * (MFU_AXIS[1] - MFU_AXIS[0]) / 200 for i in range(201)]
    for which, (lo, hi) in ({"GPU": a.typical_mfu, "Trainium": a.typical_mfu_trn} if a.typical_mfu != a.typical_mfu_trn
                            else {"every platform": a.typical_mfu}).items():
        ax.axvspan(lo, hi, color="0.88" if which != "Trainium" else "none", hatch="//" if which == "Trainium" else None,
                   ec="0.7", lw=0, zorder=0, label=f"assumed MFU band, {which}: {lo:.0%}-{hi:.0%}")
    colours = {}
    for p in plats:
        style = "-" if p.backend == "gpu" else "--"
        (line,) = ax.plot(xs, [cost_per_million(w, p, x) for x in xs], style, lw=2 if p in (gpu, trn) else 1,
                          label=f"{p.short} ({p.devices} x {p.accelerator})")
        colours[p.instance_type] = line.get_color()
    if gpu is not None and trn is not None:
        ratio = break_even_cost_ratio(gpu, trn)
        m_trn = ratio * ref_gpu_mfu
        y = cost_per_million(w, gpu, ref_gpu_mfu)
        ax.plot([ref_gpu_mfu, m_trn], [y, y], ":", color="black", lw=1)
        ax.plot([ref_gpu_mfu], [y], "o", color="black", ms=5)
        ax.plot([m_trn], [y], "D", color="black", ms=7, zorder=5)
        ax.annotate(f"break-even: {trn.short} at {m_trn:.1%} MFU\ncosts what {gpu.short} does at "
                    f"{ref_gpu_mfu:.1%}\n(MFU ratio {ratio:.2f})", (m_trn, y), textcoords="offset points",
                    xytext=(-40, -80), fontsize=8, arrowprops={"arrowstyle": "-", "lw": 0.6},
                    bbox={"boxstyle": "round", "fc": "white", "ec": "0.6", "alpha": 0.9}, zorder=7)
    for pt in points:
        ax.plot([pt.mfu], [pt.cost_per_million], "*", ms=14, color=colours.get(pt.instance_type, "red"),
                markeredgecolor="black", zorder=6)
        gpu_side = flops.instance_spec(pt.instance_type) is not None and "trn" not in pt.instance_type
        ax.annotate(f"measured {pt.label}: {pt.mfu:.1%}, ${pt.cost_per_million:,.2f}",
                    (pt.mfu, pt.cost_per_million), textcoords="offset points",
                    xytext=(10, 14) if gpu_side else (14, -22), fontsize=8,
                    bbox={"boxstyle": "round", "fc": "lightyellow", "ec": "0.6", "alpha": 0.9}, zorder=7)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"${v:,.4g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlim(*MFU_AXIS)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=0))
    ax.set_xlabel("MFU (useful training FLOP/s / dense peak)")
    ax.set_ylabel("USD per million training samples (log)")
    ax.set_title(f"Projected cost per million samples: {w.name}, {w.flops_per_sample / 1e12:.3g} TFLOP/sample",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    foot = (f"Prices: {a.price_as_of}. Shaded: assumed MFU band (evidence: training/report/mfu_evidence.py; "
            "hatched: Trainium); solid = GPU, dashed = Trainium.")
    if cpu_labels:
        foot += f" CPU runs not placed (no accelerator peak): {', '.join(cpu_labels)}."
    fig.text(0.5, 0.01, foot, ha="center", fontsize=7, color="firebrick" if cpu_labels else "0.3", wrap=True)
    fig.subplots_adjust(bottom=0.14, top=0.92, left=0.09, right=0.97)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
