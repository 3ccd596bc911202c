"""A recipe -> the chain of stages: each stage's key, directory, job script, arguments and
upstream stages. Nothing is submitted here (training/pipeline/submit.py does that).

    precompute -> train -> export -> report        (+ precompute -> bench -> report)

Every stage goes through the package's own job scripts (training/slurm/*.sbatch, and with
them launch.sh), so a stage runs exactly what a researcher's ``sbatch`` of the same script
runs. A stage's directory is ``$SANA_CHECKPOINT_ROOT/<user>/sana-<stage>-<key12>``: the
launcher's run directory for that job name, which is how a failed train stage resumes from
its own checkpoints when it is submitted again. The recipe's name is not part of it: two
recipes with the same precompute section (a GPU and a Trainium run of one experiment) use
one feature directory, and their lineages show the same feature index hash.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from training.errors import UserError
from training.pipeline.keys import SHORT, sha256_file, stage_key
from training.pipeline.recipe import Recipe, hashed_fields
from training.pipeline.site import Site

STAGE_FILE = "stage.json"
#: stage job names (and so directories) are sana-<stage>-<key12>: content, not recipe, names a
#: stage, so recipes that share a stage (two backends on one feature set) share its output
JOB_PREFIX = "sana-"
RUN_FILE = "run.json"
#: sbatch script of each stage (training/slurm/)
SCRIPTS = {"precompute": "precompute.sbatch", "bench": "bench.sbatch", "export": "export.sbatch",
           "report": "report.sbatch"}
TRAIN_SCRIPTS = {"gpu": "train-gpu.sbatch", "trainium": "train-trainium.sbatch"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One job of the chain."""

    name: str
    key: str
    job_name: str
    dir: Path
    script: Path
    #: arguments after the script (they reach the entrypoint through launch.sh)
    args: tuple[str, ...]
    #: sbatch options besides the dependency (job name, output, partition, nodes, time, ...)
    options: tuple[str, ...]
    #: stages whose jobs must succeed first (sbatch --dependency=afterok)
    after: tuple[str, ...]
    #: named output paths the stage promises (what run.json records and `status` lists)
    outputs: dict[str, str]
    #: what was hashed besides the upstream keys and the package (run.json records it)
    section: dict[str, Any]
    #: extra environment of the job (sbatch passes the submitting environment on)
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def stage_file(self) -> Path:
        return self.dir / STAGE_FILE

    @property
    def run_file(self) -> Path:
        return self.dir / RUN_FILE

    @property
    def main_output(self) -> str:
        return next(iter(self.outputs.values()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    recipe: Recipe
    recipe_path: Path
    recipe_sha256: str
    recipe_tree: dict[str, Any]
    site: Site
    stages: tuple[Stage, ...]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def set_arg(key: str, value: Any) -> str:
    """``--set key=value`` with the value written as YAML (what training/config.py parses)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=2**20).strip()
    return f"{key}={text.removesuffix('...').strip()}"


def config_path(recipe: Recipe, site: Site) -> Path:
    """train.config: absolute, or a path in the package the chain runs."""
    path = Path(recipe.train.config)
    path = path if path.is_absolute() else site.package_root / path
    if not path.is_file():
        raise UserError(f"train.config: {path} does not exist; use a config of the package "
                        "(training/configs/*.yaml) or an absolute path")
    return path


def resolve_train_config(recipe: Recipe, config: Path, *, data_path: str, output_dir: str) -> dict[str, Any]:
    """The training config the train job will build (the same parse: training/config.py
    load_config with the arguments launch.sh and the pipeline pass), validated now, so a bad
    override is one line at submit rather than a failed job hours later."""
    from training.config import load_config

    argv = ["--config", str(config), *sum((["--set", set_arg(k, v)] for k, v in recipe.train.overrides.items()), []),
            "--set", f"data.path={data_path}", "--resume", "auto", "--output-dir", output_dir]
    try:
        cfg = load_config(argv)
    except UserError as exc:
        raise UserError(f"train.overrides / train.config ({config.name}): {exc}") from None
    if not cfg.checkpoint.enabled:
        raise UserError("train.overrides checkpoint.enabled: must stay on; the export stage exports the final checkpoint")
    return cfg.to_dict()


def _file_digest(path: str | None, key: str) -> str | None:
    """sha256 of a small input file the recipe names (its content decides the stage)."""
    if path is None or not path.startswith("/"):
        return None
    try:
        return sha256_file(path)
    except OSError as exc:
        raise UserError(f"{key}: cannot read {path} ({exc.strerror})") from None


def _resources(section: Any, default_partition: str, recipe: Recipe, nodes: int | None) -> list[str]:
    options = [f"--partition={section.partition or default_partition}"]
    if nodes is not None:
        options.append(f"--nodes={nodes}")
    if section.time:
        options.append(f"--time={section.time}")
    return options + list(recipe.sbatch_options) + list(section.sbatch_options)


def build_plan(recipe: Recipe, recipe_path: Path, tree: dict[str, Any], site: Site) -> Plan:
    """Every stage of ``recipe`` with its key, in submission order."""
    stages: dict[str, Stage] = {}

    def add(name: str, *, section: dict[str, Any], after: tuple[str, ...], script: Path, args_for,
            options: list[str], outputs_for, env: dict[str, str] | None = None) -> Stage:
        """One stage: it reads the outputs of ``after`` (their keys enter its own) and waits on their jobs."""
        key = stage_key(name, section, {u: stages[u].key for u in after}, site.package_hash)
        job_name = f"{JOB_PREFIX}{name}-{key[:SHORT]}"
        directory = site.stage_dir(job_name)
        outputs = outputs_for(directory)
        common = [f"--job-name={job_name}", f"--output={site.log_root}/%u/%x-%j.out", "--kill-on-invalid-dep=yes"]
        stage = Stage(name=name, key=key, job_name=job_name, dir=directory, script=script,
                      args=tuple(args_for(directory, outputs)), options=tuple(common + options), after=after,
                      outputs=outputs, section=section, env=dict(env or {}))
        stages[name] = stage
        return stage

    pre = recipe.precompute
    pre_section = {k: v for k, v in hashed_fields(pre).items() if k != "nodes"}
    pre_section.update(raw=recipe.source.raw, validation_prompts=recipe.evaluation.validation_prompts,
                       validation_prompts_sha256=_file_digest(recipe.evaluation.validation_prompts,
                                                              "evaluation.validation_prompts"),
                       chi_sha256=_file_digest(pre.chi, "precompute.chi"))

    def precompute_args(_: Path, out: dict[str, str]) -> list[str]:
        args = ["--input", recipe.source.raw, "--out", out["features"], "--vae", pre.vae,
                "--text-encoder", pre.text_encoder, "--tokenizer", pre.tokenizer or pre.text_encoder,
                "--buckets", pre.buckets, "--max-upscale", str(pre.max_upscale),
                "--max-text-tokens", str(pre.max_text_tokens), "--chi", pre.chi, "--batch-size", str(pre.batch_size),
                "--samples-per-shard", str(pre.samples_per_shard)]
        if pre.resolution is not None:
            args += ["--resolution", str(pre.resolution)]
        if recipe.evaluation.validation_prompts is not None:
            args += ["--validation-prompts", recipe.evaluation.validation_prompts]
        return args

    precompute = add("precompute", section=pre_section, after=(), script=site.slurm_dir / SCRIPTS["precompute"],
                     args_for=precompute_args, options=_resources(pre, "gpu", recipe, pre.nodes),
                     outputs_for=lambda d: {"features": str(d / "features")})
    features = precompute.outputs["features"]

    train = recipe.train
    config = config_path(recipe, site)
    # Resolved with placeholders for the two paths the chain decides: the key must not depend
    # on a directory named after the key itself.
    resolved = resolve_train_config(recipe, config, data_path="<precompute features>", output_dir="<train stage>")
    resolved.pop("output_dir")
    resolved["data"].pop("path")
    overrides = [x for k, v in train.overrides.items() for x in ("--set", set_arg(k, v))]
    train_section = {"backend": train.backend, "nodes": train.nodes, "config": resolved}
    add("train", section=train_section, after=("precompute",),
        script=site.slurm_dir / TRAIN_SCRIPTS[train.backend],
        args_for=lambda d, out: [str(config), "--set", f"data.path={features}", *overrides],
        options=_resources(train, train.default_partition, recipe, train.nodes),
        outputs_for=lambda d: {"run_dir": str(d)})

    bench = recipe.evaluation.bench
    if bench is not None:
        bench_section = {**hashed_fields(bench), "backend": train.backend, "config": resolved}
        add("bench", section=bench_section, after=("precompute",),
            script=site.slurm_dir / SCRIPTS["bench"],
            args_for=lambda d, out: [str(config), "--set", f"data.path={features}", *overrides,
                                     "--steps", str(bench.steps), "--warmup", str(bench.warmup),
                                     "--out", out["bench"]],
            options=_resources(bench, train.default_partition, recipe, bench.nodes)
            + (["--gres=none"] if train.backend == "trainium" else []),
            outputs_for=lambda d: {"bench": str(d / "bench.json")},
            # bench.sbatch picks its backend by partition name (trn); the recipe's backend wins
            env={"SANA_BENCH_BACKEND": train.backend})

    export = recipe.export
    add("export", section=hashed_fields(export), after=("train",),
        script=site.slurm_dir / SCRIPTS["export"],
        args_for=lambda d, out: [str(stages["train"].dir), "--out", out["model"], "--overwrite", "--dtype", export.dtype,
                                 *(["--ema"] if export.ema else []), *(["--lora-merge"] if export.lora_merge else [])],
        options=_resources(export, "gpu", recipe, 1), outputs_for=lambda d: {"model": str(d / "model")})

    report = recipe.report
    reads = ("export", "bench") if bench is not None else ("export",)
    add("report", section=hashed_fields(report), after=reads, script=site.slurm_dir / SCRIPTS["report"],
        args_for=lambda d, out: ["--stage", str(d / STAGE_FILE)],
        options=_resources(report, "gpu", recipe, 1), outputs_for=lambda d: {"report": str(d / "report")})

    return Plan(recipe=recipe, recipe_path=recipe_path.resolve(), recipe_sha256=sha256_file(recipe_path),
                recipe_tree=tree, site=site, stages=tuple(stages.values()))
