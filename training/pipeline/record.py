"""The record step of a stage's job: check the stage's output, then write its run.json.

launch.sh runs ``python -m training.pipeline record STAGE.json`` (one task, same env or
image) only after every task of the stage's step exited 0. It refuses, in one line and with
a failed job, an output that is not what the stage promised (no index.json, a final
checkpoint short of max_steps, an export of another checkpoint than the one train recorded),
so a run.json always stands for a whole, checked output.

Lineage: each run.json carries ``lineage``, the summaries of every stage the output comes
from, upstream first, then its own. The export writes the chain into its model directory
(``<model>/lineage.json``) and the report into its directory, so a model directory names
the features, config, code and environment it came from wherever it is copied.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.pipeline.keys import sha256_file, tree_sha256
from training.pipeline.records import RUN_FORMAT, STAGE_FORMAT, finished_run, read_json, write_json_atomic
from training.pipeline.site import current_user

LINEAGE_FILE = "lineage.json"
LINEAGE_FORMAT = "sana-pipeline-lineage/1"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----- each stage's output, checked and digested ------------------------------------------
def precompute_outputs(spec: dict[str, Any], inputs: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    from training.data.shards import FORMAT

    features = Path(spec["outputs"]["features"])
    index = read_json(features / "index.json")
    if index is None or index.get("format") != FORMAT:
        raise UserError(f"{features}/index.json: missing or not a {FORMAT} index; the precompute did not finish")
    outputs = {"feature_index_sha256": sha256_file(features / "index.json"), "samples": index["num_samples"],
               "shards": len(index["shards"]), "text_conditioning": index.get("text_conditioning")}
    return outputs, {"created_by": index.get("created_by")}


def _newest_checkpoint(run_dir: Path) -> Path:
    from training.checkpoint.layout import find_latest

    # Presence and sizes only (the export re-hashes every file against the manifest).
    found = find_latest(run_dir / "checkpoints", full=False)
    if found is None:
        raise UserError(f"{run_dir}/checkpoints: no complete checkpoint; the training did not finish")
    return found


def train_outputs(spec: dict[str, Any], inputs: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    run_dir = Path(spec["outputs"]["run_dir"])
    ckpt = _newest_checkpoint(run_dir)
    state = json.loads((ckpt / "train_state.json").read_text())
    config = state.get("config") or {}
    if state.get("step") != config.get("max_steps"):
        raise UserError(f"{ckpt}: the newest checkpoint is step {state.get('step')}, not max_steps "
                        f"{config.get('max_steps')}; the training stopped early")
    features = inputs["precompute"]["outputs"]["paths"]["features"]
    if config.get("data", {}).get("path") != features:
        raise UserError(f"{ckpt}: trained on {config.get('data', {}).get('path')}, not the chain's features {features}")
    losses = []
    if (run_dir / "metrics.jsonl").exists():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if "loss" in record:
                losses.append((record.get("step"), record["loss"]))
    outputs = {"checkpoint": str(ckpt), "step": state["step"], "samples_seen": state.get("samples_seen"),
               "world_size": state.get("world_size"), "checkpoint_manifest_sha256": sha256_file(ckpt / "manifest.json"),
               "final_loss": losses[-1][1] if losses else None}
    return outputs, {"config": config, "provenance": state.get("provenance")}


def bench_outputs(spec: dict[str, Any], inputs: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    from training.perf.bench_result import BenchResult

    path = Path(spec["outputs"]["bench"])
    if not path.is_file():
        raise UserError(f"{path}: the bench wrote no result")
    result = BenchResult.load(path)
    return ({"bench_sha256": sha256_file(path), "samples_per_s": result.samples_per_s_total,
             "mfu": result.mfu, "instance_type": result.instance_type, "nodes": result.nodes}, {})


def export_outputs(spec: dict[str, Any], inputs: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    model = Path(spec["outputs"]["model"])
    provenance = read_json(model / "training_provenance.json")
    if provenance is None:
        raise UserError(f"{model}/training_provenance.json: missing; the export did not finish")
    expected = inputs["train"]["outputs"]["checkpoint"]
    if provenance.get("checkpoint") != str(Path(expected).resolve()):
        raise UserError(f"{model}: exported {provenance.get('checkpoint')}, not the train stage's final checkpoint "
                        f"{expected}")
    return ({"files_sha256": tree_sha256(model, skip=(LINEAGE_FILE,)), "checkpoint": provenance["checkpoint"],
             "step": provenance.get("step"), "weights": provenance.get("weights"), "dtype": provenance.get("dtype")},
            {"training_provenance": provenance})


def report_outputs(spec: dict[str, Any], inputs: dict[str, dict[str, Any]]) -> tuple[dict, dict]:
    report = Path(spec["outputs"]["report"]) / "report.md"
    if not report.is_file():
        raise UserError(f"{report}: missing; the report did not finish")
    return {"report_sha256": sha256_file(report)}, {}


OUTPUTS = {"precompute": precompute_outputs, "train": train_outputs, "bench": bench_outputs,
           "export": export_outputs, "report": report_outputs}


# ----- lineage -----------------------------------------------------------------------------
def summary(run: dict[str, Any]) -> dict[str, Any]:
    """One stage in a lineage: identity, what it ran on, what it produced."""
    return {"stage": run["stage"], "key": run["key"], "dir": run["dir"], "job": run["job"],
            "jobs": [a["job_id"] for a in run.get("attempts", [])], "user": run["user"],
            "package": run["package"], "env": run["env"], "outputs": run["outputs"],
            "started_at": run.get("started_at"), "finished_at": run["finished_at"],
            **({"config": run["resolved"]["config"]} if "config" in run.get("resolved", {}) else {})}


def chain(inputs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The upstream stages' lineages merged (each stage once, by key, upstream first)."""
    seen: dict[str, dict[str, Any]] = {}
    for run in inputs.values():
        for entry in run.get("lineage", []):
            seen.setdefault(entry["key"], entry)
    return list(seen.values())


def lineage_document(run: dict[str, Any]) -> dict[str, Any]:
    return {"format": LINEAGE_FORMAT, "recipe": {k: run["recipe"][k] for k in ("name", "path", "sha256")},
            "recipe_content": run["recipe"]["content"], "stages": run["lineage"]}


def _job() -> dict[str, Any]:
    env = os.environ
    return {"id": env.get("SLURM_JOB_ID", ""), "name": env.get("SLURM_JOB_NAME", ""),
            "partition": env.get("SLURM_JOB_PARTITION", ""), "nodes": env.get("SLURM_JOB_NUM_NODES", ""),
            "nodelist": env.get("SLURM_JOB_NODELIST", ""), "restarts": int(env.get("SLURM_RESTART_COUNT") or 0),
            "log_dir": env.get("SANA_JOB_LOG_DIR", "")}


def record(stage_file: Path) -> dict[str, Any]:
    """Check the stage's output and write its run.json (and lineage files); returns the run."""
    from training.provenance import job_provenance

    spec = read_json(stage_file)
    if spec is None or spec.get("format") != STAGE_FORMAT:
        raise UserError(f"{stage_file}: not a pipeline stage file; submit with python -m training.pipeline submit")
    stage_dir = Path(spec["dir"])
    run_dir = os.environ.get("SANA_RUN_DIR")
    if run_dir and Path(run_dir) != stage_dir:
        raise UserError(f"{stage_file} is for {stage_dir}, but this job's directory is {run_dir} (another job name)")
    inputs: dict[str, dict[str, Any]] = {}
    for name, entry in spec["inputs"].items():
        upstream = finished_run(Path(entry["dir"]), entry["key"])
        if upstream is None:
            raise UserError(f"{entry['dir']}/run.json: the {name} stage this one read is not finished")
        inputs[name] = upstream
    outputs, resolved = OUTPUTS[spec["stage"]](spec, inputs)
    provenance = job_provenance()
    run = {
        **{k: spec[k] for k in ("stage", "key", "job_name", "dir", "section", "recipe", "inputs", "attempts")},
        "format": RUN_FORMAT,
        "outputs": {"paths": spec["outputs"], **outputs},
        "resolved": resolved,
        "key_package_hash": spec["package"]["hash"],
        "package": {"root": provenance.get("package_root", ""), "hash": provenance.get("package_hash", "")},
        "env": {"path": provenance.get("env_path", ""), "hash": provenance.get("env_requirements_hash", "")},
        "job": _job(), "user": current_user(),
        "submitted_at": (spec["attempts"][-1]["submitted_at"] if spec.get("attempts") else None),
        "started_at": os.environ.get("SANA_STEP_STARTED_AT"), "finished_at": _now(),
    }
    run["inputs"] = {name: {**run["inputs"][name], "outputs": upstream["outputs"]} for name, upstream in inputs.items()}
    run["lineage"] = [*chain(inputs), summary(run)]
    # The lineage files first, run.json last: run.json present means everything is.
    if spec["stage"] == "export":
        write_json_atomic(Path(spec["outputs"]["model"]) / LINEAGE_FILE, lineage_document(run))
    if spec["stage"] == "report":
        write_json_atomic(Path(spec["outputs"]["report"]) / LINEAGE_FILE, lineage_document(run))
    write_json_atomic(stage_dir / "run.json", run)
    return run
