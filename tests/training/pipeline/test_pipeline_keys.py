"""Stage keys: what re-runs when a recipe changes, and what does not."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from training.pipeline.plan import build_plan
from training.pipeline.recipe import load_recipe
from training.pipeline.site import Site


def keys(tree: dict[str, Any], site: Site, tmp_path: Path, text: str | None = None) -> dict[str, str]:
    path = tmp_path / "recipe.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(tree))
    recipe, loaded = load_recipe(path)
    return {s.name: s.key for s in build_plan(recipe, path, loaded, site).stages}


def changed(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [name for name in a if a[name] != b[name]]


def test_an_unchanged_recipe_keeps_every_key_whatever_its_layout_name_or_resources(tree, site, tmp_path) -> None:
    base = keys(tree, site, tmp_path)
    # Same content written otherwise: other key order, flow style, 1e-3 spelled differently.
    text = yaml.safe_dump(tree, sort_keys=False, default_flow_style=True).replace("0.001", "1.0e-3")
    assert keys(tree, site, tmp_path, text) == base
    # The name, partitions, time limits, extra sbatch options and precompute's node count say
    # where a job runs, not what it makes.
    tree.update(name="tiny-again", sbatch_options=["--account=imaging"])
    tree["precompute"].update(partition="gpu2", time="1:00:00", nodes=4)
    tree["train"].update(partition="p4d", time="2-00:00:00", sbatch_options=["--gres=gpu:4"])
    tree["export"] = {"partition": "cpu"}
    assert keys(tree, site, tmp_path) == base


def test_one_training_override_changes_train_export_and_report_only(tree, site, tmp_path) -> None:
    base = keys(tree, site, tmp_path)
    tree["train"]["overrides"]["optim.lr"] = 5.0e-4
    assert changed(base, keys(tree, site, tmp_path)) == ["train", "export", "report"]


@pytest.mark.parametrize(("section", "key", "value"), [("train", "nodes", 2), ("train", "backend", "trainium")])
def test_the_world_size_and_backend_are_part_of_the_training_result(tree, site, tmp_path, section, key, value) -> None:
    base = keys(tree, site, tmp_path)
    tree[section][key] = value
    if value == "trainium":
        tree["train"]["config"] = "training/configs/trn-sana-600m-512.yaml"
    assert changed(base, keys(tree, site, tmp_path)) == ["train", "export", "report"]


def test_an_export_setting_changes_export_and_report_only(tree, site, tmp_path) -> None:
    base = keys(tree, site, tmp_path)
    tree["export"] = {"dtype": "bf16"}
    assert changed(base, keys(tree, site, tmp_path)) == ["export", "report"]


def test_a_precompute_setting_or_the_raw_data_uri_changes_every_stage(tree, site, tmp_path) -> None:
    base = keys(tree, site, tmp_path)
    tree["precompute"]["max_text_tokens"] = 32
    assert changed(base, keys(tree, site, tmp_path)) == ["precompute", "train", "export", "report"]
    tree["precompute"]["max_text_tokens"] = 16
    tree["source"]["raw"] = "s3://bucket/raw/tiny-v2/"
    assert changed(base, keys(tree, site, tmp_path)) == ["precompute", "train", "export", "report"]


def test_the_content_of_a_prompts_file_is_hashed_not_its_name(tree, site, tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    tree["evaluation"] = {"validation_prompts": str(prompts)}
    base = keys(tree, site, tmp_path)
    prompts.write_text("a blue square\n")
    assert changed(base, keys(tree, site, tmp_path)) == ["precompute", "train", "export", "report"]


def test_another_package_changes_every_key(tree, site, tmp_path) -> None:
    base = keys(tree, site, tmp_path)
    assert changed(base, keys(tree, dataclasses.replace(site, package_hash="fedcba987654"), tmp_path)) == list(base)


def test_a_bench_joins_the_report_and_not_the_model(tree, site, tmp_path) -> None:
    base = keys(tree, site, tmp_path)
    tree["evaluation"] = {"bench": {"steps": 5, "warmup": 1}}
    with_bench = keys(tree, site, tmp_path)
    assert changed(base, {k: with_bench[k] for k in base}) == ["report"]
    path = tmp_path / "recipe.yaml"
    recipe, loaded = load_recipe(path)
    plan = build_plan(recipe, path, loaded, site)
    assert plan.stage("bench").after == ("precompute",) and plan.stage("report").after == ("export", "bench")


def test_stage_directories_are_named_by_key_so_recipes_share_identical_stages(tree, site, tmp_path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    recipe, loaded = load_recipe(path)
    plan = build_plan(recipe, path, loaded, site)
    for stage in plan.stages:
        assert stage.job_name == f"sana-{stage.name}-{stage.key[:12]}"
        assert stage.dir == site.checkpoint_root / "researcher" / stage.job_name
        assert f"--job-name={stage.job_name}" in stage.options and "--kill-on-invalid-dep=yes" in stage.options
    train = plan.stage("train")
    assert f"data.path={plan.stage('precompute').outputs['features']}" in train.args
    assert plan.stage("export").args[0] == str(train.dir)
