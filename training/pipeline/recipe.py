"""The recipe: one YAML file per experiment, from raw images to an exported model.

Every key of a stage section either changes what the stage produces (it goes into the stage's
content hash, training/pipeline/keys.py) or only where and how long the job runs
(``RESOURCE_FIELDS``: partition, time, sbatch_options; changing them never re-runs a stage).
Loading collects every mistake, one line each naming the key::

    error: my.yaml: train.nodes: must be >= 1, got 0
    error: my.yaml: export.dtype: 'fp8' is not one of bf16, fp16, fp32

The shipped recipes (training/pipeline/recipes/*.yaml) are the templates; runbooks/pipelines.md
explains each key.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from training.errors import UserError

#: a recipe's name: part of every job name and output directory
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
#: sbatch --time forms (sbatch(1) -t): minutes, m:s, h:m:s, d-h, d-h:m, d-h:m:s, or UNLIMITED
TIME_RE = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2}|UNLIMITED)$")
PARTITION_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
#: fields that only say where and how long a job runs: not part of any stage's content hash
RESOURCE_FIELDS = ("partition", "time", "sbatch_options")
#: sbatch options the pipeline sets itself (sbatch(1) long and short names)
RESERVED_OPTIONS = {"--job-name": "-J", "--output": "-o", "--error": "-e", "--dependency": "-d",
                    "--partition": "-p", "--nodes": "-N", "--time": "-t", "--kill-on-invalid-dep": None,
                    "--parsable": None, "--export": None, "--wrap": None, "--chdir": "-D"}
BACKENDS = ("gpu", "trainium")
EXPORT_DTYPES = ("bf16", "fp16", "fp32")
#: training config keys the pipeline sets from the chain itself
MANAGED_KEYS = {"data.path": "the precompute stage's features", "output_dir": "the train stage's directory",
                "checkpoint.resume": "auto, so a failed train stage goes on from its last checkpoint",
                "checkpoint.enabled": "on: the export stage exports the final checkpoint",
                "checkpoint.dir": "checkpoints/ in the train stage's directory, where the export reads them"}


def _uri(value: str | None) -> str | None:
    """None when ``value`` is an absolute path or an s3:// URI (what every node reads alike)."""
    if value is None or value.startswith("s3://") or value.startswith("/"):
        return None
    return f"{value!r} is relative; give an absolute path (/fsx/...) or an s3:// URI, the same on every node"


def _problems(*checks: tuple[bool, str]) -> list[str]:
    return [message for failed, message in checks if failed]


def _raise(problems: list[str]) -> None:
    if problems:
        raise ValueError("\n".join(problems))


@dataclasses.dataclass(kw_only=True)
class Resources:
    """Where and how long a stage's job runs (never hashed)."""

    #: Slurm partition; None: the stage's default (train: gpu or trn by backend; others: gpu)
    partition: str | None = None
    #: sbatch --time, e.g. "12:00:00" or "2-00:00:00"; None: the partition's limit
    time: str | None = None
    #: more sbatch options for this stage, e.g. ["--gres=gpu:4"] (the top-level list goes to every stage)
    sbatch_options: list[str] = dataclasses.field(default_factory=list)

    def resource_problems(self) -> list[str]:
        return _problems(
            (self.partition is not None and not PARTITION_RE.match(self.partition),
             f"partition: {self.partition!r} is not a Slurm partition name"),
            (self.time is not None and not TIME_RE.match(self.time),
             f"time: {self.time!r} is not an sbatch --time (minutes, HH:MM:SS or D-HH:MM:SS)"),
        ) + [f"sbatch_options: {p}" for p in option_problems(self.sbatch_options)]


def option_problems(options: list[str]) -> list[str]:
    """Why each of ``options`` cannot be passed to sbatch by a recipe ([] when all can)."""
    problems = []
    for option in options:
        name = option.split("=", 1)[0]
        if not option.startswith("-"):
            problems.append(f"{option!r} is not an option (e.g. --account=NAME)")
        elif name in RESERVED_OPTIONS or name in {s for s in RESERVED_OPTIONS.values() if s}:
            problems.append(f"{name} is set by the pipeline for every stage; remove it")
    return problems


@dataclasses.dataclass(kw_only=True)
class SourceSection:
    """The raw data: image + caption pairs (training/data/precompute.py lists the layouts)."""

    #: a folder of images with .txt captions, WebDataset .tar files, or an s3:// prefix
    raw: str

    def __post_init__(self) -> None:
        _raise(_problems((bool(_uri(self.raw)), f"raw: {_uri(self.raw)}")))


@dataclasses.dataclass(kw_only=True)
class PrecomputeSection(Resources):
    """``python -m training.precompute`` settings (one field per flag; see its --help)."""

    vae: str
    text_encoder: str
    #: default: the text encoder's directory
    tokenizer: str | None = None
    resolution: int | None = None
    buckets: str = "square"
    max_upscale: float = 2.0
    max_text_tokens: int = 300
    #: sana | diffusers | none | an absolute path to a file (one line each)
    chi: str = "sana"
    samples_per_shard: int = 1000
    batch_size: int = 16
    #: ranks split the shards: the features do not depend on it (not hashed)
    nodes: int = 1

    def __post_init__(self) -> None:
        from training.data.buckets import SQUARE_MODE, TABLES
        from training.data.text_features import CHI_CHOICES

        problems = [f"{name}: {why}" for name in ("vae", "text_encoder", "tokenizer")
                    if (why := _uri(getattr(self, name)))]
        problems += _problems(
            (self.buckets not in (SQUARE_MODE, *TABLES),
             f"buckets: {self.buckets!r} is not one of {', '.join((SQUARE_MODE, *TABLES))}"),
            (self.resolution is not None and (self.resolution < 32 or self.resolution % 32 != 0),
             f"resolution: {self.resolution} is not a multiple of 32 (>= 32)"),
            (self.max_upscale < 1.0, f"max_upscale: must be >= 1, got {self.max_upscale}"),
            (self.max_text_tokens < 1, f"max_text_tokens: must be >= 1, got {self.max_text_tokens}"),
            (self.chi not in CHI_CHOICES and not self.chi.startswith("/"),
             f"chi: {self.chi!r} is not one of {', '.join(CHI_CHOICES)} or an absolute path to a file"),
            (self.samples_per_shard < 1, f"samples_per_shard: must be >= 1, got {self.samples_per_shard}"),
            (self.batch_size < 1, f"batch_size: must be >= 1, got {self.batch_size}"),
            (self.nodes < 1, f"nodes: must be >= 1, got {self.nodes}"),
        )
        _raise(problems + self.resource_problems())


@dataclasses.dataclass(kw_only=True)
class TrainSection(Resources):
    """The training job: a config of the package plus overrides, on one backend."""

    #: training YAML: a path in the package (training/configs/...) or an absolute path
    config: str
    #: --set overrides as a mapping of dotted keys, e.g. {"optim.lr": 2.0e-5, "max_steps": 5000}
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: gpu (train-gpu.sbatch) or trainium (train-trainium.sbatch)
    backend: str = "gpu"
    #: nodes of the training job (the world size: part of the result, so hashed)
    nodes: int = 1

    def __post_init__(self) -> None:
        problems = _problems(
            (self.backend not in BACKENDS, f"backend: {self.backend!r} is not one of {', '.join(BACKENDS)}"),
            (self.nodes < 1, f"nodes: must be >= 1, got {self.nodes}"),
            (not self.config.endswith((".yaml", ".yml")), f"config: {self.config!r} is not a YAML file"),
        )
        for key in self.overrides:
            if not isinstance(key, str) or not re.match(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$", key):
                problems.append(f"overrides: {key!r} is not a dotted config key such as optim.lr")
            elif key in MANAGED_KEYS:
                problems.append(f"overrides.{key}: set by the pipeline ({MANAGED_KEYS[key]}); remove it")
        _raise(problems + self.resource_problems())

    @property
    def default_partition(self) -> str:
        return "trn" if self.backend == "trainium" else "gpu"


@dataclasses.dataclass(kw_only=True)
class BenchSection(Resources):
    """A throughput/MFU bench of the training config on the precomputed features
    (``python -m training.bench``); its result feeds the report's cost section."""

    steps: int = 20
    warmup: int = 5
    nodes: int = 1

    def __post_init__(self) -> None:
        _raise(_problems(
            (self.steps < 1, f"steps: must be >= 1, got {self.steps}"),
            (self.warmup < 0, f"warmup: must be >= 0, got {self.warmup}"),
            (self.nodes < 1, f"nodes: must be >= 1, got {self.nodes}"),
        ) + self.resource_problems())


@dataclasses.dataclass(kw_only=True)
class EvaluationSection:
    """What the run is judged by: the validation prompts (encoded by precompute, rendered by
    training when ``validation.every_steps`` is set in train.overrides) and an optional bench."""

    #: absolute path to a file of prompts (one a line), "none", or None for the built-in list
    validation_prompts: str | None = None
    bench: BenchSection | None = None

    def __post_init__(self) -> None:
        prompts = self.validation_prompts
        _raise(_problems((prompts is not None and prompts != "none" and not prompts.startswith("/"),
                          f"validation_prompts: {prompts!r} is not an absolute path to a file or none")))


@dataclasses.dataclass(kw_only=True)
class ExportSection(Resources):
    """``python -m training.export`` of the final checkpoint."""

    ema: bool = False
    dtype: str = "fp32"
    #: LoRA runs: also write <model>/transformer with the adapter merged in
    lora_merge: bool = False

    def __post_init__(self) -> None:
        _raise(_problems((self.dtype not in EXPORT_DTYPES,
                          f"dtype: {self.dtype!r} is not one of {', '.join(EXPORT_DTYPES)}"))
               + self.resource_problems())


@dataclasses.dataclass(kw_only=True)
class ReportSection(Resources):
    """The report stage (training/pipeline/report.py)."""

    #: epochs of the features the cost section prices (with a bench)
    epochs: float = 1.0

    def __post_init__(self) -> None:
        _raise(_problems((not self.epochs > 0, f"epochs: must be > 0, got {self.epochs}")) + self.resource_problems())


@dataclasses.dataclass(kw_only=True)
class Recipe:
    """One experiment: every stage's settings. Stages run precompute -> train -> export ->
    report (plus bench -> report when evaluation.bench is set)."""

    name: str
    source: SourceSection
    precompute: PrecomputeSection
    train: TrainSection
    evaluation: EvaluationSection = dataclasses.field(default_factory=EvaluationSection)
    export: ExportSection = dataclasses.field(default_factory=ExportSection)
    report: ReportSection = dataclasses.field(default_factory=ReportSection)
    #: sbatch options for every stage, e.g. ["--account=imaging"]
    sbatch_options: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        _raise(_problems((not NAME_RE.match(self.name),
                          f"name: {self.name!r} must be 1-40 of a-z, 0-9 and -, starting with a letter or digit"))
               + [f"sbatch_options: {p}" for p in option_problems(self.sbatch_options)])


class RecipeError(UserError):
    """A recipe with mistakes: one line per mistake, each naming its key."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.problems = [f"{path}: {p}" for p in problems]
        super().__init__("\n".join(self.problems))


# ----- building the dataclasses, collecting every mistake ----------------------------------
def _dataclass_in(hint: Any) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        found = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return found[0] if found else None
    return None


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(fits, value) for the scalar and container hints recipes use."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return True, None
        return _coerce(value, next(a for a in args if a is not type(None)))
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, str):  # PyYAML (YAML 1.1) reads 2e-4 without a dot as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return isinstance(value, int | float) and not isinstance(value, bool), float(value) if isinstance(
            value, int | float) else value
    if hint is str:
        return isinstance(value, str), value
    if origin is list:
        return isinstance(value, list) and all(isinstance(v, str) for v in value), value
    if origin is dict:
        return isinstance(value, dict), value
    return True, value


def _describe(hint: Any) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return f"{_describe(inner[0])} or null"
    if origin is list:
        return "a list of strings"
    if origin is dict:
        return "a mapping"
    return names.get(hint, str(hint))


def _build(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    """``cls`` from ``data``; every problem appended to ``problems`` as 'key: why'. None on any."""
    where = prefix.rstrip(".") or "the recipe"
    if not isinstance(data, dict):
        problems.append(f"{where}: expected a mapping of keys, got {data!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    own, nested_failed = len(problems), False
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            problems.append(f"{key}: unknown key; {where} takes {', '.join(sorted(fields))}")
            continue
        nested = _dataclass_in(hints[name])
        if nested is not None and value is not None:
            before = len(problems)
            kwargs[name] = _build(nested, value, f"{key}.", problems)
            nested_failed |= len(problems) > before
            own += len(problems) - before  # the section's own problems, not this level's
            continue
        fits, converted = _coerce(value, hints[name])
        if not fits:
            problems.append(f"{key}: expected {_describe(hints[name])}, got {value!r}")
        kwargs[name] = converted
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in data:
            problems.append(f"{prefix}{name}: required")
    if len(problems) > own:  # this level's keys are wrong: its validation cannot run on them
        return None
    try:
        # With a failed section (None in its place) this level's own checks still run, so
        # every mistake is reported at once; no validator here looks into a sub-section.
        built = cls(**kwargs)
    except ValueError as exc:
        problems.extend(f"{prefix}{line}" for line in str(exc).splitlines())
        return None
    return None if nested_failed else built


def recipe_from_dict(tree: Any, path: str | Path = "<recipe>") -> Recipe:
    """A validated Recipe, or RecipeError listing every problem (one line each)."""
    problems: list[str] = []
    recipe = _build(Recipe, tree, "", problems)
    if problems or recipe is None:
        raise RecipeError(path, problems or ["not a valid recipe"])
    return recipe


def load_recipe(path: str | Path) -> tuple[Recipe, dict[str, Any]]:
    """Read and validate a recipe file; returns the Recipe and the plain tree it came from."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the recipe ({exc.strerror})") from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    return recipe_from_dict(tree, path), tree


def hashed_fields(section: Any) -> dict[str, Any]:
    """A section's fields that decide what the stage produces (RESOURCE_FIELDS left out)."""
    return {k: v for k, v in dataclasses.asdict(section).items() if k not in RESOURCE_FIELDS}
