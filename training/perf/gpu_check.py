"""The PASS/FAIL table of ``benchmarks/gpu-check.sh``: its three bench results against the targets.

    python -m training.perf.gpu_check OUT_DIR [--dry-run]

Reads ``OUT_DIR/<run>.json`` (``training.bench`` results, validated by ``BenchResult.load``)
of the three runs gpu-check.sh makes and prints one table, exit status 1 when any target is
missed (or a run is missing), 0 when every target passed:

============================================  ==========================================
target                                        measured from
============================================  ==========================================
MFU >= 45%, sana-600m-512 bf16-mixed          ``mfu`` (real caption tokens) of the compiled
                                              comparison run, ours
ratio to the reference >= 1.3x, both eager    median over repetitions of ours / reference
ratio to the reference >= 1.3x, both compiled (training/perf/reference_step.py), same batches
1.6B peak within 10% of the memory model      ``peak_memory_bytes`` / ``memory_estimate.total``
compile speed-up > 1                          ours compiled / ours eager samples/s (600M)
no recompiles after warm-up                   ``compiles_in_timed_steps`` == 0 (600M, 1.6B)
no graph breaks                               ``graph_breaks`` == 0 (600M, 1.6B)
============================================  ==========================================

A result measured on a CPU fails every target unless ``--dry-run`` (gpu-check.sh's tiny CPU
run) says so; there the figures a CPU cannot give (MFU, memory, the ratios and speed-up of
a tiny model) are shown as SKIP, and the graph counts still must pass. A GPU whose name
``training/model/flops.py`` does not know has no peak, hence no MFU: that is a FAIL naming the fix,
never an assumed SXM peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError
from training.perf.bench_result import BenchResult

GIB = 2**30
EAGER, COMPILED, BIG = "compare-600m-512-eager", "compare-600m-512-compile", "step-1600m-1024-1gpu"
RUNS = (EAGER, COMPILED, BIG)

#: the targets (issue 17 / 26): MFU on real caption tokens, ratio to the tuned reference,
#: memory model error, compile speed-up
MFU_TARGET = 0.45
RATIO_TARGET = 1.3
MEMORY_TOLERANCE = 0.10
SPEEDUP_TARGET = 1.0


@dataclasses.dataclass(kw_only=True)
class Row:
    target: str
    measured: str
    status: str  # PASS | FAIL | SKIP
    why: str = ""  # for FAIL/SKIP: the cause in a few words


def _load(out: Path, name: str) -> tuple[BenchResult | None, str]:
    path = out / f"{name}.json"
    if not path.is_file():
        return None, f"{name}.json missing (the run failed: see {name}.log)"
    try:
        return BenchResult.load(path), ""
    except UserError as exc:
        return None, str(exc)


def evaluate(out: Path, *, dry_run: bool = False) -> list[Row]:
    """The rows of the table for the results in ``out``."""
    results: dict[str, BenchResult | None] = {}
    rows: list[Row] = []
    for name in RUNS:
        result, problem = _load(out, name)
        results[name] = result
        rows.append(Row(target=f"run {name}", measured="result valid" if result else "no result",
                        status="PASS" if result else "FAIL", why=problem))
    eager, compiled, big = results[EAGER], results[COMPILED], results[BIG]

    def cpu_skip(result: BenchResult | None) -> str | None:
        """None when the figure counts; else why it does not (CPU)."""
        if result is None or not result.is_cpu:
            return None
        return "CPU dry run" if dry_run else "measured on a CPU, not a GPU"

    def row(target: str, result: BenchResult | None, measured: str, ok: bool | None, why: str = "") -> Row:
        if result is None:
            return Row(target=target, measured="-", status="FAIL", why="its run has no result")
        skip = cpu_skip(result)
        if skip is not None:
            return Row(target=target, measured=measured, status="SKIP" if dry_run else "FAIL", why=skip)
        if ok is None:
            return Row(target=target, measured=measured, status="FAIL", why=why)
        return Row(target=target, measured=measured, status="PASS" if ok else "FAIL", why="" if ok else why)

    # MFU of our compiled step (the configuration the runbook recommends for 600M)
    if compiled is not None and (compiled.model_preset, compiled.precision) != ("sana-600m-512", "bf16-mixed") \
            and not dry_run:
        rows.append(Row(target=f"MFU >= {MFU_TARGET:.0%}, sana-600m-512 bf16", measured=compiled.model_preset,
                        status="FAIL", why=f"ran {compiled.model_preset} {compiled.precision}"))
    else:
        mfu = compiled.mfu if compiled else None
        rows.append(row(f"MFU >= {MFU_TARGET:.0%}, sana-600m-512 bf16 (compiled)", compiled,
                        "n/a" if mfu is None else f"{mfu:.1%} (padded {compiled.mfu_padded or 0:.1%})",
                        None if mfu is None else mfu >= MFU_TARGET,
                        why=(f"no published peak for {compiled.accelerator!r}: add its CUDA device name and "
                             "datasheet peak to training/model/flops.py" if compiled and mfu is None else "below target")))
    for label, result, want_compiled in (("both eager", eager, False), ("both compiled", compiled, True)):
        ref = result.reference if result else None
        if result is not None and not ref:
            rows.append(Row(target=f"ratio >= {RATIO_TARGET}x, {label}", measured="-", status="FAIL",
                            why="no reference in the result (--compare-reference)"))
            continue
        ratio = float(ref.get("ratio_median", ref["ratio"])) if ref else None
        sane = ref is None or bool(ref.get("compiled")) == want_compiled
        rows.append(row(f"ratio to reference >= {RATIO_TARGET}x, {label}", result,
                        "n/a" if ratio is None else f"{ratio:.2f}x (median of {len(ref.get('ratios', [0]))})",
                        (ratio >= RATIO_TARGET) if sane and ratio is not None else None,
                        why="below target" if sane else f"the reference was {'not ' if want_compiled else ''}compiled"))
    # memory model
    est = (big.memory_estimate or {}).get("total") if big else None
    peak = big.peak_memory_bytes if big else None
    if big is not None and (est is None or peak is None) and not big.is_cpu:
        rows.append(Row(target=f"1.6B peak within {MEMORY_TOLERANCE:.0%} of memory model", measured="-",
                        status="FAIL", why="no peak or no estimate in the result"))
    else:
        dev = (peak / (est * GIB) - 1) if (est and peak) else None
        rows.append(row(f"1.6B peak within {MEMORY_TOLERANCE:.0%} of memory model", big,
                        "n/a" if dev is None else f"{peak / GIB:.1f} vs {est:.1f} GiB ({dev:+.1%})",
                        None if dev is None else abs(dev) <= MEMORY_TOLERANCE, why="outside tolerance"))
    # compile speed-up
    speedup = (compiled.samples_per_s_total / eager.samples_per_s_total) if eager and compiled else None
    rows.append(row(f"compile speed-up > {SPEEDUP_TARGET:.0f}x (600M, ours)", compiled if eager else None,
                    "n/a" if speedup is None else f"{speedup:.2f}x",
                    None if speedup is None else speedup > SPEEDUP_TARGET, why="compiled is not faster"))
    # graph counts: these hold on a CPU too (the dry run compiles with aot_eager)
    for target, field, fix in (("no recompiles after warm-up", "compiles_in_timed_steps", "a recompiling step"),
                               ("no graph breaks", "graph_breaks", "part of a block runs eagerly")):
        values = {n: getattr(results[n], field) for n in (COMPILED, BIG) if results[n] is not None}
        missing = [n for n in (COMPILED, BIG) if results[n] is None]
        uncounted = [n for n, v in values.items() if v is None]
        bad = {n: v for n, v in values.items() if v}
        measured = " / ".join(f"{'-' if v is None else v}" for v in values.values()) or "-"
        if missing or uncounted:
            rows.append(Row(target=target, measured=measured, status="FAIL",
                            why=f"not counted in {', '.join(missing + uncounted)} (compile off?)"))
        else:
            rows.append(Row(target=target, measured=measured, status="FAIL" if bad else "PASS",
                            why=f"{fix}: {', '.join(bad)}" if bad else ""))
    return rows


def header(out: Path) -> str:
    for name in RUNS:
        result, _ = _load(out, name)
        if result is not None:
            peak = result.peak_tflops_per_accelerator
            return (f"gpu-check: {result.accelerator}"
                    f"{f', peak {peak:g} bf16 TFLOP/s ({result.peak_source})' if peak else ', no published peak'}; "
                    f"torch {result.versions.get('torch', '?')}; captions: {result.caption_lengths or 'real features'}")
    return "gpu-check: no results"


def table(rows: Sequence[Row]) -> str:
    width = max(len(r.target) for r in rows)
    mwidth = max(len(r.measured) for r in rows)
    lines = [f"{'target':<{width}}  {'measured':<{mwidth}}  result"]
    for r in rows:
        lines.append(f"{r.target:<{width}}  {r.measured:<{mwidth}}  {r.status}" + (f" ({r.why})" if r.why else ""))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.perf.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("out", help="gpu-check.sh's result directory")
    p.add_argument("--dry-run", action="store_true", help="CPU results: skip what a CPU cannot measure")
    args = p.parse_args(argv)
    out = Path(args.out)
    rows = evaluate(out, dry_run=args.dry_run)
    failed = [r for r in rows if r.status == "FAIL"]
    print(header(out))
    print(table(rows))
    verdict = (f"gpu-check: FAIL ({len(failed)} of {len(rows)} checks failed: "
               f"{'; '.join(r.target for r in failed)})" if failed else
               f"gpu-check: PASS ({sum(r.status == 'PASS' for r in rows)} passed, "
               f"{sum(r.status == 'SKIP' for r in rows)} skipped)")
    print(verdict, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
