"""The bench result: one JSON file per ``python -m training.bench`` run, read by ``training.report``.

The schema is this dataclass: every field has a comment saying what it holds and in which
unit. ``BenchResult.load`` validates a file completely (types, ranges, and the identities
between fields, e.g. total samples/s = per-accelerator x world size) and turns the first
problem into one line naming the file and the field, because these files travel between
clusters and people and a hand-edited or truncated one must not turn into a wrong report.

Units: seconds, samples (one image/caption pair), bytes; throughput in samples/s; FLOPs as
plain floats; MFU as a fraction in [0, 1].
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

from training.errors import UserError

SCHEMA = "sana-bench/1"
#: device kinds; the CPU ones are labelled "CPU figures, not accelerator figures" in reports
DEVICE_KINDS = ("cuda", "neuron", "cpu", "xla-cpu")
CPU_KINDS = ("cpu", "xla-cpu")
#: fields that must agree before two results may be compared (report --allow-mismatch overrides)
COMPARABLE_FIELDS = ("model_preset", "model_overrides", "resolution_px", "text_tokens", "precision")


@dataclasses.dataclass(kw_only=True)
class BenchResult:
    """One benchmark run of the shared training loop on one backend and cluster shape."""

    schema: str = SCHEMA  # format tag, "sana-bench/1"
    # --- what ran where ------------------------------------------------------------------
    backend: str  # "gpu" | "trainium"
    device_kind: str  # "cuda" | "neuron" | "cpu" | "xla-cpu" (one of DEVICE_KINDS)
    instance_type: str  # SageMaker instance type ("ml.p5.48xlarge"), or "local" off-cluster
    accelerator: str  # device one rank drives: a training.model.flops.PEAK_TFLOPS key, else its name ("cpu")
    accelerators_per_node: int  # ranks per instance (GPUs, or NeuronCores a rank drives)
    nodes: int  # instances
    world_size: int  # ranks in total (= accelerators_per_node x nodes)
    # --- what was trained --------------------------------------------------------------------
    model_preset: str  # training.model.build.PRESETS key
    model_overrides: dict[str, Any]  # ModelConfig.overrides on top of the preset ({} = the preset)
    resolution_px: int  # nominal image side: latent side x 32 (DC-AE f32 latents)
    latent_hw: list[int]  # latent [H, W] the model saw
    text_tokens: int  # padded caption length (max_text_tokens)
    precision: str  # "fp32" | "bf16-mixed" | "bf16"
    per_device_batch: int  # samples per rank per micro-batch
    grad_accum_steps: int  # micro-batches per optimizer step
    global_batch: int  # samples per optimizer step, all ranks (= per_device x world x accum)
    data: str  # "synthetic" or the feature directory the run read
    bytes_per_sample: float | None  # stored bytes per sample of those features (index.json)
    # --- timing --------------------------------------------------------------------------------
    warmup_steps: int  # optimizer steps run first and excluded (compilation, allocator warm-up)
    steps_timed: int  # optimizer steps in the timed window
    timed_seconds: float  # wall seconds of the timed window, device-synchronised at both ends
    step_time_p50_s: float  # median host step time in the timed window
    step_time_p90_s: float  # 90th percentile host step time in the timed window
    step_time_mean_s: float  # timed_seconds / steps_timed
    samples_per_s_total: float  # global_batch x steps_timed / timed_seconds
    samples_per_s_per_accelerator: float  # samples_per_s_total / world_size
    samples_per_s_per_instance: float  # samples_per_s_total / nodes
    # --- efficiency ----------------------------------------------------------------------------
    train_flops_per_sample: float  # training.model.flops.train_flops_per_sample (fwd + bwd = 3x fwd)
    peak_tflops_per_accelerator: float | None  # dense peak for this precision (None: no published peak)
    peak_source: str | None  # where that peak comes from (datasheet / AWS doc URL)
    mfu: float | None  # achieved FLOP/s per accelerator / peak, in [0, 1], counting real caption tokens only
    # (issue 17: train_flops_per_sample counts real tokens; files before it counted the padded length)
    mfu_padded: float | None = None  # the same with every caption token the step computed (trimmed/padded)
    train_flops_per_sample_computed: float | None = None  # FLOPs per sample at the caption length computed
    text_tokens_real: float | None = None  # mean real caption tokens per sample in the timed window
    text_tokens_computed: float | None = None  # mean caption length the steps ran on (text_tokens untrimmed)
    memory_estimate: dict[str, Any] | None = None  # training/perf/memory.py estimate per rank (GiB by component)
    # --compare-reference: the diffusers-style step (training/perf/reference_step.py) timed in the same run,
    # interleaved with ours: {samples_per_s_total, samples_per_s_per_accelerator, mfu, ratio (ours / it),
    # repetitions, steps_per_repetition, seconds_ours, seconds_reference, final_loss, description}
    reference: dict[str, Any] | None = None
    peak_memory_bytes: int | None  # peak accelerator memory of rank 0 (None where not reported)
    compile_count: int | None  # graphs compiled in the whole run: XLA graphs (Trainium), dynamo graphs
    # (GPU with gpu.compile; training/model/compile.py compile_stats); None where nothing compiles (GPU eager)
    compile_seconds: float | None  # seconds spent compiling (same sources)
    compiles_in_timed_steps: int | None  # compilations inside the timed window (must be 0: a recompile)
    final_loss: float | None  # last logged loss (sanity: finite)
    graph_breaks: int | None = None  # dynamo graph breaks in the whole run (GPU gpu.compile; must be 0)
    graph_break_reasons: list[str] | None = None  # the first line of the most frequent break reasons
    recompile_reasons: list[str] | None = None  # guard failures that made dynamo compile a frame again
    caption_lengths: str | None = None  # where the captions' real lengths came from (synthetic features)
    # --- provenance ---------------------------------------------------------------------------
    versions: dict[str, str]  # python, torch, torch_xla / cuda / diffusers ... as strings
    timestamp: str  # ISO-8601 UTC time the run finished
    command: str  # the command line that produced this file
    notes: str = ""  # free text (e.g. "CPU figures from make demo")

    def __post_init__(self) -> None:
        _check_types(self)
        if self.schema != SCHEMA:
            raise ValueError(f"schema: {self.schema!r} is not {SCHEMA!r}")
        if self.backend not in ("gpu", "trainium"):
            raise ValueError(f"backend: {self.backend!r} is not 'gpu' or 'trainium'")
        if self.device_kind not in DEVICE_KINDS:
            raise ValueError(f"device_kind: {self.device_kind!r} is not one of {list(DEVICE_KINDS)}")
        if self.precision not in ("fp32", "bf16-mixed", "bf16"):
            raise ValueError(f"precision: {self.precision!r} is not fp32, bf16-mixed or bf16")
        for name in ("accelerators_per_node", "nodes", "world_size", "resolution_px", "text_tokens",
                     "per_device_batch", "grad_accum_steps", "global_batch", "steps_timed"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("timed_seconds", "step_time_p50_s", "step_time_p90_s", "step_time_mean_s",
                     "samples_per_s_total", "samples_per_s_per_accelerator", "samples_per_s_per_instance",
                     "train_flops_per_sample"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        if len(self.latent_hw) != 2 or not all(isinstance(v, int) and v > 0 for v in self.latent_hw):
            raise ValueError(f"latent_hw: must be [H, W] of positive integers, got {self.latent_hw}")
        if self.world_size != self.accelerators_per_node * self.nodes:
            raise ValueError(f"world_size: {self.world_size} != accelerators_per_node "
                             f"{self.accelerators_per_node} x nodes {self.nodes}")
        if self.global_batch != self.per_device_batch * self.world_size * self.grad_accum_steps:
            raise ValueError(f"global_batch: {self.global_batch} != per_device_batch x world_size x "
                             f"grad_accum_steps ({self.per_device_batch} x {self.world_size} x "
                             f"{self.grad_accum_steps})")
        if self.step_time_p90_s < self.step_time_p50_s:
            raise ValueError("step_time_p90_s: smaller than step_time_p50_s")
        expected = {
            "samples_per_s_total": self.global_batch * self.steps_timed / self.timed_seconds,
            "samples_per_s_per_accelerator": self.samples_per_s_total / self.world_size,
            "samples_per_s_per_instance": self.samples_per_s_total / self.nodes,
            "step_time_mean_s": self.timed_seconds / self.steps_timed,
        }
        for name, value in expected.items():
            if not math.isclose(getattr(self, name), value, rel_tol=1e-6):
                raise ValueError(f"{name}: {getattr(self, name)} disagrees with the other fields ({value:.6g})")
        if self.mfu is not None and not 0 <= self.mfu <= 1:
            raise ValueError(f"mfu: must be a fraction in [0, 1], got {self.mfu}")
        if (self.mfu is None) != (self.peak_tflops_per_accelerator is None):
            raise ValueError("mfu: given without peak_tflops_per_accelerator, or the reverse")
        if self.mfu_padded is not None and not 0 <= self.mfu_padded <= 1:
            raise ValueError(f"mfu_padded: must be a fraction in [0, 1], got {self.mfu_padded}")
        if self.mfu_padded is not None and self.mfu is not None and self.mfu_padded < self.mfu * (1 - 1e-9):
            raise ValueError("mfu_padded: smaller than mfu (padded tokens only add FLOPs)")
        for name in ("text_tokens_real", "text_tokens_computed"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= self.text_tokens:
                raise ValueError(f"{name}: must be in (0, text_tokens={self.text_tokens}], got {value}")
        if self.reference is not None:
            ref = self.reference
            sps = ref.get("samples_per_s_total")
            if not isinstance(sps, int | float) or not sps > 0:
                raise ValueError(f"reference: samples_per_s_total must be a number > 0, got {sps!r}")
            if not math.isclose(float(ref.get("ratio", -1)), self.samples_per_s_total / sps, rel_tol=1e-6):
                raise ValueError("reference: ratio disagrees with samples_per_s_total / reference samples_per_s_total")
        for name in ("compile_count", "compiles_in_timed_steps", "graph_breaks"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if self.bytes_per_sample is not None and self.bytes_per_sample <= 0:
            raise ValueError(f"bytes_per_sample: must be > 0, got {self.bytes_per_sample}")

    # ----- derived ------------------------------------------------------------------------
    @property
    def is_cpu(self) -> bool:
        """True for local CPU runs (tests, ``make demo``): not accelerator figures."""
        return self.device_kind in CPU_KINDS

    @property
    def label(self) -> str:
        """Short name for tables and charts: backend, instance type, nodes."""
        where = self.instance_type if self.instance_type != "local" else f"local {self.device_kind}"
        return f"{self.backend} {where} x{self.nodes}"

    # ----- I/O ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_dict(cls, data: Any) -> BenchResult:
        """Validate a parsed JSON object; ValueError("<field>: <problem>") on the first problem."""
        if not isinstance(data, dict):
            raise ValueError(f"<top level>: expected a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field (schema {SCHEMA} has {', '.join(fields)})")
        missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{missing[0]}: missing")
        try:
            return cls(**data)
        except TypeError as exc:  # pragma: no cover - fields are checked above
            raise ValueError(str(exc)) from None

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        """Read and validate one result file; UserError "<file>: field <f>: <problem>; <fix>"."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise UserError(f"{path}: cannot read bench result ({exc.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); "
                            "re-run python -m training.bench to regenerate it") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise UserError(f"{path}: field {exc}; re-run python -m training.bench or fix the file") from None


def _check_types(obj: BenchResult) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _is_instance(value, hints[f.name]):
            raise ValueError(f"{f.name}: expected {_describe(hints[f.name])}, got {value!r}")


def _is_instance(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_is_instance(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict)
    if origin is list:
        return isinstance(value, list)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    names = {str: "a string", int: "an integer", float: "a number", bool: "true/false",
             dict: "an object", list: "a list"}
    return names.get(origin or hint, str(hint))
