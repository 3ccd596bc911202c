"""Price scenarios: the break-even MFU ratio under each price the reader might pay, so the
report shows how much of the GPU-vs-Trainium answer is price.

The cost break-even (training/report/projection.py) is r = (USD/h_trn / peak_trn) / (USD/h_gpu / peak_gpu):
Trainium is cheaper per sample iff m_trn / m_gpu > r. It is proportional to the price ratio
and to nothing else, so a discount equal on both sides leaves it where it is; only a price
that differs by side moves it. Scenarios (each for the headline pair):

- on-demand: the decision's price table (HyperPod ml.* prices, or what ``--prices`` gave);
- EC2 on-demand, for comparison, where the table has both EC2 figures;
- a Savings Plan / flexible training plan: ``--plan-discount GPU,TRN`` (fractions off
  on-demand; SageMaker Savings Plans and training plans are priced per instance family, so
  the two sides usually get different discounts);
- negotiated: ``--negotiated-usd GPU,TRN`` (USD per instance-hour, as on your contract).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from training.errors import UserError
from training.report.prices import PriceTable
from training.report.projection import Platform


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    gpu_usd: float
    trn_usd: float
    basis: str  # where the two prices come from


def break_even(s: Scenario, gpu: Platform, trn: Platform) -> float:
    return (s.trn_usd / trn.instance_peak_flops) / (s.gpu_usd / gpu.instance_peak_flops)


def parse_pair(flag: str, text: str | None, *, fraction: bool) -> tuple[float, float] | None:
    """``GPU,TRN`` -> two floats: fractions in [0, 1) or prices > 0; UserError naming the flag."""
    if text is None:
        return None
    what = "fractions off on-demand, e.g. 0.3,0.2" if fraction else "USD per instance-hour, e.g. 40,15"
    try:
        a, b = (float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text}: give GPU,TRN as two numbers ({what})") from None
    if not all((0 <= v < 1) if fraction else v > 0 for v in (a, b)):
        raise UserError(f"{flag} {text}: each value must be {'in [0, 1)' if fraction else '> 0'} ({what})")
    return a, b


def scenarios(gpu: Platform, trn: Platform, table: PriceTable, *, plan_discount: tuple[float, float] | None,
              negotiated: tuple[float, float] | None) -> list[Scenario]:
    out = [Scenario(name="on-demand (decision prices)", gpu_usd=gpu.usd_per_hour, trn_usd=trn.usd_per_hour,
                    basis=f"the price table, checked {gpu.price_checked or 'undated'} / "
                          f"{trn.price_checked or 'undated'}")]
    g_ec2, t_ec2 = table.ec2_price(gpu.instance_type), table.ec2_price(trn.instance_type)
    if g_ec2 is not None and t_ec2 is not None:
        out.append(Scenario(name="EC2 on-demand (comparison)", gpu_usd=g_ec2.usd_per_hour, trn_usd=t_ec2.usd_per_hour,
                            basis=f"EC2 Linux on-demand, {g_ec2.date_label()}{'' if g_ec2.verified else ' unverified'}"
                                  f" / {t_ec2.date_label()}{'' if t_ec2.verified else ' unverified'}"))
    if plan_discount is not None:
        dg, dt = plan_discount
        out.append(Scenario(name=f"plan discount {dg:.0%} / {dt:.0%}", gpu_usd=gpu.usd_per_hour * (1 - dg),
                            trn_usd=trn.usd_per_hour * (1 - dt), basis="--plan-discount off the on-demand prices"))
    if negotiated is not None:
        out.append(Scenario(name="negotiated", gpu_usd=negotiated[0], trn_usd=negotiated[1], basis="--negotiated-usd"))
    return out


def section(gpu: Platform, trn: Platform, items: Sequence[Scenario], *, gpu_mfu: float, gpu_mfu_measured: bool,
            trn_mfu: float | None) -> list[str]:
    """The report's price-scenario section. ``trn_mfu`` is the measured Trainium MFU (None: not measured)."""
    ratios = [break_even(s, gpu, trn) for s in items]
    m_label = f"{gpu_mfu:.1%} ({'measured' if gpu_mfu_measured else 'band mid, assumed'})"
    rows = []
    for s, r in zip(items, ratios, strict=True):
        row = [s.name, f"${s.gpu_usd:,.2f}", f"${s.trn_usd:,.2f}", f"**{r:.2f}**", f"{r * gpu_mfu:.1%}"]
        if trn_mfu is not None:
            side = "Trainium" if trn_mfu / gpu_mfu > r else "GPU"
            row.append(f"{side} ({trn_mfu / gpu_mfu:.2f} vs {r:.2f})")
        rows.append([*row, s.basis])
    head = ["scenario", f"{gpu.short} USD/h", f"{trn.short} USD/h", "break-even MFU ratio trn/gpu",
            f"{trn.short} MFU needed at {gpu.short} {m_label}"]
    head += ["cheaper per sample (measured ratio)"] if trn_mfu is not None else []
    lines = ["## Price scenarios", "",
             f"The break-even ratio of {trn.short} against {gpu.short} under each price you might pay. It moves with "
             "the price ratio alone: an equal discount on both sides leaves it unchanged.", "",
             "| " + " | ".join([*head, "prices"]) + " |", "|" + "---|" * (len(head) + 1),
             *("| " + " | ".join(r) + " |" for r in rows), ""]
    lo, hi = min(ratios), max(ratios)
    if len(items) == 1:
        lines.append("Give `--plan-discount GPU,TRN` (your plan's fractions off on-demand) and/or "
                     "`--negotiated-usd GPU,TRN` to see how far the price you actually pay moves the answer.")
    elif trn_mfu is not None:
        m = trn_mfu / gpu_mfu
        lines.append(f"The break-even spans {lo:.2f}-{hi:.2f} across these scenarios and the measured ratio is "
                     f"{m:.2f}: " + ("inside the span, so the price you get decides." if lo <= m <= hi else
                                     f"outside it, so {'Trainium' if m > hi else 'the GPU'} is cheaper per sample under "
                                     "every scenario here."))
    else:
        lines.append(f"The break-even spans {lo:.2f}-{hi:.2f} across these scenarios: at {gpu.short} {m_label}, "
                     f"{trn.short} must reach {lo * gpu_mfu:.1%}-{hi * gpu_mfu:.1%} MFU depending on the price; "
                     f"bench {trn.short} to see which side of that range it lands.")
    return lines
