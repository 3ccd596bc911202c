"""``lineage MODEL_DIR``: what a pipeline output came from.

MODEL_DIR is an export's model directory (its ``lineage.json``, which travels with the
model), a report directory, or any stage directory (its ``run.json``). Printed per stage,
upstream first: key, jobs, user, package and env hashes, and the digests of what it produced
(the feature index's sha256, the checkpoint manifest's, every exported file's); ``--json``
prints the document itself. Two runs compare with ``diff`` of their ``--json`` output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.pipeline.record import LINEAGE_FILE
from training.pipeline.records import read_json


def load_lineage(path: Path) -> dict[str, Any]:
    """The lineage document of an output or stage directory."""
    doc = read_json(path / LINEAGE_FILE)
    if doc is not None:
        return doc
    run = read_json(path / "run.json")
    if run is not None and "lineage" in run:
        return {"recipe": {k: run["recipe"][k] for k in ("name", "path", "sha256")},
                "recipe_content": run["recipe"]["content"], "stages": run["lineage"]}
    raise UserError(f"{path}: no {LINEAGE_FILE} or run.json; give an exported model directory (<export stage>/model), "
                    "a report directory or a stage directory of python -m training.pipeline")


def _flat(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict) and value:
        return [line for k, v in value.items() for line in _flat(f"{prefix}.{k}" if prefix else k, v)]
    return [f"{prefix}={json.dumps(value)}"]


def _attempts(stage: dict[str, Any]) -> str:
    """", attempts 4712, 4720": every job queued for the stage (failed, cancelled, the last)."""
    jobs = stage.get("jobs") or []
    return f" (attempts {', '.join(jobs)})" if len(jobs) > 1 else ""


def render_lineage(doc: dict[str, Any], *, config: bool = False) -> str:
    recipe = doc["recipe"]
    lines = [f"recipe {recipe['name']}: {recipe['path']} (sha256 {recipe['sha256']})"]
    for s in doc["stages"]:
        out = s["outputs"]
        lines.append(f"{s['stage']}: key {s['key']}")
        lines.append(f"  job {s['job']['id']}{_attempts(s)} by {s['user']}, finished {s['finished_at']}")
        lines.append(f"  package {s['package']['hash']} ({s['package']['root']})")
        lines.append(f"  env {s['env']['hash'] or 'none'} ({s['env']['path']})")
        lines.append(f"  output {next(iter(out['paths'].values()))}")
        if "feature_index_sha256" in out:
            lines.append(f"  feature index sha256 {out['feature_index_sha256']} ({out['samples']} samples)")
        if "checkpoint_manifest_sha256" in out:
            lines.append(f"  checkpoint {out['checkpoint']} (step {out['step']}), manifest sha256 "
                         f"{out['checkpoint_manifest_sha256']}; final loss {out['final_loss']}")
        if "bench_sha256" in out:
            lines.append(f"  bench sha256 {out['bench_sha256']}: {out['samples_per_s']} samples/s, mfu {out['mfu']}")
        for name, digest in (out.get("files_sha256") or {}).items():
            lines.append(f"  file {name} sha256 {digest}")
        if "report_sha256" in out:
            lines.append(f"  report.md sha256 {out['report_sha256']}")
        if config and s.get("config"):
            lines += [f"  config {line}" for line in _flat("", s["config"])]
    return "\n".join(lines)
