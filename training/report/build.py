"""Building the GPU vs Trainium cost-performance report: load and check the bench results
(``training.perf.bench_result.BenchResult``, validated on load), resolve the prices
(``training/prices.yaml``, ``--prices FILE`` or ``--prices aws``: the AWS Price List API), and
write ``DIR/report.md`` plus PNG charts from the sections each module of ``training/report/``
owns: the runs' arithmetic (runs.py), the recommendation (recommendation.py), the charts
(charts.py), the Markdown (render.py), the projection (projection_section.py), the serving cost
(serving.py) and the decision inputs around the bench numbers (assemble.py: price sources and
staleness, price scenarios, quality parity). Every number and every sentence is computed from
those inputs; nothing is written in by hand, so the report can be regenerated whenever a
result or a price changes. The command line is training/report/cli.py.

Every report also has the projection section (``training/report/projection_section.py``): cost
and time per preset and instance type as a function of MFU, the GPU/Trainium break-even, budget
answers, and the measured runs placed on the same chart. With no result files (``--project``)
that section is the report: the decision framed before any accelerator is benchmarked.

Refuses to compare runs that differ in preset, model overrides, resolution, text length
or precision (``Options.allow_mismatch`` to override, with a warning in the report), and stops
with one line naming an instance type that has no price.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError
from training.model import flops
from training.perf.bench_result import BenchResult
from training.report import assemble, projection, projection_section
from training.report.charts import CHART_PX, DPI, make_charts
from training.report.inputs import Options, target_samples
from training.report.prices import DEFAULT_PRICES, PriceTable
from training.report.render import render, render_projection_only
from training.report.runs import Run, check_comparable


def projection_prices(prices: PriceTable) -> tuple[PriceTable, str]:
    """The table the projection prices with: ``prices`` if it prices an accelerator instance
    type, else the shipped table (a demo's price file has only ``local``), with a note saying so."""
    if any(flops.instance_spec(name) for name in prices.prices):
        return prices, ""
    shipped = PriceTable.load(DEFAULT_PRICES)
    return shipped, (f"`{prices.path}` prices no accelerator instance type, so the projection uses "
                     f"`{shipped.path}` (list prices as of {shipped.as_of}).")


def build(result_paths: Sequence[str | Path], out: str | Path, *, prices_path: str | Path | None = None,
          opts: Options | None = None) -> Path:
    """Load, check, compute, draw and write ``out/report.md``; returns its path. ``prices_path``
    (one source) overrides ``opts.decision.prices``."""
    opts = opts or Options()
    if prices_path is not None:
        opts = dataclasses.replace(opts, decision=dataclasses.replace(opts.decision, prices=[str(prices_path)]))
    if not result_paths and not opts.project_only:
        raise UserError("report: give at least one bench result JSON, or --project for the projection alone")
    results = [(Path(p), BenchResult.load(p)) for p in result_paths]
    question = opts.question or projection.Question()
    prices, notes = assemble.resolve_prices(opts.decision, {r.instance_type for _, r in results} | {question.gpu,
                                                                                                   question.trn})
    runs = [Run(path=p, result=r, price=prices.get(r.instance_type)) for p, r in results]
    warnings = check_comparable(runs, opts.allow_mismatch) if runs else []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    accel = [r for r in runs if not r.result.is_cpu]  # CPU runs never set the projection's precision
    samples, what = target_samples(opts)
    question = dataclasses.replace(question, samples=samples, target=what)
    proj_prices, note = projection_prices(prices)
    assumptions = dataclasses.replace(opts.assumptions or projection.Assumptions(), price_as_of=(
        f"`{proj_prices.path}`, {proj_prices.as_of}"), **({"precision": accel[0].result.precision} if accel else {}))
    for flag, name, default in (("--gpu-instance", question.gpu, projection.DEFAULT_GPU),
                                ("--trn-instance", question.trn, projection.DEFAULT_TRN)):
        if name != default and name not in proj_prices.prices:
            raise UserError(f"{flag} {name}: no price in {proj_prices.path}; add prices.{name} there or pick one of "
                            f"{', '.join(n for n in proj_prices.prices if flops.instance_spec(n))}")
    lines = projection_section.section(runs, proj_prices.prices, assumptions, question, out, px=CHART_PX, dpi=DPI)
    if note:
        lines[1:1] = ["", note]
    lines += serving_lines(opts.serving, prices, opts.decision.prices)
    extra = assemble.sections(opts.decision, table=prices, proj_table=proj_prices, notes=notes,
                              run_types={r.result.instance_type for r in runs}, runs=runs, a=assumptions, q=question,
                              out=out, px=CHART_PX, dpi=DPI)
    report = out / "report.md"
    if not runs:
        report.write_text(render_projection_only(prices, lines, extra))
        return report
    charts = make_charts(runs, out)
    verdict = projection_section.verdict(runs, proj_prices.prices, assumptions, question)
    report.write_text(render(runs, prices, opts, charts, warnings, lines, verdict, extra))
    return report


def serving_lines(results: Sequence[str], table: PriceTable, sources: Sequence[str]) -> list[str]:
    """The "Serving" section (training/report/serving.py): projected cost per 1,000 images on inf2 vs
    GPU, plus the measured serving benches given with --serving. Endpoint prices: the ``serving``
    section of the shipped table, then of each --prices FILE, then the report's own prices (a
    measured run's instance type, e.g. ``local``)."""
    from training.report.aws_prices import parse_source
    from training.report.serving import section, serving_prices
    from training.serve.bench import ServeBenchResult

    files = [DEFAULT_PRICES, *(s for s in sources if parse_source(s)[0] == "file")]
    prices = {**serving_prices(files), **table.prices}
    return ["", *section([ServeBenchResult.load(p) for p in results], prices)]
