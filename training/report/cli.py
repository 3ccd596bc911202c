"""``python -m training.report RESULT.json ... --out DIR``: the GPU vs Trainium cost-performance report.

The command line of training/report/build.py: the flags (the decision inputs' own flags come
from training/report/assemble.py ``add_arguments``), each checked with one line naming the
flag, turned into ``Options``, the projection's assumptions and question; then ``build``.
The FSx figures come from ``--fsx-throughput-mbps``, from ``--fsx-storage-gib`` x
``--fsx-throughput-per-tib``, or else from cdk.json's context (training/report/inputs.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError, exits_cleanly
from training.report import assemble, projection
from training.report.build import build
from training.report.inputs import (
    Options,
    bytes_per_sample_from_index,
    fsx_from_cdk,
    fsx_provisioned_mbps,
    mean_real_text_tokens,
)

REPO = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.report", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="*", metavar="RESULT.json", help="bench results (python -m training.bench)")
    p.add_argument("--out", required=True, help="output directory (report.md + PNG charts)")
    p.add_argument("--dataset-samples", type=int, help="dataset size for time/cost to target")
    p.add_argument("--epochs", type=float, default=1.0, help="epochs for time/cost to target (default 1)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="compare runs that differ in preset/resolution/text tokens/precision")
    p.add_argument("--features-index", help="feature directory or its index.json (local or s3://): bytes/sample")
    p.add_argument("--fsx-throughput-mbps", type=float, help="provisioned FSx throughput, MB/s (overrides cdk.json)")
    p.add_argument("--fsx-storage-gib", type=float, help="FSx storage, GiB (with --fsx-throughput-per-tib)")
    p.add_argument("--fsx-throughput-per-tib", type=float, help="FSx MB/s per TiB (125/250/500/1000)")
    p.add_argument("--cdk-json", default=str(REPO / "cdk.json"), help="where to read FSx defaults from")
    p.add_argument("--serving", action="append", default=[], metavar="SERVE_BENCH.json",
                   help="serving bench result (python -m training.serve.bench); repeat for each endpoint")
    g = p.add_argument_group("projection (every report has it; --project alone needs no result files)")
    g.add_argument("--project", action="store_true", help="write the projection even without result files")
    g.add_argument("--preset", action="append", help=f"preset to project (repeat; default {', '.join(projection.DEFAULT_PRESETS)})")
    g.add_argument("--mfu-band", metavar="LO,HI", help="assumed MFU band for every platform (default: per "
                   "platform, --mfu-band-gpu / --mfu-band-trn)")
    g.add_argument("--scaling-per-doubling", type=float, default=0.95,
                   help="assumed scaling efficiency kept per doubling of nodes (default %(default)s)")
    g.add_argument("--real-text-tokens", type=float,
                   help="mean real caption length (default: read from --features-index when its length matches)")
    g.add_argument("--nodes", type=int, default=1, help="node count for the projected target (default 1)")
    g.add_argument("--budget-usd", type=float, help="budget in dollars for the target")
    g.add_argument("--budget-hours", type=float, help="wall-clock budget in hours for the target")
    g.add_argument("--max-nodes", type=int, default=16, help="most nodes a budget answer may use (default 16)")
    g.add_argument("--gpu-instance", default=projection.DEFAULT_GPU, help="GPU side of the break-even headline")
    g.add_argument("--trn-instance", default=projection.DEFAULT_TRN, help="Trainium side of the break-even headline")
    assemble.add_arguments(p)
    return p


def projection_inputs(args: argparse.Namespace) -> tuple[projection.Assumptions, projection.Question]:
    """The projection's assumptions and question from the command line; UserError naming the flag."""
    from training.model.build import PRESETS

    for preset in args.preset or ():
        if preset not in PRESETS:
            raise UserError(f"--preset {preset}: unknown; choose from {', '.join(sorted(PRESETS))}")
    for flag in ("nodes", "max_nodes"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')}: must be >= 1")
    for flag in ("budget_usd", "budget_hours", "real_text_tokens"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise UserError(f"--{flag.replace('_', '-')}: must be > 0")
    real, source = args.real_text_tokens, "--real-text-tokens (given)"
    if real is None and args.features_index:
        mean, n, padded = mean_real_text_tokens(args.features_index)
        if padded == projection.DEFAULT_TEXT_TOKENS:
            real, source = mean, f"mean {mean:.1f} over {n} samples of {args.features_index}"
        else:
            source = (f"not applied: {args.features_index} pads captions to {padded} tokens (mean {mean:.1f} real), "
                      f"not the presets' {projection.DEFAULT_TEXT_TOKENS}; every padded token counted")
    assumptions = projection.Assumptions(
        **assemble.mfu_bands(args), scaling_per_doubling=args.scaling_per_doubling, real_text_tokens=real,
        **({"real_tokens_source": source} if real is not None or args.features_index else {}))
    question = projection.Question(presets=tuple(args.preset or projection.DEFAULT_PRESETS), nodes=args.nodes,
                                   budget_usd=args.budget_usd, budget_hours=args.budget_hours,
                                   max_nodes=args.max_nodes, gpu=args.gpu_instance, trn=args.trn_instance)
    return assumptions, question


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.dataset_samples is not None and args.dataset_samples < 1:
        raise UserError("--dataset-samples: must be >= 1")
    if not args.epochs > 0:
        raise UserError("--epochs: must be > 0")
    if not args.results and not args.project:
        raise UserError("report: give at least one bench result JSON, or --project for the projection alone")
    assumptions, question = projection_inputs(args)
    opts = Options(dataset_samples=args.dataset_samples, epochs=args.epochs, allow_mismatch=args.allow_mismatch,
                   project_only=args.project, assumptions=assumptions, question=question,
                   decision=assemble.options(args), serving=tuple(args.serving))
    if args.features_index:
        opts.bytes_per_sample = bytes_per_sample_from_index(args.features_index)
        opts.features_index = args.features_index
    if args.fsx_throughput_mbps:
        opts.fsx_mbps, opts.fsx_source = args.fsx_throughput_mbps, "--fsx-throughput-mbps"
    elif args.fsx_storage_gib or args.fsx_throughput_per_tib:
        if not (args.fsx_storage_gib and args.fsx_throughput_per_tib):
            raise UserError("--fsx-storage-gib and --fsx-throughput-per-tib: give both (or --fsx-throughput-mbps)")
        opts.fsx_mbps = fsx_provisioned_mbps(args.fsx_storage_gib, args.fsx_throughput_per_tib)
        opts.fsx_source = (f"--fsx-storage-gib {args.fsx_storage_gib:g} x --fsx-throughput-per-tib "
                           f"{args.fsx_throughput_per_tib:g} MB/s/TiB")
    elif (found := fsx_from_cdk(Path(args.cdk_json))) is not None:
        opts.fsx_mbps, opts.fsx_source = found
    report = build(args.results, args.out, opts=opts)
    print(f"report: {report} (charts in {report.parent})", flush=True)


if __name__ == "__main__":
    main()
