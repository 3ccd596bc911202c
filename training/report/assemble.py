"""The report's decision inputs in one place: its command-line flags, the price table they
resolve to, and the report sections they add (stale-price warning, price sources, price
scenarios, quality parity). ``training/report/cli.py`` calls ``add_arguments``, ``options``
and ``mfu_bands``; ``training/report/build.py`` calls ``resolve_prices`` and ``sections``.
The bench arithmetic is ``training/report/runs.py``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.model import flops
from training.report import aws_prices, mfu_evidence, parity, projection, scenarios
from training.report.measured_points import best_measured, chart_workload, measured_points
from training.report.prices import DEFAULT_PRICES, PriceTable, source_rows, stale_warning


@dataclasses.dataclass(kw_only=True)
class DecisionOptions:
    prices: list[str] = dataclasses.field(default_factory=lambda: [str(DEFAULT_PRICES)])  # --prices, in order
    prices_cache: Path | None = None  # None: ~/.cache/sana-training/prices-aws-<region>.json
    plan_discount: tuple[float, float] | None = None
    negotiated: tuple[float, float] | None = None
    parity_runs: tuple[str, str] | None = None  # (GPU run dir, Trainium run dir)
    parity_last: int = 5
    parity_tolerance: float = 0.05
    pricing_client: Any = None  # a boto3 pricing client (tests: one with botocore's Stubber); None: a real one
    today: datetime.date = dataclasses.field(default_factory=datetime.date.today)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prices", action="append", metavar="FILE|aws[:REGION]",
                   help="price source, repeatable, first with a figure wins: a prices YAML, or aws[:REGION] for the "
                        "AWS Price List API (HyperPod ml.* and EC2 on-demand; default region us-east-1). "
                        "Default: training/prices.yaml")
    p.add_argument("--prices-cache", help="where --prices aws keeps its last fetch "
                                          "(default ~/.cache/sana-training/prices-aws-REGION.json)")
    g = p.add_argument_group("decision inputs (training/report/)")
    g.add_argument("--plan-discount", metavar="GPU,TRN",
                   help="Savings Plan / training plan discount per side, fractions off on-demand (price scenarios)")
    g.add_argument("--negotiated-usd", metavar="GPU,TRN",
                   help="your negotiated USD per instance-hour of the headline pair (price scenarios)")
    g.add_argument("--parity-runs", nargs=2, metavar=("GPU_RUN", "TRN_RUN"),
                   help="training run directories (metrics.jsonl, validation/) of the same recipe on both platforms")
    g.add_argument("--parity-last", type=int, default=5, help="logged steps the parity gap is measured over "
                                                              "(default %(default)s)")
    g.add_argument("--parity-tolerance", type=float, default=0.05,
                   help="relative loss gap still counted as parity (default %(default)s)")
    for side, band in (("gpu", mfu_evidence.GPU_BAND), ("trn", mfu_evidence.TRN_BAND)):
        g.add_argument(f"--mfu-band-{side}", metavar="LO,HI",
                       help=f"assumed MFU band of the {side.upper()} side (default {band[0]:g},{band[1]:g}; "
                            "evidence: training/report/mfu_evidence.py)")


def options(args: argparse.Namespace) -> DecisionOptions:
    return DecisionOptions(
        prices=args.prices or [str(DEFAULT_PRICES)],
        prices_cache=Path(args.prices_cache) if args.prices_cache else None,
        plan_discount=scenarios.parse_pair("--plan-discount", args.plan_discount, fraction=True),
        negotiated=scenarios.parse_pair("--negotiated-usd", args.negotiated_usd, fraction=False),
        parity_runs=tuple(args.parity_runs) if args.parity_runs else None, parity_last=args.parity_last,
        parity_tolerance=args.parity_tolerance)


def mfu_bands(args: argparse.Namespace) -> dict[str, Any]:
    """Assumptions fields from --mfu-band (both sides) and --mfu-band-gpu / --mfu-band-trn."""
    out: dict[str, Any] = {}
    if args.mfu_band:
        both = band("--mfu-band", args.mfu_band)
        out.update(typical_mfu=both, typical_mfu_trn=both, typical_source=mfu_evidence.SAME_SOURCE,
                   typical_source_trn=mfu_evidence.SAME_SOURCE)
    for side, key in (("gpu", "typical_mfu"), ("trn", "typical_mfu_trn")):
        if text := getattr(args, f"mfu_band_{side}"):
            out[key] = band(f"--mfu-band-{side}", text)
            out[key.replace("mfu", "source")] = f"--mfu-band-{side} (given)"
    return out


def band(flag: str, text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text}: give LO,HI as fractions, e.g. 0.15,0.40") from None
    if not 0 < lo < hi <= 1:
        raise UserError(f"{flag} {text}: give LO,HI with 0 < LO < HI <= 1, e.g. 0.15,0.40")
    return lo, hi


def resolve_prices(d: DecisionOptions, instance_types: Iterable[str]) -> tuple[PriceTable, list[str]]:
    """The price table for every instance type the report may show (its runs and every known
    accelerator layout), plus one line per source that fell back."""
    wanted = set(instance_types) | set(flops.INSTANCE_TYPES)
    return aws_prices.resolve(d.prices, wanted, client=d.pricing_client, cache=d.prices_cache,
                              log=lambda line: print(line, file=sys.stderr, flush=True))


@dataclasses.dataclass(kw_only=True)
class Sections:
    warnings: list[str]  # above the recommendation
    prices: list[str]  # where each figure came from
    after_projection: list[str]  # price scenarios, quality parity
    quality: str  # the recommendation's sentence on parity


def sections(d: DecisionOptions, *, table: PriceTable, proj_table: PriceTable, notes: Sequence[str],
             run_types: Iterable[str], runs: Sequence[Any], a: projection.Assumptions, q: projection.Question,
             out: Path, px: tuple[int, int], dpi: int) -> Sections:
    plats = projection.platforms(proj_table.prices, a.precision)
    used = {*run_types, *(p.instance_type for p in plats),  # and EC2-only figures, e.g. an instance HyperPod lacks
            *(f"ml.{n}" for n in proj_table.ec2 if flops.instance_spec(n))}
    stale = [*table.stale(run_types, d.today), *proj_table.stale((p.instance_type for p in plats), d.today)]
    stale = list({p.instance_type: p for p in stale}.values())
    warnings = [stale_warning(stale, d.today)] if stale else []
    warnings += [f"> {n}" for n in notes]
    rows = source_rows(table, run_types, d.today) + (source_rows(proj_table, used - set(run_types), d.today))
    prices = ["## Prices and where they came from", "",
              "Every price the report uses, with its service, source and the date it was read there "
              f"(older than 12 months or undated: stale). Sources asked, in order: {', '.join(d.prices)}.", "",
              "| instance | service | region | USD/h | from | checked | verified | source |",
              "|---|---|---|---|---|---|---|---|", *("| " + " | ".join(r) + " |" for r in rows)]
    after: list[str] = []
    gpu, trn = projection.pair(plats, q)
    if gpu is not None and trn is not None:
        best = best_measured(measured_points(runs, chart_workload(runs, a, q.presets[0]))[0])
        g, t = best.get(gpu.instance_type), best.get(trn.instance_type)
        items = scenarios.scenarios(gpu, trn, proj_table, plan_discount=d.plan_discount, negotiated=d.negotiated)
        after += ["", *scenarios.section(gpu, trn, items, gpu_mfu=g.mfu if g else a.mid("gpu"),
                                         gpu_mfu_measured=g is not None, trn_mfu=t.mfu if t and g else None)]
    result = None
    if d.parity_runs is not None:
        result = parity.compare(parity.load_run(d.parity_runs[0], "GPU run"),
                                parity.load_run(d.parity_runs[1], "Trainium run"),
                                last_n=d.parity_last, tolerance=d.parity_tolerance)
        after += ["", *parity.section(result, out, px=px, dpi=dpi)]
    return Sections(warnings=warnings, prices=prices, after_projection=after, quality=parity.sentence(result))
