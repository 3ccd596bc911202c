"""``python -m training.pipeline submit|status|cancel|lineage|record``: see __init__.py."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError
from training.pipeline.table import render

EPILOG = """commands (runbooks/pipelines.md):
  submit RECIPE.yaml [--dry-run]         queue the unfinished stages, chained with --dependency=afterok
  status RUN                             state of each stage of the last submit; a failure's cause
  cancel RUN                             scancel the last submit's queued and running jobs
  lineage MODEL_DIR [--json] [--config]  features, config, code and env an output came from
RUN is the recipe's name (or its file)."""


def _submit(args: argparse.Namespace) -> None:
    from training.pipeline.plan import build_plan
    from training.pipeline.recipe import load_recipe
    from training.pipeline.site import resolve_site
    from training.pipeline.submit import render_rows, submit

    recipe, tree = load_recipe(args.recipe)
    plan = build_plan(recipe, Path(args.recipe), tree, resolve_site())
    if args.dry_run:
        for stage in plan.stages:
            print(f"{stage.name}: sbatch {' '.join(stage.options)} {stage.script} {' '.join(stage.args)}")
        return
    print(render_rows(submit(plan), plan), flush=True)


def _status(args: argparse.Namespace) -> None:
    from training.pipeline.site import resolve_site
    from training.pipeline.status import last_submit, render_status, stage_rows

    site = resolve_site()
    state = last_submit(site, args.run)
    print(render_status(state, stage_rows(site, state)), flush=True)


def _cancel(args: argparse.Namespace) -> None:
    from training.pipeline.site import resolve_site
    from training.pipeline.status import cancel, last_submit

    site = resolve_site()
    state = last_submit(site, args.run)
    rows = cancel(site, state)
    if not rows:
        print(f"{state['recipe']['name']}: no stage job is queued or running", flush=True)
        return
    print(render(["stage", "job id", "was"], [[r["stage"], r["job"], r["state"]] for r in rows]))
    print(f"{state['recipe']['name']}: cancelled {len(rows)} job(s); finished stages keep their output, "
          "and the next submit goes on from the first unfinished one", flush=True)


def _lineage(args: argparse.Namespace) -> None:
    from training.pipeline.lineage import load_lineage, render_lineage

    doc = load_lineage(Path(args.path))
    print(json.dumps(doc, indent=1) if args.json else render_lineage(doc, config=args.config), flush=True)


def _record(args: argparse.Namespace) -> None:
    from training.pipeline.record import record

    run = record(Path(args.stage_file))
    print(f"pipeline: {run['stage']} recorded in {run['dir']}/run.json", flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.pipeline",
                                description="Run a recipe as chained Slurm jobs: precompute -> train -> export -> report.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="queue the stages the recipe still needs; prints stage, job id, output")
    s.add_argument("recipe", help="recipe YAML (training/pipeline/recipes/*.yaml are templates)")
    s.add_argument("--dry-run", action="store_true", help="print each stage's sbatch command; queue nothing")
    s.set_defaults(func=_submit)
    s = sub.add_parser("status", help="each stage's state and, for a failed one, its cause in one line")
    s.add_argument("run", metavar="RUN", help="the recipe's name (or its file)")
    s.set_defaults(func=_status)
    s = sub.add_parser("cancel", help="cancel the queued and running jobs of the last submit")
    s.add_argument("run", metavar="RUN", help="the recipe's name (or its file)")
    s.set_defaults(func=_cancel)
    s = sub.add_parser("lineage", help="what an exported model (or any stage output) came from")
    s.add_argument("path", metavar="MODEL_DIR", help="export model directory, report directory or stage directory")
    s.add_argument("--json", action="store_true", help="print the lineage document as JSON")
    s.add_argument("--config", action="store_true", help="also print the resolved training config, one key a line")
    s.set_defaults(func=_lineage)
    s = sub.add_parser("record", help="(run by launch.sh in a stage's job) check the output, write run.json")
    s.add_argument("stage_file", metavar="STAGE_JSON")
    s.set_defaults(func=_record)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except OSError as exc:  # a full or failing file system: which file, and why, in one line
        print(f"error: {exc.filename or args.command}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
