"""``python -m training.pipeline`` end to end on the fixture's real Slurm daemons.

As a researcher on the login node: the unprivileged job user runs the CLI from the installed,
root-owned, read-only package (<fsx>/platform/current) with the gpu env's Python, and every
stage is a real job of the package's own scripts through launch.sh (tiny models from
training/model/tiny.py, six synthetic images, the tiny CPU preset on one rank).

One story, in as few jobs as it can prove (8 run, 7 are cancelled):

1. two submits of a recipe at once queue ONE chain of four jobs, each after the one before;
   the chain completes and every stage has its run.json;
2. submitting it again queues nothing;
3. a second recipe changes one training override (fine-tune from a base model that is not
   there yet): precompute is reused, train/export/report are queued; train fails,
   Slurm cancels export and report, and ``status`` names the cause in one line;
4. the base model appears, the same recipe is submitted again: train, export and report
   complete (the train stage records both of its jobs);
5. ``lineage`` of the export names the feature index hash and the package hash;
6. ``cancel`` of a third recipe's fresh chain cancels its queued jobs;
7. a submit whose sbatch fails half-way (no such partition) cancels what it had queued.
"""

# ruff: noqa: F811  (pytest fixtures: `site` is imported from test_train_jobs and requested by name)
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml

from tests.slurm.test_train_jobs import (  # noqa: F401  (site: the shared fixture)
    JOB_TIMEOUT,
    Site,
    site,
)

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STAGES = ["precompute", "train", "export", "report"]


def pipeline(cluster: SlurmCluster, site: Site, *args: str) -> subprocess.Popen:
    """``python -m training.pipeline ARGS`` as the job user, from the installed package."""
    argv = cluster.as_user(cluster.user, [str(site.envs["gpu"] / "bin" / "python"), "-m", "training.pipeline", *args])
    env = cluster.env(**site.env(SANA_NPROC_PER_NODE="1", PYTHONPATH=str(site.fsx / "platform" / "current")))
    return subprocess.Popen(argv, env=env, cwd=site.submit_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def run(cluster: SlurmCluster, site: Site, *args: str, ok: bool = True) -> str:
    proc = pipeline(cluster, site, *args)
    out, err = proc.communicate(timeout=300)
    assert (proc.returncode == 0) == ok, f"pipeline {' '.join(args)} exited {proc.returncode}:\n{out}\n{err}"
    return out + err


def table(out: str) -> dict[str, dict[str, str]]:
    """The submit/status table's rows by stage: {"job": ..., "rest": the line}."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in STAGES and len(parts) > 2:
            rows[parts[0]] = {"job": parts[1], "line": line}
    return rows


def stage_dir(user_dir: Path, line: str) -> Path:
    """The stage directory of a table row (its output path lies in it)."""
    output = next(Path(word) for word in line.split() if word.startswith(str(user_dir)))
    return user_dir / output.relative_to(user_dir).parts[0]


def wait_chain(cluster: SlurmCluster, job_ids: list[str]) -> dict[str, dict[str, str]]:
    """Until every job has ended; their `scontrol show job` records."""
    return {job_id: cluster.wait(int(job_id), timeout=JOB_TIMEOUT) for job_id in job_ids}


def logs_of(site: Site, cluster: SlurmCluster) -> str:
    user = site.user_name
    texts = [f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((site.fsx / "logs" / user).rglob("*"))
             if p.is_file() and (p.name == "job.log" or p.suffix == ".out")]
    return "\n".join(texts[-8:]) + cluster.logs()


@pytest.fixture(scope="module")
def inputs(site: Site) -> dict[str, Path]:
    """Raw images + captions and the tiny models, readable by the job user."""
    from training.model.tiny import build_tiny_components, write_image_caption_folder

    scratch = site.scratch("pipeline-inputs")
    write_image_caption_folder(scratch / "raw", num=6, seed=1)
    models = build_tiny_components(scratch / "models")
    for path in [scratch, *scratch.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"raw": scratch / "raw", **models, "scratch": scratch}


def write_recipe(site: Site, inputs: dict[str, Path], name: str, sections: dict | None = None, **overrides) -> Path:
    recipe = {
        "name": name,
        "source": {"raw": str(inputs["raw"])},
        "precompute": {"vae": str(inputs["vae"]), "text_encoder": str(inputs["text_encoder"]),
                       "tokenizer": str(inputs["tokenizer"]), "resolution": 64, "max_text_tokens": 16,
                       "samples_per_shard": 3},
        "train": {"config": "training/configs/tiny-cpu.yaml",
                  "overrides": {"max_steps": 20, "checkpoint.every_steps": 10, "log_every": 10,
                                "tensorboard": False, **overrides}},
        "export": {"dtype": "fp32"},
        **(sections or {}),
    }
    path = site.submit_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    if site.user is not None and os.getuid() == 0:
        os.chown(path, site.user.uid, site.user.gid)
    return path


def test_a_recipe_runs_as_chained_jobs_resumes_after_a_failure_and_records_its_lineage(
        slurm_cluster: SlurmCluster, site: Site, inputs: dict[str, Path]) -> None:
    cluster = slurm_cluster
    user_dir = site.fsx / "artefacts" / "checkpoints" / site.user_name

    # 1. Two submits at once: one chain of four jobs, each after the previous one.
    first = write_recipe(site, inputs, "tiny")
    procs = [pipeline(cluster, site, "submit", str(first)) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    tables = [table(out) for out, _ in outs]
    jobs = [r["job"] for r in tables[0].values()]
    assert list(tables[0]) == STAGES and [r["job"] for r in tables[1].values()] == jobs, outs
    actions = sorted(("submitted" in t["precompute"]["line"], "already" in t["precompute"]["line"]) for t in tables)
    assert actions == [(False, True), (True, False)], outs  # one queued, the other found the queue
    # Job ids are sequential: had the second submit queued a chain of its own, the next id would exist.
    assert cluster.run("scontrol", "show", "job", str(int(jobs[-1]) + 1), check=False) == ""
    for before, after in zip(jobs, jobs[1:], strict=False):
        dependency = cluster.job(int(after)).get("Dependency", "")
        # Pending on its predecessor (or already released: Slurm clears it once satisfied).
        assert dependency in (f"afterok:{before}(unfulfilled)", "(null)"), (after, dependency)
    assert cluster.job(int(jobs[-1]))["Dependency"] == f"afterok:{jobs[-2]}(unfulfilled)"
    ended = wait_chain(cluster, jobs)
    assert all(info["JobState"] == "COMPLETED" for info in ended.values()), (ended, logs_of(site, cluster))
    for job_id in jobs:
        assert cluster.job(int(job_id))["UserId"].startswith(f"{site.user_name}(")
    runs = {stage: json.loads((stage_dir(user_dir, tables[0][stage]["line"]) / "run.json").read_text())
            for stage in STAGES}
    assert [runs[s]["job"]["id"] for s in STAGES] == jobs
    for earlier, later in zip(STAGES, STAGES[1:], strict=False):
        assert runs[later]["started_at"] >= runs[earlier]["finished_at"], (earlier, later)
    features = Path(runs["precompute"]["outputs"]["paths"]["features"])
    index_sha = hashlib.sha256((features / "index.json").read_bytes()).hexdigest()
    assert runs["precompute"]["outputs"]["feature_index_sha256"] == index_sha
    model = Path(runs["export"]["outputs"]["paths"]["model"])
    assert (model / "diffusion_pytorch_model.safetensors").is_file() and (model / "lineage.json").is_file()
    assert "## Lineage" in (Path(runs["report"]["outputs"]["paths"]["report"]) / "report.md").read_text()
    assert all(Path(runs[s]["dir"]).stat().st_uid == site.user.uid for s in STAGES if site.user)

    # 2. Unchanged recipe: nothing runs.
    out = run(cluster, site, "submit", str(first))
    assert "nothing to run" in out and all("done" in r["line"] for r in table(out).values()), out
    assert not cluster.run("squeue", "-h", "-u", site.user_name).strip()

    # 3. One training override changed: fine-tune from a base model that is not there yet.
    base = inputs["scratch"] / "base-transformer"
    second = write_recipe(site, inputs, "tiny-ft", **{"model.pretrained": str(base)})
    out = run(cluster, site, "submit", str(second))
    rows = table(out)
    assert "done" in rows["precompute"]["line"] and rows["precompute"]["job"] == jobs[0], out
    retry = [rows[s]["job"] for s in STAGES[1:]]
    assert all("submitted" in rows[s]["line"] for s in STAGES[1:]) and not set(retry) & set(jobs), out
    ended = wait_chain(cluster, retry)
    assert [ended[j]["JobState"] for j in retry] == ["FAILED", "CANCELLED", "CANCELLED"], ended
    status = run(cluster, site, "status", "tiny-ft")
    rows = table(status)
    assert "COMPLETED" in rows["precompute"]["line"]
    train_line = rows["train"]["line"]
    assert "FAILED" in train_line and f"error: model.pretrained: {base} has no config.json" in train_line, status
    for stage in ("export", "report"):
        assert "CANCELLED" in rows[stage]["line"] and "not run: train failed" in rows[stage]["line"], status
    assert len(status.splitlines()) == 1 + 2 + len(STAGES) + 1, status  # title, header + rule, a row each, summary
    assert not (stage_dir(user_dir, train_line) / "run.json").exists()

    # 4. The base model is copied in; the same recipe, submitted again, completes from train on.
    shutil.copytree(model, base)
    out = run(cluster, site, "submit", str(second))
    rows = table(out)
    assert "done" in rows["precompute"]["line"], out
    again = [rows[s]["job"] for s in STAGES[1:]]
    ended = wait_chain(cluster, again)
    assert all(ended[j]["JobState"] == "COMPLETED" for j in again), (ended, logs_of(site, cluster))
    status = run(cluster, site, "status", str(second))
    assert all("COMPLETED" in r["line"] for r in table(status).values()) and "4/4 stages finished" in status, status
    ft_train = json.loads((stage_dir(user_dir, rows["train"]["line"]) / "run.json").read_text())
    assert [a["job_id"] for a in ft_train["attempts"]] == [retry[0], again[0]]
    assert ft_train["resolved"]["config"]["model"]["pretrained"] == str(base)
    assert ft_train["inputs"]["precompute"]["key"] == runs["precompute"]["key"]
    ft_model = Path(rows["export"]["line"].split()[-1])

    # 5. The exported model names its features and code.
    lineage = run(cluster, site, "lineage", str(ft_model))
    assert f"feature index sha256 {index_sha}" in lineage, lineage
    assert f"package {site.package.name} ({site.package})" in lineage, lineage
    doc = json.loads((ft_model / "lineage.json").read_text())
    assert [s["stage"] for s in doc["stages"]] == ["precompute", "train", "export"]
    assert doc["stages"][-1]["outputs"]["checkpoint"] == ft_train["outputs"]["checkpoint"]

    # 6. cancel: a third recipe's fresh chain, cancelled while queued.
    # (a long run: its train job is surely still queued or running when cancel comes)
    third = write_recipe(site, inputs, "tiny-lr", **{"optim.lr": 5.0e-4, "max_steps": 100000})
    out = run(cluster, site, "submit", str(third))
    queued = [table(out)[s]["job"] for s in STAGES[1:]]
    out = run(cluster, site, "cancel", "tiny-lr")
    assert "cancelled 3 job(s)" in out, out
    ended = wait_chain(cluster, queued)
    assert all(info["JobState"] == "CANCELLED" for info in ended.values()), ended
    assert re.search(r"^train\s+\d+\s+CANCELLED", run(cluster, site, "status", "tiny-lr"), re.M)

    # 7. sbatch refuses a stage half-way: the jobs this submit had queued are cancelled.
    bad = write_recipe(site, inputs, "tiny-bad", {"report": {"partition": "nosuch"}}, **{"optim.lr": 2.0e-3})
    out = run(cluster, site, "submit", str(bad), ok=False)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stage report: sbatch report.sbatch: " in errors[0], out
    assert "Invalid partition name specified" in errors[0], out
    undone = re.search(r"cancelled the 2 job\(s\) this submit queued \((\d+), (\d+)\)$", errors[0])
    assert undone, errors
    ended = wait_chain(cluster, list(undone.groups()))
    assert all(info["JobState"] == "CANCELLED" for info in ended.values()), ended
    cluster.wait_node_idle(timeout=120)
