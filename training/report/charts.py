"""The report's charts of measured runs (PNG, matplotlib Agg): throughput per accelerator and
per instance, cost per million samples, MFU, and scaling when a platform was measured at
several node counts. Every chart is ``CHART_PX`` pixels (figsize x dpi, no tight bbox), the
size the tests check, and carries a red footnote when any run is a CPU run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from training.report.runs import Run, scaling_table

#: chart size in pixels (width, height): figsize x dpi, no tight bbox, so tests can check it
CHART_PX = (960, 540)
DPI = 100


def _figure(ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(CHART_PX[0] / DPI, CHART_PX[1] / DPI), dpi=DPI)
    return plt, fig, axes


def _save(plt, fig, path: Path, cpu: bool) -> Path:
    if cpu:
        fig.text(0.5, 0.01, "CPU figures from a local run - not accelerator figures", ha="center",
                 fontsize=9, color="firebrick")
    fig.subplots_adjust(bottom=0.3, top=0.88, wspace=0.35)
    fig.savefig(path, dpi=DPI)
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
