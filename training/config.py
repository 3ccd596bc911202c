"""TrainConfig: one YAML file + ``--set a.b=c`` overrides -> typed, validated sections.

Each component owns its section's dataclass (CONTRIBUTING.md, 5); this module only composes
them and turns every mistake into one line naming the key::

    error: config key optim.lr: must be > 0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from training.backends.gpu import PRECISIONS, GpuConfig
from training.backends.neuron_config import NeuronConfig
from training.checkpoint.config import CheckpointConfig
from training.data.loader import DataConfig
from training.data.text_trim import TextTrimConfig
from training.errors import UserError
from training.evaluation.validation import ValidationConfig
from training.model.build import ModelConfig
from training.model.lora import LoraConfig
from training.objective import ObjectiveConfig
from training.observability.config import PrometheusConfig, TrackingConfig
from training.optim.ema import EmaConfig
from training.optim.factory import OptimConfig


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """A whole training run. Sections are passed to their component, never the whole."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    #: LoRA adapters on the (pretrained) transformer; rank 0 = full fine-tuning (training/model/lora.py)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    ema: EmaConfig = dataclasses.field(default_factory=EmaConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    gpu: GpuConfig = dataclasses.field(default_factory=GpuConfig)
    trainium: NeuronConfig = dataclasses.field(default_factory=NeuronConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    text_trim: TextTrimConfig = dataclasses.field(default_factory=TextTrimConfig)
    #: rank 0's metrics served for the cluster's Prometheus collector (training/observability)
    prometheus: PrometheusConfig = dataclasses.field(default_factory=PrometheusConfig)
    #: experiment tracking: backend none | mlflow (training/observability/tracking.py)
    tracking: TrackingConfig = dataclasses.field(default_factory=TrackingConfig)
    #: "fp32" | "bf16-mixed" (fp32 master weights, bf16 compute) | "bf16" (pure bf16)
    precision: str = "bf16-mixed"
    #: optimizer steps to train to (a resumed run continues up to this count)
    max_steps: int = 1000
    #: model init and the objective's noise (same on every rank by design: objective.py)
    seed: int = 0
    #: run directory: metrics.jsonl, tensorboard/, checkpoints/ (unless checkpoint.dir is absolute)
    output_dir: str = "runs/default"
    #: log loss / grad norm / throughput / MFU every N optimizer steps (one host sync each)
    log_every: int = 10
    #: also write TensorBoard event files under <output_dir>/tensorboard (rank 0)
    tensorboard: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: {self.precision!r} is not one of {list(PRECISIONS)}")
        if self.max_steps < 1:
            raise ValueError("max_steps: must be >= 1")
        if self.log_every < 1:
            raise ValueError("log_every: must be >= 1")
        if not self.output_dir:
            raise ValueError("output_dir: must not be empty")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----- building typed sections from plain dicts -------------------------------------------
def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Cheap checks for scalar fields (YAML gives ints for floats, lists for tuples)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return value
        scalar = [a for a in args if a is not type(None)]
        return _check_type(key, value, scalar[0]) if len(scalar) == 1 else value
    if hint is bool and not isinstance(value, bool):
        raise UserError(f"config key {key}: expected true/false, got {value!r}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise UserError(f"config key {key}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "2e-4" (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"config key {key}: expected a number, got {value!r}")
        return float(value)
    if hint is str and isinstance(value, bool):
        # YAML 1.1 (PyYAML) reads on/off/yes/no as booleans: `gpu.memory_check: on` arrives as
        # True. The string settings that take on/off mean exactly that; any other field's own
        # validation then names its allowed values.
        return "on" if value else "off"
    if hint is str and not isinstance(value, str):
        raise UserError(f"config key {key}: expected a string, got {value!r}")
    return value


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise UserError(f"config key {prefix.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise UserError(f"config key {key}: unknown; {prefix.rstrip('.') or 'the top level'} "
                            f"takes {', '.join(sorted(fields))}")
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key + ".")
        else:
            kwargs[name] = _check_type(key, value, hint)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        # Section validators name their key ("optim.lr: ..."); keep one line and the key.
        if prefix and not msg.startswith(prefix.rstrip(".").split(".")[-1]):
            msg = f"{prefix.rstrip('.')}: {msg}"
        raise UserError(f"config key {msg}") from None


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def config_from_dict(tree: dict[str, Any]) -> TrainConfig:
    """Validate a plain nested dict (YAML contents after overrides)."""
    return _build(TrainConfig, tree)


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise UserError(f"--config {path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise UserError(f"--config {path}: must hold a mapping of sections")
    return tree


def parser(prog: str = "python -m training.gpu") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Train Sana on precomputed features.")
    p.add_argument("--config", required=True, help="YAML file (training/configs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set optim.lr=2e-4 (value parsed as YAML); repeatable")
    p.add_argument("--resume", help="'auto' (newest complete checkpoint), 'none', or a checkpoint path/URL")
    p.add_argument("--max-steps", type=int, help="optimizer steps to train to")
    p.add_argument("--output-dir", help="run directory (metrics, TensorBoard, checkpoints)")
    return p


def load_config(argv: Sequence[str] | None = None, prog: str = "python -m training.gpu") -> TrainConfig:
    """Parse the CLI of a training entrypoint into a validated TrainConfig."""
    args = parser(prog).parse_args(argv)
    tree = load_yaml(args.config)
    for item in args.overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set {item}: expected KEY=VALUE, e.g. optim.lr=2e-4")
        _set(tree, key.strip(), yaml.safe_load(raw))
    if args.resume is not None:
        _set(tree, "checkpoint.resume", args.resume)
    if args.max_steps is not None:
        _set(tree, "max_steps", args.max_steps)
    if args.output_dir is not None:
        _set(tree, "output_dir", args.output_dir)
    return config_from_dict(tree)
