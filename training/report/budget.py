"""The budget question: given dollars and/or hours for a target, which platform, how many
nodes, how long and how much (at the measured MFU where there is one, else the band's mid),
what the answer depends on most, and the "Budget" subsection of the projection that says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from training.report.markdown import table
from training.report.projection import (
    Assumptions,
    Platform,
    Question,
    Workload,
    cost_to_target,
    hours_to_target,
)


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


def budget_lines(w: Workload, plats: Sequence[Platform], a: Assumptions, q: Question,
                 measured: Mapping[str, float]) -> list[str]:
    """The "Budget" subsection: the pick, one answer per platform, or how to ask the question."""
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
    lines.append(table(["platform", "nodes", "hours", "USD", "MFU", "depends most on"],
                       [[x.platform.short, str(x.nodes), f"{x.hours:,.1f}", f"${x.usd:,.0f}",
                         f"{x.mfu:.1%} {'measured' if x.mfu_measured else 'assumed'}", x.depends_most_on]
                        for x in per]))
    return lines
