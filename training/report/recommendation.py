"""The recommendation paragraph of the report: which platform is cheaper per sample, whether
it is also faster, the value of time at which the faster one pays off, and what the scaling
measurements say, every clause computed from the runs (training/report/runs.py) and the
target (training/report/inputs.py ``Options``). Nothing in it is written in by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from training.report.inputs import Options, target_samples
from training.report.markdown import duration
from training.report.runs import Run, cost_per_million_samples, hours_to_target, reference_runs, scaling_table


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
