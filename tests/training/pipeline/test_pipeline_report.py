"""The report stage from finished stages' run.json files: lineage table, data, training, model,
and the cost section of a bench (training/report/build.py), which degrades to a WARN line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.training.report.bench_fixtures import make_result
from training.errors import UserError
from training.pipeline.record import chain, summary
from training.pipeline.records import RUN_FORMAT, write_json_atomic
from training.pipeline.report import build


def finished(root: Path, stage: str, outputs: dict[str, Any], inputs: dict[str, dict], **extra) -> dict[str, Any]:
    """A stage directory with the run.json the record step writes (the fields report reads)."""
    key = (stage[0] * 64)[:64]
    directory = root / f"sana-{stage}-{key[:12]}"
    directory.mkdir()
    run = {"format": RUN_FORMAT, "stage": stage, "key": key, "dir": str(directory), "job": {"id": "7"},
           "attempts": [{"job_id": "7"}], "user": "alice", "package": {"root": "/fsx/platform/3f2a", "hash": "3f2a"},
           "env": {"path": "/fsx/envs/gpu-a1", "hash": "a1"}, "started_at": "t0", "finished_at": "t1",
           "recipe": {"name": "r", "path": "/r.yaml", "sha256": "0" * 64, "content": {}}, "resolved": {}, **extra}
    paths = {name: str(directory / rel) for name, rel in outputs.pop("paths").items()}
    for path in paths.values():
        if not path.endswith(".json"):
            Path(path).mkdir(parents=True, exist_ok=True)
    run["outputs"] = {"paths": paths, **outputs}
    run["lineage"] = [*chain(inputs), summary(run)]
    write_json_atomic(directory / "run.json", run)
    return run


@pytest.fixture
def chain_runs(tmp_path: Path) -> dict[str, dict[str, Any]]:
    pre = finished(tmp_path, "precompute", {"paths": {"features": "features"}, "feature_index_sha256": "f" * 64,
                                            "samples": 6, "shards": 2, "text_conditioning": {"chi": "sana",
                                                                                             "max_text_tokens": 16}}, {})
    train = finished(tmp_path, "train", {"paths": {"run_dir": "."}, "checkpoint": "/ckpt/step-00000020", "step": 20,
                                         "samples_seen": 80, "world_size": 1, "checkpoint_manifest_sha256": "c" * 64,
                                         "final_loss": 0.25}, {"precompute": pre},
                     resolved={"config": {"model": {"preset": "tiny", "pretrained": "/base"}, "lora": {"rank": 0}}})
    (Path(train["dir"]) / "validation").mkdir()
    (Path(train["dir"]) / "validation" / "step-00000020.png").write_bytes(b"\x89PNG grid")
    export = finished(tmp_path, "export", {"paths": {"model": "model"}, "files_sha256": {"config.json": "e" * 64},
                                           "checkpoint": "/ckpt/step-00000020", "step": 20, "weights": "model",
                                           "dtype": "fp32"}, {"train": train})
    return {"precompute": pre, "train": train, "export": export}


def spec_for(tmp_path: Path, inputs: dict[str, dict]) -> dict[str, Any]:
    return {"stage": "report", "recipe": {"name": "r", "path": "/r.yaml", "sha256": "0" * 64},
            "package": {"hash": "3f2a"}, "section": {"epochs": 2.0},
            "inputs": {name: {"key": run["key"], "dir": run["dir"]} for name, run in inputs.items()},
            "outputs": {"report": str(tmp_path / "report")}}


def test_the_report_carries_the_lineage_data_training_and_model(tmp_path, chain_runs) -> None:
    report = build(spec_for(tmp_path, {"export": chain_runs["export"]}), tmp_path / "report")
    text = report.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| precompute", "| train", "| export"]
    assert f"features index sha256 `{'f' * 64}` (6 samples)" in text
    assert "- 20 steps, 80 samples on 1 ranks, final loss 0.25" in text and "from `/base`" in text
    assert (tmp_path / "report" / "validation.png").read_bytes() == b"\x89PNG grid"
    assert "## Throughput and cost" not in text
    assert not list(tmp_path.glob(".report.tmp-*"))


def test_a_bench_adds_the_cost_report_or_a_warn_line_when_its_instance_has_no_price(tmp_path, chain_runs) -> None:
    def bench_stage(instance: str) -> dict:
        result = make_result(backend="gpu", instance_type=instance, accelerator="h100", nodes=1, per_node=8,
                             sps_per_accel=10.0, peak=989.0, mfu=0.4)
        run = finished(tmp_path / instance, "bench", {"paths": {"bench": "bench.json"}, "bench_sha256": "b" * 64,
                                                      "samples_per_s": 80.0, "mfu": 0.4, "instance_type": instance,
                                                      "nodes": 1}, {"precompute": chain_runs["precompute"]})
        Path(run["outputs"]["paths"]["bench"]).write_text(json.dumps(result))
        return run

    (tmp_path / "ml.p5.48xlarge").mkdir()
    inputs = {"export": chain_runs["export"], "bench": bench_stage("ml.p5.48xlarge")}
    text = build(spec_for(tmp_path, inputs), tmp_path / "report").read_text()
    assert "- 80.00 samples/s on 1 x ml.p5.48xlarge, MFU 0.4" in text
    assert "- [cost-performance report](cost/report.md): 6 samples x 2 epochs" in text
    assert "ml.p5.48xlarge" in (tmp_path / "report" / "cost" / "report.md").read_text()

    (tmp_path / "local").mkdir()
    inputs["bench"] = bench_stage("local")
    text = build(spec_for(tmp_path, inputs), tmp_path / "report").read_text()
    assert "- WARN: no cost section: no price for instance type local in" in text
    assert not (tmp_path / "report" / "cost").exists()


def test_an_unfinished_input_stage_fails_the_report_in_one_line(tmp_path, chain_runs) -> None:
    (Path(chain_runs["export"]["dir"]) / "run.json").unlink()
    with pytest.raises(UserError, match=r"run.json: the export stage is not finished; submit the recipe again"):
        build(spec_for(tmp_path, {"export": chain_runs["export"]}), tmp_path / "report")
    assert not (tmp_path / "report").exists()
