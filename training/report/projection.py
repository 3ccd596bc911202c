"""The projection's model: projected cost and time per preset and instance type as a function
of MFU, and the MFU ratio at which GPU and Trainium break even. The report around it:
measured runs placed on the curves (training/report/measured_points.py), budget answers
(training/report/budget.py), the chart (training/report/projection_chart.py) and the section's
text (training/report/projection_section.py).

Why a projection: no accelerator has to be benchmarked to frame the decision. What is known
is the FLOP model per preset (``training/model/flops.py``), each accelerator's dense peak (the same
file, with its datasheet), and list prices (``training/prices.yaml``); what is not known is
the MFU each platform reaches on Sana. So every figure here is a function of MFU, shown over a
range, and the assumptions (MFU band, scaling efficiency per node count, price date) are
printed beside the figures they drive. When bench JSONs arrive they sit on the same curves and
replace the assumed MFU.

Formulas (tests/training/report/test_projection.py checks them by hand):
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
padded token counts, which is what ``training.bench`` writes into its JSON today. A measured
run is placed at the MFU its own samples/s gives under the chart's FLOP count, so with the same
count it sits exactly at its JSON ``mfu``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
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


def pair(plats: Sequence[Platform], q: Question) -> tuple[Platform | None, Platform | None]:
    """The GPU and Trainium platforms of the break-even headline (--gpu-instance / --trn-instance)."""
    by = {p.instance_type: p for p in plats}
    gpu = by.get(q.gpu) or next((p for p in plats if p.backend == "gpu"), None)
    trn = by.get(q.trn) or next((p for p in plats if p.backend == "trainium"), None)
    return gpu, trn
