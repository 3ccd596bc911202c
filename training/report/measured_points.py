"""Measured bench runs on the projection: which runs can be placed (accelerator runs with a
published peak; CPU runs never), the MFU each one reached under the chart's FLOP count, the
workload the chart draws, and the best measured point per instance type, which replaces the
assumed MFU band wherever the projection (training/report/projection_section.py), the price
scenarios and the budget use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from training.report.projection import Assumptions, PriceLike, Workload, workload


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
