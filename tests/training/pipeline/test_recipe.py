"""Recipes: the shipped ones plan; every mistake is one line naming its key, all at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from training.errors import UserError
from training.pipeline.plan import build_plan
from training.pipeline.recipe import RecipeError, load_recipe, recipe_from_dict
from training.pipeline.site import Site

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "training" / "pipeline" / "recipes").glob("*.yaml"))


def plan_of(tree: dict[str, Any], site: Site, tmp_path: Path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    recipe, loaded = load_recipe(path)
    return build_plan(recipe, path, loaded, site)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_validates_and_plans_with_its_training_config(path: Path, site: Site) -> None:
    """Each template resolves through training/config.py exactly as its train job will."""
    recipe, tree = load_recipe(path)
    plan = build_plan(recipe, path, tree, site)
    names = [s.name for s in plan.stages]
    assert names[:2] == ["precompute", "train"] and names[-2:] == ["export", "report"]
    train = plan.stage("train")
    assert train.script.name == {"gpu": "train-gpu.sbatch", "trainium": "train-trainium.sbatch"}[recipe.train.backend]
    assert f"--partition={'trn' if recipe.train.backend == 'trainium' else 'gpu'}" in train.options
    assert plan.stage("precompute").script.name == "precompute.sbatch"  # a GPU job on every cluster


def test_the_runbook_cases_are_shipped(site: Site) -> None:
    """runbooks/pipelines.md: 600M at 512 on GPU, the same on Trainium, and a LoRA fine-tune."""
    by_case = {}
    for path in RECIPES:
        recipe, tree = load_recipe(path)
        resolved = build_plan(recipe, path, tree, site).stage("train").section["config"]
        by_case[(recipe.train.backend, resolved["model"]["preset"], resolved["lora"]["rank"] > 0)] = path.name
    assert ("gpu", "sana-600m-512", False) in by_case
    assert ("trainium", "sana-600m-512", False) in by_case
    assert any(lora for (_, _, lora) in by_case)


def test_every_mistake_is_reported_at_once_one_line_each_naming_its_key(tree: dict[str, Any]) -> None:
    tree["name"] = "Tiny Run"
    tree["source"]["raw"] = "raw/images"
    tree["precompute"]["buckets"] = "768"
    tree["precompute"]["colour"] = "red"
    tree["train"]["nodes"] = 0
    tree["train"]["backend"] = "tpu"
    tree["train"]["time"] = "two days"
    tree["export"] = {"dtype": "fp8", "ema": "yes"}
    tree["sbatch_options"] = ["--job-name=x", "account"]
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(tree, "my.yaml")
    lines = info.value.problems
    keys = [line.split(": ")[1] for line in lines]
    assert sorted(keys) == sorted(["source.raw", "precompute.colour", "train.backend", "train.nodes", "train.time",
                                   "export.ema", "sbatch_options", "sbatch_options", "name"]), lines
    assert all(line.startswith("my.yaml: ") and "\n" not in line for line in lines)
    assert "my.yaml: export.ema: expected true/false, got 'yes'" in lines
    assert "my.yaml: train.nodes: must be >= 1, got 0" in lines
    assert "my.yaml: precompute.colour: unknown key; precompute takes" in " ".join(lines)
    # export.dtype and precompute.buckets are checked once their section's types are right
    tree["export"]["ema"] = False
    tree["precompute"].pop("colour")
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(tree, "my.yaml")
    assert "my.yaml: export.dtype: 'fp8' is not one of bf16, fp16, fp32" in info.value.problems
    assert "my.yaml: precompute.buckets: '768' is not one of square, 512, 1024, 2048" in info.value.problems


def test_required_keys_and_the_keys_the_pipeline_sets_are_named(tree: dict[str, Any]) -> None:
    del tree["precompute"]["vae"]
    tree["train"]["overrides"].update({"data.path": "/fsx/data/features/x", "output_dir": "/tmp/run"})
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(tree, "r.yaml")
    assert [p.split(" (")[0] for p in info.value.problems] == [
        "r.yaml: precompute.vae: required", "r.yaml: train.overrides.data.path: set by the pipeline",
        "r.yaml: train.overrides.output_dir: set by the pipeline"]


def test_a_bad_training_override_is_one_line_at_submit_naming_the_config_key(tree, site, tmp_path) -> None:
    tree["train"]["overrides"]["optim.lr"] = -1.0
    with pytest.raises(UserError) as info:
        plan_of(tree, site, tmp_path)
    assert str(info.value) == "train.overrides / train.config (tiny-cpu.yaml): config key optim.lr: must be > 0"
    tree["train"]["overrides"] = {"optim.lrr": 1.0}
    with pytest.raises(UserError, match=r"config key optim.lrr: unknown"):
        plan_of(tree, site, tmp_path)
    tree["train"]["overrides"] = {}
    tree["train"]["config"] = "training/configs/no-such.yaml"
    with pytest.raises(UserError, match=r"^train.config: .*no-such.yaml does not exist"):
        plan_of(tree, site, tmp_path)


def test_the_cli_prints_each_problem_as_one_error_line_and_exits_2(tree: dict[str, Any], tmp_path: Path) -> None:
    tree["train"]["nodes"] = -2
    tree["export"] = {"dtype": "int8"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(tree))
    proc = subprocess.run([sys.executable, "-m", "training.pipeline", "submit", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert sorted(proc.stderr.splitlines()) == [f"error: {path}: export.dtype: 'int8' is not one of bf16, fp16, fp32",
                                                f"error: {path}: train.nodes: must be >= 1, got -2"]
    assert "Traceback" not in proc.stderr
    path.write_text("name: [unclosed\n")
    proc = subprocess.run([sys.executable, "-m", "training.pipeline", "submit", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"error: {path}: not valid YAML")
