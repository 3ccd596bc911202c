"""The accelerator decision before (and after) measurement: projected cost and time per preset
and instance type as a function of MFU, the GPU/Trainium break-even, budget answers, and
measured bench runs placed on the same curves.

Why a projection: no accelerator has to be benchmarked to frame the decision. What is known
is the FLOP model per preset (``training/model/flops.py``), each accelerator's dense peak (the same
file, with its datasheet), and list prices (``training/prices.yaml``); what is not known is
the MFU each platform reaches on Sana. So every figure here is a function of MFU, shown over a
range, and the assumptions (MFU band, scaling efficiency per node count, price date) are
printed beside the figures they drive. When bench JSONs arrive they sit on the same curves and
replace the assumed MFU.

Formulas (tests/report/test_projection.py checks them by hand):
- instance peak R = dense peak per device (TFLOP/s, for the precision) x 1e12 x devices per instance
- samples/s per instance at MFU m = m x R / F, F = training FLOPs per sample (real tokens, below)
- cost per million samples = USD/h / (samples/s per instance x 3600) x 1e6 = USD/h x F x 1e6 / (3600 m R)
- hours to target at n nodes = samples / (n x eff(n) x samples/s per instance) / 3600
- cost to target = hours x n x USD/h
- eff(n) = scaling efficiency (an assumption until measured) = per_doubling ** log2(n)
- break-even MFU ratio for cost per sample (m_trn / m_gpu at equal cost):
      r_cost = (USD/h_trn / R_trn) / (USD/h_gpu / R_gpu)
  Trainium is cheaper per sample iff m_trn / m_gpu > r_cost.
- break-even MFU ratio for time to target on n_trn vs n_gpu nodes:
      r_time = (n_gpu eff(n_gpu) R_gpu) / (n_trn eff(n_trn) R_trn)

MFU here counts useful FLOPs: with a mean real caption length the text terms count real
tokens only (``flops.train_flops_per_sample(..., real_text_tokens=...)``); without one, every
padded token counts, which is what ``training.perf.bench`` writes into its JSON today. A measured
run is placed at the MFU its own samples/s gives under the chart's FLOP count, so with the same
count it sits exactly at its JSON ``mfu``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from training.errors import UserError
from training.model import flops
from training.report import mfu_evidence

#: Presets projected by default (the real Sana sizes; "tiny" is for tests only).
DEFAULT_PRESETS = ("sana-600m-512", "sana-1600m-1024")
#: precompute's default max_text_tokens (training/data/precompute.py PrecomputeConfig), Sana's 300
DEFAULT_TEXT_TOKENS = 300
#: the pair the break-even headline compares (p5 vs trn1, the issue's question)
DEFAULT_GPU = "ml.p5.48xlarge"
DEFAULT_TRN = "ml.trn1.32xlarge"

#: chart x range (MFU); the assumed bands and their evidence: training/report/mfu_evidence.py
MFU_AXIS = (0.05, 0.70)


class PriceLike(Protocol):
    usd_per_hour: float
    checked: str
    verified: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assumptions:
    """Everything the projection assumes rather than measures; printed beside the figures."""

    typical_mfu: tuple[float, float] = mfu_evidence.GPU_BAND  # GPU instance types
    typical_source: str = dataclasses.field(default_factory=mfu_evidence.gpu_source)
    typical_mfu_trn: tuple[float, float] = mfu_evidence.TRN_BAND  # Trainium instance types
    typical_source_trn: str = mfu_evidence.TRN_SOURCE
    #: efficiency kept per doubling of nodes (data-parallel all-reduce over EFA): an assumption
    scaling_per_doubling: float = 0.95
    precision: str = "bf16-mixed"
    #: padded caption length the model computes on
    text_tokens: int = DEFAULT_TEXT_TOKENS
    #: mean real caption length (None: count every padded token) and where it comes from
    real_text_tokens: float | None = None
    real_tokens_source: str = "not given: every padded token counted (pass --features-index or --real-text-tokens)"
    price_as_of: str = ""

    def __post_init__(self) -> None:
        for flag, (lo, hi) in (("--mfu-band-gpu", self.typical_mfu), ("--mfu-band-trn", self.typical_mfu_trn)):
            if not 0 < lo < hi <= 1:
                raise UserError(f"{flag} {lo:g},{hi:g}: give LO,HI with 0 < LO < HI <= 1, e.g. 0.15,0.40")
        if not 0 < self.scaling_per_doubling <= 1:
            raise UserError(f"--scaling-per-doubling {self.scaling_per_doubling:g}: must be in (0, 1], e.g. 0.95")

    def band(self, backend: str) -> tuple[float, float]:
        """The assumed MFU band of a platform ("gpu" | "trainium")."""
        return self.typical_mfu_trn if backend == "trainium" else self.typical_mfu

    def mid(self, backend: str) -> float:
        return sum(self.band(backend)) / 2

    def scaling_efficiency(self, nodes: int) -> float:
        return self.scaling_per_doubling ** math.log2(nodes) if nodes > 1 else 1.0

    def scaling_label(self, nodes: int) -> str:
        if nodes == 1:
            return "1 node (no scaling loss)"
        return f"{nodes} nodes at {self.scaling_efficiency(nodes):.0%} efficiency assumed"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Platform:
    """A priced instance type with a known accelerator layout."""

    instance_type: str
    backend: str  # "gpu" | "trainium"
    accelerator: str
    devices: int
    peak_tflops: float  # per device, for the precision
    peak_source: str
    usd_per_hour: float
    price_checked: str
    price_verified: bool

    @property
    def instance_peak_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.devices

    @property
    def short(self) -> str:
        return self.instance_type.removeprefix("ml.")

    def price_label(self) -> str:
        return f"${self.usd_per_hour:,.2f}/h list price {self.price_checked}" + (
            "" if self.price_verified else ", unverified")


def platforms(prices: Mapping[str, PriceLike], precision: str) -> list[Platform]:
    """Every instance type of the price table whose accelerator layout ``flops`` knows."""
    out = []
    for name, price in prices.items():
        spec = flops.instance_spec(name)
        if spec is None:
            continue  # "local" and other unpriceable-by-peak entries
        acc = flops.ACCELERATORS[spec.accelerator]
        peak = acc.peak_fp32_tflops if precision == "fp32" else acc.peak_bf16_tflops
        out.append(Platform(instance_type=name, backend="trainium" if "trn" in name else "gpu",
                            accelerator=spec.accelerator, devices=spec.devices, peak_tflops=peak,
                            peak_source=acc.source, usd_per_hour=price.usd_per_hour,
                            price_checked=price.checked, price_verified=price.verified))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """One model configuration: what a sample costs in FLOPs."""

    name: str
    latent_hw: tuple[int, int]
    text_tokens: int
    real_text_tokens: float | None
    flops_per_sample: float  # training FLOPs, real tokens where known (the projection's F)
    padded_flops_per_sample: float  # what the device computes (padded captions)

    @property
    def padding_share(self) -> float:
        """Fraction of the computed FLOPs spent on caption padding."""
        return 1 - self.flops_per_sample / self.padded_flops_per_sample


def workload(preset: str, assumptions: Assumptions, *, overrides: Mapping[str, Any] | None = None,
             latent_hw: Sequence[int] | None = None, text_tokens: int | None = None) -> Workload:
    from training.model.build import PRESETS

    if preset not in PRESETS:
        raise UserError(f"--preset {preset}: unknown; choose from {', '.join(sorted(PRESETS))}")
    kwargs = {**PRESETS[preset], **dict(overrides or {})}
    side = int(kwargs["sample_size"])
    hw = (int(latent_hw[0]), int(latent_hw[1])) if latent_hw else (side, side)
    t = int(text_tokens or assumptions.text_tokens)
    real = min(assumptions.real_text_tokens, t) if assumptions.real_text_tokens is not None else None
    padded = flops.train_flops_per_sample(kwargs, t, hw)
    useful = flops.train_flops_per_sample(kwargs, t, hw, real_text_tokens=real)
    return Workload(name=preset + (f" {json.dumps(dict(overrides))}" if overrides else ""), latent_hw=hw,
                    text_tokens=t, real_text_tokens=real, flops_per_sample=useful, padded_flops_per_sample=padded)


# ----- the numbers -------------------------------------------------------------------------

def duration(hours: float) -> str:
    """Hours as a reader wants them: "12.50 h", or minutes/seconds for short CPU demo targets."""
    if hours >= 0.1:
        return f"{hours:,.2f} h"
    if hours * 60 >= 1:
        return f"{hours * 60:.1f} min"
    return f"{hours * 3600:.1f} s"


def usd(x: float) -> str:
    """Dollars: whole above $100, cents below (a demo-sized target costs cents)."""
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"


def samples_per_s_per_instance(w: Workload, p: Platform, mfu: float) -> float:
    return mfu * p.instance_peak_flops / w.flops_per_sample


def cost_per_million(w: Workload, p: Platform, mfu: float) -> float:
    return p.usd_per_hour / (samples_per_s_per_instance(w, p, mfu) * 3600.0) * 1e6


def hours_to_target(w: Workload, p: Platform, mfu: float, samples: float, nodes: int, a: Assumptions) -> float:
    return samples / (nodes * a.scaling_efficiency(nodes) * samples_per_s_per_instance(w, p, mfu)) / 3600.0


def cost_to_target(w: Workload, p: Platform, mfu: float, samples: float, nodes: int, a: Assumptions) -> float:
    return hours_to_target(w, p, mfu, samples, nodes, a) * nodes * p.usd_per_hour


def break_even_cost_ratio(gpu: Platform, trn: Platform) -> float:
    """m_trn / m_gpu at which both cost the same per sample (independent of the workload)."""
    return (trn.usd_per_hour / trn.instance_peak_flops) / (gpu.usd_per_hour / gpu.instance_peak_flops)


def break_even_time_ratio(gpu: Platform, trn: Platform, gpu_nodes: int, trn_nodes: int, a: Assumptions) -> float:
    """m_trn / m_gpu at which both reach a target in the same time on the given node counts."""
    return ((gpu_nodes * a.scaling_efficiency(gpu_nodes) * gpu.instance_peak_flops)
            / (trn_nodes * a.scaling_efficiency(trn_nodes) * trn.instance_peak_flops))


# ----- real caption lengths from the data ---------------------------------------------------

def mean_real_text_tokens(features: str, *, max_samples: int = 4096) -> tuple[float, int, int]:
    """(mean real caption tokens, samples read, padded max_text_tokens) of a feature directory.

    Reads only the safetensors headers of the first shards' members (8-byte length + JSON,
    https://github.com/huggingface/safetensors#format): ``text`` is stored as [n_real, D],
    unpadded (training/data.py ShardWriter.add).
    """
    from training.data.index import FeatureIndex

    src = features[: -len("/index.json")] if features.endswith("/index.json") else features
    index = FeatureIndex.load(src)
    counts: list[int] = []
    # s3://: fetch downloads whole shards, so one is enough; local tars are read header by header
    for shard in [s for s in index.shards if s.samples][: 1 if index.is_s3 else None]:
        with tarfile.open(index.fetch(shard.name), "r") as tar:
            for member in tar:
                fh = tar.extractfile(member)
                if fh is None:
                    continue
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
                counts.append(int(header["text"]["shape"][0]))
                if len(counts) >= max_samples:
                    break
        if len(counts) >= max_samples:
            break
    if not counts:
        raise UserError(f"--features-index {features}: no samples to read caption lengths from")
    return sum(counts) / len(counts), len(counts), index.max_text_tokens


# ----- measured runs ---------------------------------------------------------------------------

class RunLike(Protocol):
    path: Path
    result: Any
    price: PriceLike

    @property
    def label(self) -> str: ...

    @property
    def cost_per_million(self) -> float: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredPoint:
    label: str
    instance_type: str
    mfu: float  # on the chart's FLOP count (= the JSON mfu when the counts agree)
    cost_per_million: float
    path: Path


def measured_points(runs: Sequence[RunLike], w: Workload) -> tuple[list[MeasuredPoint], list[RunLike]]:
    """(accelerator runs placed on the chart, CPU/unplaceable runs). A run's x is its achieved
    FLOP/s per device under the chart's FLOP count over its peak; its y is its measured cost."""
    placed, other = [], []
    for run in runs:
        r = run.result
        if r.is_cpu or r.mfu is None or r.peak_tflops_per_accelerator is None:
            other.append(run)
            continue
        mfu = r.samples_per_s_per_accelerator * w.flops_per_sample / (r.peak_tflops_per_accelerator * 1e12)
        placed.append(MeasuredPoint(label=run.label, instance_type=r.instance_type, mfu=mfu,
                                    cost_per_million=run.cost_per_million, path=run.path))
    return placed, other


def chart_workload(runs: Sequence[RunLike], a: Assumptions, preset: str) -> Workload:
    """The configuration the chart draws: the first accelerator run's (so its points sit on
    the curves, with its own FLOP count scaled to real tokens), else ``preset``."""
    from training.model.build import PRESETS

    for run in runs:
        r = run.result
        if r.is_cpu or r.mfu is None or r.model_preset not in PRESETS:
            continue
        w = workload(r.model_preset, a, overrides=r.model_overrides, latent_hw=r.latent_hw, text_tokens=r.text_tokens)
        scale = w.flops_per_sample / w.padded_flops_per_sample
        return dataclasses.replace(w, flops_per_sample=r.train_flops_per_sample * scale,
                                   padded_flops_per_sample=r.train_flops_per_sample)
    return workload(preset, a)


def best_measured(points: Sequence[MeasuredPoint]) -> dict[str, MeasuredPoint]:
    """instance type -> its highest-MFU measured point."""
    best: dict[str, MeasuredPoint] = {}
    for p in points:
        if p.instance_type not in best or p.mfu > best[p.instance_type].mfu:
            best[p.instance_type] = p
    return best


# ----- budget questions -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetAnswer:
    platform: Platform
    nodes: int
    hours: float
    usd: float
    mfu: float
    mfu_measured: bool
    depends_most_on: str


def answer_budget(w: Workload, plats: Sequence[Platform], a: Assumptions, samples: float, *,
                  budget_usd: float | None, budget_hours: float | None, max_nodes: int,
                  measured: Mapping[str, float]) -> tuple[BudgetAnswer | None, list[BudgetAnswer]]:
    """(the pick, one best answer per platform). With an hours budget: fewest nodes that meet
    it, cheapest platform wins; with only a dollar budget: the most nodes it affords, fastest
    platform wins; with both: both must hold, cheapest wins."""
    per: list[BudgetAnswer] = []
    for p in plats:
        mfu = measured.get(p.instance_type, a.mid(p.backend))
        options = []
        for n in range(1, max_nodes + 1):
            h = hours_to_target(w, p, mfu, samples, n, a)
            c = h * n * p.usd_per_hour
            if (budget_hours is None or h <= budget_hours) and (budget_usd is None or c <= budget_usd):
                options.append((n, h, c))
        if not options:
            continue
        n, h, c = options[0] if budget_hours is not None else options[-1]
        depends = _depends_most_on(w, p, mfu, samples, n, a, measured)
        if p.instance_type not in measured:
            lo = a.band(p.backend)[0]
            h_lo = hours_to_target(w, p, lo, samples, n, a)
            if (budget_hours is not None and h_lo > budget_hours) or (
                    budget_usd is not None and h_lo * n * p.usd_per_hour > budget_usd):
                depends += f"; at {lo:.0%} MFU {n} node{'s' if n != 1 else ''} miss the budget"
        per.append(BudgetAnswer(platform=p, nodes=n, hours=h, usd=c, mfu=mfu,
                                mfu_measured=p.instance_type in measured, depends_most_on=depends))
    if not per:
        return None, []
    key = (lambda b: b.usd) if budget_hours is not None else (lambda b: b.hours)
    return min(per, key=key), sorted(per, key=key)


def _depends_most_on(w: Workload, p: Platform, mfu: float, samples: float, n: int, a: Assumptions,
                     measured: Mapping[str, float]) -> str:
    if p.instance_type not in measured:
        lo, hi = a.band(p.backend)
        return (f"MFU (assumed {mfu:.1%}; across the band {lo:.0%}-{hi:.0%}: "
                f"{hours_to_target(w, p, hi, samples, n, a):,.1f}-{hours_to_target(w, p, lo, samples, n, a):,.1f} h, "
                f"${cost_to_target(w, p, hi, samples, n, a):,.0f}-${cost_to_target(w, p, lo, samples, n, a):,.0f})")
    if n > 1:
        return (f"scaling efficiency at {n} nodes (assumed {a.scaling_efficiency(n):.0%}; bench "
                f"{n} nodes to measure it)")
    return f"the price ({p.price_label()})"


# ----- chart ---------------------------------------------------------------------------------

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


# ----- markdown ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Question:
    """What the reader asks of the projection: presets, target, nodes, budget."""

    presets: tuple[str, ...] = DEFAULT_PRESETS
    samples: float = 1e6
    target: str = "1,000,000 samples"
    nodes: int = 1
    budget_usd: float | None = None
    budget_hours: float | None = None
    max_nodes: int = 16
    gpu: str = DEFAULT_GPU
    trn: str = DEFAULT_TRN


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def pair(plats: Sequence[Platform], q: Question) -> tuple[Platform | None, Platform | None]:
    """The GPU and Trainium platforms of the break-even headline (--gpu-instance / --trn-instance)."""
    by = {p.instance_type: p for p in plats}
    gpu = by.get(q.gpu) or next((p for p in plats if p.backend == "gpu"), None)
    trn = by.get(q.trn) or next((p for p in plats if p.backend == "trainium"), None)
    return gpu, trn


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
              _table(["preset", "instance", "TFLOP/sample", "padding", "MFU band", "samples/s per instance at "
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
    lines += ["", "### Budget", "", *_budget_lines(w, plats, a, q, measured)]
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
    lines.append(_table(["GPU", "Trainium", "MFU ratio trn/gpu for equal cost per sample",
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
        lines.append(_table(["run", "measured MFU (chart FLOP count)", "measured USD per 1M samples", "file"],
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


def _budget_lines(w: Workload, plats: Sequence[Platform], a: Assumptions, q: Question,
                  measured: Mapping[str, float]) -> list[str]:
    if q.budget_usd is None and q.budget_hours is None:
        return ["Give `--budget-usd` and/or `--budget-hours` (with `--dataset-samples` and `--epochs` for the target) "
                "and this section answers which platform, how many nodes, how long and how much."]
    ask = " and ".join(x for x in (f"${q.budget_usd:,.0f}" if q.budget_usd is not None else "",
                                   f"{q.budget_hours:g} h" if q.budget_hours is not None else "") if x)
    pick, per = answer_budget(w, plats, a, q.samples, budget_usd=q.budget_usd, budget_hours=q.budget_hours,
                              max_nodes=q.max_nodes, measured=measured)
    head = f"Budget {ask} for {q.target} of {w.name}, up to {q.max_nodes} nodes:"
    if pick is None:
        return [head + " no priced platform meets it at the assumed MFU; raise the budget or --max-nodes, or cut "
                "the target."]
    b = pick
    lines = [head + f" **{b.platform.short}, {b.nodes} node{'s' if b.nodes != 1 else ''}, {b.hours:,.1f} h, "
             f"${b.usd:,.0f}** (MFU {b.mfu:.1%} {'measured' if b.mfu_measured else 'assumed'}). It depends most on "
             f"{b.depends_most_on}."]
    if not b.mfu_measured and (m := next((x for x in per if x.mfu_measured), None)) is not None:
        lines[-1] += (f" Among measured platforms only: {m.platform.short}, {m.nodes} node{'s' if m.nodes != 1 else ''}, "
                      f"{m.hours:,.1f} h, ${m.usd:,.0f} (MFU {m.mfu:.1%} measured).")
    lines.append("")
    lines.append(_table(["platform", "nodes", "hours", "USD", "MFU", "depends most on"],
                        [[x.platform.short, str(x.nodes), f"{x.hours:,.1f}", f"${x.usd:,.0f}",
                          f"{x.mfu:.1%} {'measured' if x.mfu_measured else 'assumed'}", x.depends_most_on]
                         for x in per]))
    return lines
