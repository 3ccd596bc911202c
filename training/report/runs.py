"""Bench results as the report's runs: each result with the price of its instance type, the
numbers derived from them, the refusal to compare unlike runs, and the choice of runs for the
head-to-head and the scaling table. Everything here is arithmetic on measured figures; the
text and the charts built from it are training/report/render.py, recommendation.py and
charts.py.

Definitions (tests/training/report/test_report.py checks these by hand):
- cost per million samples = USD/h per instance / (samples/s per instance x 3600) x 1e6
- time to target = dataset samples x epochs / total samples/s
- cost to target = time to target (h) x USD/h per instance x nodes
- scaling efficiency at n nodes = (samples/s at n / n) / (samples/s at n0 / n0), n0 = the
  fewest nodes measured for that platform
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError
from training.perf.bench_result import COMPARABLE_FIELDS, BenchResult
from training.report.prices import Price


def cost_per_million_samples(usd_per_hour: float, samples_per_s_per_instance: float) -> float:
    return usd_per_hour / (samples_per_s_per_instance * 3600.0) * 1e6


def hours_to_target(samples: float, samples_per_s_total: float) -> float:
    return samples / samples_per_s_total / 3600.0


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
