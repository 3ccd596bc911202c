"""``python -m training.pipeline.report --stage STAGE.json``: the report stage of a pipeline.

Writes ``<report>/report.md`` from the finished stages it reads (their run.json files, never
the recipe's wishes): the lineage (every stage's key, jobs, package, env and output digests),
the features, the training run (steps, loss, the last validation grid when the run rendered
one), the exported model, and, when the chain ran a bench, the GPU vs Trainium
cost-performance section of ``training.report`` for that result (``cost/report.md``). The
directory is written under a temp name and renamed, so a failed report leaves none; the
record step then adds ``lineage.json``. Submitted by ``python -m training.pipeline submit``
as report.sbatch (training/slurm/).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly
from training.files.publish import replace_dir
from training.pipeline.keys import SHORT
from training.pipeline.records import finished_run, read_json


def _produced(stage: str, out: dict[str, Any]) -> str:
    """What a stage produced, in a few words (the lineage table's last column)."""
    if stage == "precompute":
        return f"features index sha256 `{out['feature_index_sha256']}` ({out['samples']} samples)"
    if stage == "train":
        return f"step {out['step']} checkpoint, manifest sha256 `{out['checkpoint_manifest_sha256']}`"
    if stage == "bench":
        return f"{out['samples_per_s']:.2f} samples/s, result sha256 `{out['bench_sha256']}`"
    if stage == "export":
        return f"{len(out['files_sha256'])} files, {out['weights']} weights, {out['dtype']}"
    return ""


def _lineage_rows(stages: list[dict[str, Any]]) -> list[str]:
    lines = ["| stage | key | job | package | env | produced |", "|---|---|---|---|---|---|"]
    for s in stages:
        attempts = f" (attempts {', '.join(s['jobs'])})" if len(s.get("jobs") or []) > 1 else ""
        lines.append(f"| {s['stage']} | `{s['key'][:SHORT]}` | {s['job']['id']}{attempts} | "
                     f"`{s['package']['hash']}` | `{s['env']['hash'] or 'none'}` | {_produced(s['stage'], s['outputs'])} |")
    return lines


def cost_lines(bench: dict[str, Any], out: Path, *, samples: int, epochs: float) -> list[str]:
    """The bench's numbers and training.report's cost-performance report of it in ``out``. The
    cost part is optional: an instance type the price table lacks is a WARN line in the report
    and the log, never a failed report (the bench numbers stay)."""
    from training.report.build import build as cost_report
    from training.report.inputs import Options

    lines = ["## Throughput and cost", "", f"- {bench['samples_per_s']:.2f} samples/s on {bench['nodes']} x "
             f"{bench['instance_type']}, MFU {bench['mfu']}"]
    try:
        cost = cost_report([bench["paths"]["bench"]], out, opts=Options(dataset_samples=samples, epochs=epochs))
    except UserError as exc:
        print(f"WARN: report: no cost section: {exc}", file=sys.stderr, flush=True)
        shutil.rmtree(out, ignore_errors=True)
        return [*lines, f"- WARN: no cost section: {exc}", ""]
    return [*lines, f"- [cost-performance report](cost/{cost.name}): {samples} samples x {epochs:g} epochs", ""]


def build(spec: dict[str, Any], out: Path) -> Path:
    """Write the report directory ``out`` (through a temp directory); returns report.md."""
    inputs = {}
    for name, entry in spec["inputs"].items():
        run = finished_run(Path(entry["dir"]), entry["key"])
        if run is None:
            raise UserError(f"{entry['dir']}/run.json: the {name} stage is not finished; submit the recipe again")
        inputs[name] = run
    stages = {s["stage"]: s for run in inputs.values() for s in run["lineage"]}
    tmp = out.with_name(f".{out.name}.tmp-report")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    recipe = spec["recipe"]
    lines = [f"# Pipeline report: {recipe['name']}", "",
             f"Recipe `{recipe['path']}` (sha256 `{recipe['sha256']}`), package `{spec['package']['hash']}`.", "",
             "## Lineage", "", *_lineage_rows(list(stages.values())), ""]
    pre, train, export = stages["precompute"], stages["train"], stages["export"]
    tc = pre["outputs"].get("text_conditioning") or {}
    lines += ["## Data", "", f"- features: `{pre['outputs']['paths']['features']}`: {pre['outputs']['samples']} samples "
              f"in {pre['outputs']['shards']} shards",
              f"- index.json sha256: `{pre['outputs']['feature_index_sha256']}`",
              f"- text conditioning: CHI `{tc.get('chi', '?')}`, {tc.get('max_text_tokens', '?')} tokens", ""]
    config = train.get("config") or {}
    lines += ["## Training", "", f"- run: `{train['outputs']['paths']['run_dir']}` (job {train['job']['id']})",
              f"- model: preset `{config.get('model', {}).get('preset')}`"
              + (f", from `{config['model']['pretrained']}`" if config.get("model", {}).get("pretrained") else "")
              + (f", LoRA rank {config['lora']['rank']}" if config.get("lora", {}).get("rank") else ""),
              f"- {train['outputs']['step']} steps, {train['outputs']['samples_seen']} samples on "
              f"{train['outputs']['world_size']} ranks, final loss {train['outputs']['final_loss']}"]
    grids = sorted(Path(train["outputs"]["paths"]["run_dir"], "validation").glob("step-*.png"))
    if grids:
        shutil.copy2(grids[-1], tmp / "validation.png")
        lines.append(f"- validation grid at {grids[-1].stem}: ![validation](validation.png)")
    lines += ["", "## Model", "", f"- `{export['outputs']['paths']['model']}`: {export['outputs']['weights']} weights "
              f"of `{export['outputs']['checkpoint']}`, {export['outputs']['dtype']}",
              *(f"- `{name}` sha256 `{digest}`" for name, digest in export["outputs"]["files_sha256"].items()), ""]
    if "bench" in inputs:
        lines += cost_lines(inputs["bench"]["outputs"], tmp / "cost", samples=pre["outputs"]["samples"],
                            epochs=float(spec["section"].get("epochs", 1.0)))
    (tmp / "report.md").write_text("\n".join(lines) + "\n")
    replace_dir(tmp, out)
    return out / "report.md"


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.pipeline.report", description=__doc__.splitlines()[0])
    p.add_argument("--stage", required=True, help="the report stage's stage.json (written by submit)")
    args = p.parse_args(argv)
    spec = read_json(Path(args.stage))
    if spec is None or spec.get("stage") != "report":
        raise UserError(f"--stage {args.stage}: not a report stage file of python -m training.pipeline submit")
    report = build(spec, Path(spec["outputs"]["report"]))
    print(json.dumps({"report": str(report)}), flush=True)


if __name__ == "__main__":
    main()
