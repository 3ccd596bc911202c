"""What a served model offers (``serving.json``) and what a request may ask for.

``ServingSpec`` lives in the serving export (training/serve/export.py writes it) and travels
into ``model.tar.gz``: the image sizes the endpoint serves, the request limits, and the text
conditioning the transformer was trained with (Sana's complex human instruction and the
caption length N; training/data/text_features.py), which every request is encoded with. A request
body is decoded by ``decode_body`` (the handler's ``input_fn``: it has no model) and checked
against the model by ``validate_request`` (in ``predict_fn``); anything outside them is a
``RequestError`` (HTTP 400, one line).

Sizes are written ``HEIGHTxWIDTH`` (``1024x768`` = 1024 px high, 768 wide), as diffusers'
``SanaPipeline(height=, width=)`` takes them. Each side must be a multiple of 32: DC-AE
compresses 32x and Sana's patch size is 1, so the latent is side / 32 (NVlabs Sana
``ASPECT_RATIO_1024`` lists only multiples of 32; diffusers' ``SanaPipeline.check_inputs``
refuses sides that are not multiples of 32).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.serve.errors import RequestError

SPEC_FILE = "serving.json"
SPEC_FORMAT = 1
#: every image side must be a multiple of this (see the module docstring)
SIDE_MULTIPLE = 32
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")
#: request fields and their JSON types (anything else is refused: a typo must not be ignored)
REQUEST_FIELDS = ("prompt", "negative_prompt", "steps", "guidance_scale", "seed", "height", "width")
MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True, order=True)
class Size:
    """One served image size in pixels."""

    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.height}x{self.width}"

    def latent(self, vae_scale: int) -> tuple[int, int]:
        return self.height // vae_scale, self.width // vae_scale


def parse_size(text: str, *, flag: str) -> Size:
    """``"1024x768"`` -> Size(1024, 768); UserError naming ``flag`` for anything else."""
    match = _SIZE.match(str(text))
    if not match:
        raise UserError(f"{flag} {text!r}: give HEIGHTxWIDTH in pixels, e.g. 1024x1024")
    size = Size(int(match.group(1)), int(match.group(2)))
    for side in (size.height, size.width):
        if side <= 0 or side % SIDE_MULTIPLE:
            raise UserError(f"{flag} {size}: {side} is not a positive multiple of {SIDE_MULTIPLE} "
                            f"(DC-AE compresses {SIDE_MULTIPLE}x); use e.g. "
                            f"{_nearest(size.height)}x{_nearest(size.width)}")
    return size


def parse_sizes(text: str | Sequence[str], *, flag: str) -> tuple[Size, ...]:
    """``"1024x1024,512x768"`` (or a list of such) -> unique sizes in the order given (the
    first is a request's default)."""
    parts = text.split(",") if isinstance(text, str) else list(text)
    sizes = list(dict.fromkeys(parse_size(p, flag=flag) for p in parts if str(p).strip()))
    if not sizes:
        raise UserError(f"{flag}: give at least one HEIGHTxWIDTH, e.g. 1024x1024")
    return tuple(sizes)


def _nearest(side: int) -> int:
    return max(SIDE_MULTIPLE, SIDE_MULTIPLE * round(side / SIDE_MULTIPLE))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """Request limits: what keeps one request from taking the worker down or hogging it."""

    #: inference steps per image: 1..max_steps (a 1000-step request would hold the worker
    #: for minutes while every other request waits)
    max_steps: int = 50
    default_steps: int = 20
    #: classifier-free guidance scale (<= 1 turns guidance off, as in SanaPipeline); Sana: 4.5
    max_guidance_scale: float = 20.0
    default_guidance_scale: float = 4.5
    #: prompt / negative prompt length in characters (the tokenizer truncates at N tokens anyway)
    max_prompt_chars: int = 2000
    #: request body in bytes: a JSON prompt is well under 8 KiB; anything larger is refused
    #: before it is parsed (SageMaker real-time payloads go up to 6 MB; docs.aws.amazon.com/
    #: sagemaker/latest/dg/realtime-endpoints.html)
    max_body_bytes: int = 65536

    def __post_init__(self) -> None:
        if not 1 <= self.default_steps <= self.max_steps:
            raise ValueError(f"limits: default_steps {self.default_steps} must be in 1..max_steps ({self.max_steps})")
        if not 0 <= self.default_guidance_scale <= self.max_guidance_scale:
            raise ValueError("limits: default_guidance_scale must be in 0..max_guidance_scale")
        if self.max_prompt_chars < 1 or self.max_body_bytes < 256:
            raise ValueError("limits: max_prompt_chars >= 1 and max_body_bytes >= 256")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingSpec:
    """``serving.json``: what the endpoint serves and how prompts are encoded."""

    sizes: tuple[Size, ...]
    #: SanaPipeline's complex_human_instruction (None = the model was trained without CHI)
    complex_human_instruction: tuple[str, ...] | None
    #: N, SanaPipeline's max_sequence_length (the training captions' max_text_tokens)
    max_sequence_length: int
    #: flow-matching shift of the Euler sampler (the training objective's flow_shift)
    flow_shift: float = 3.0
    #: weights on an accelerator: "bf16" (Sana's inference precision) or "fp32"; CPU runs fp32
    dtype: str = "bf16"
    limits: Limits = dataclasses.field(default_factory=Limits)
    #: sha256 of the serving export's files (training/serve/export.py ``export_sha256``)
    source_sha256: str = ""

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("serving.json: sizes is empty")
        if self.max_sequence_length < 2:
            raise ValueError("serving.json: max_sequence_length must be >= 2")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"serving.json: dtype {self.dtype!r}; choose bf16 or fp32")
        if not self.flow_shift > 0:
            raise ValueError("serving.json: flow_shift must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return {"format": SPEC_FORMAT, "sizes": [str(s) for s in self.sizes],
                "complex_human_instruction": list(self.complex_human_instruction or []) or None,
                "max_sequence_length": self.max_sequence_length, "flow_shift": self.flow_shift,
                "dtype": self.dtype, "limits": dataclasses.asdict(self.limits),
                "source_sha256": self.source_sha256}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServingSpec:
        if data.get("format") != SPEC_FORMAT:
            raise ValueError(f"serving.json: format {data.get('format')!r}, this code reads format {SPEC_FORMAT}")
        chi = data.get("complex_human_instruction")
        return cls(sizes=parse_sizes(data["sizes"], flag="serving.json sizes"),
                   complex_human_instruction=tuple(chi) if chi else None,
                   max_sequence_length=int(data["max_sequence_length"]), flow_shift=float(data["flow_shift"]),
                   dtype=data.get("dtype", "bf16"), limits=Limits(**(data.get("limits") or {})),
                   source_sha256=data.get("source_sha256", ""))

    def write(self, directory: Path) -> Path:
        path = Path(directory) / SPEC_FILE
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def read(cls, directory: Path) -> ServingSpec:
        path = Path(directory) / SPEC_FILE
        return cls.from_dict(json.loads(path.read_text()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One validated request: everything ``SanaPipeline.__call__`` needs from the caller."""

    prompt: str
    negative_prompt: str
    steps: int
    guidance_scale: float
    seed: int
    size: Size


def _field_error(name: str, value: Any, allowed: str) -> RequestError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return RequestError(f"field {name}={shown}: {allowed}")


def _int(body: Mapping[str, Any], name: str, default: int | None, low: int, high: int) -> int:
    value = body.get(name, default)
    if value is None:
        raise _field_error(name, value, f"required, an integer from {low} to {high}")
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not value.is_integer()):
        raise _field_error(name, value, f"must be an integer from {low} to {high}")
    if not low <= int(value) <= high:
        raise _field_error(name, value, f"out of range; allowed {low} to {high}")
    return int(value)


def _text(body: Mapping[str, Any], name: str, limit: int, *, required: bool) -> str:
    value = body.get(name, None if required else "")
    if value is None and not required:
        value = ""
    if value is None:
        raise RequestError(f"field {name}: missing; give the text to draw, e.g. "
                           '{"prompt": "a red fox in the snow"}')
    if not isinstance(value, str):
        raise _field_error(name, value, "must be a string")
    if required and not value.strip():
        raise RequestError(f"field {name}: empty; give the text to draw, e.g. "
                           '{"prompt": "a red fox in the snow"}')
    if len(value) > limit:
        raise RequestError(f"field {name}: {len(value)} characters; the limit is {limit}")
    return value


def decode_body(body: bytes | bytearray | str, content_type: str | None, *, max_body_bytes: int) -> dict[str, Any]:
    """The request body -> a JSON object with only known fields; RequestError (400, one line)
    otherwise. Needs no model: it is the handler's ``input_fn``."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media != "application/json":
        raise RequestError(f"Content-Type {content_type!r}: send application/json")
    size = len(body.encode() if isinstance(body, str) else body)
    if size > max_body_bytes:
        raise RequestError(f"request body is {size} bytes; the limit is {max_body_bytes}")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise RequestError('request body must be a JSON object, e.g. {"prompt": "a red fox in the snow"}')
    unknown = sorted(set(data) - set(REQUEST_FIELDS))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; allowed: {', '.join(REQUEST_FIELDS)}")
    return data


def validate_request(data: Mapping[str, Any], spec: ServingSpec, *, random_seed: int) -> GenerateRequest:
    """A decoded body -> GenerateRequest against what this model serves; RequestError (400, one
    line) for a missing or empty prompt, a value out of range, or a size that is not served.
    ``random_seed`` is used when the request gives no seed (the JSON response reports it)."""
    limits = spec.limits
    prompt = _text(data, "prompt", limits.max_prompt_chars, required=True)
    negative = _text(data, "negative_prompt", limits.max_prompt_chars, required=False)
    steps = _int(data, "steps", limits.default_steps, 1, limits.max_steps)
    guidance = data.get("guidance_scale", limits.default_guidance_scale)
    if isinstance(guidance, bool) or not isinstance(guidance, int | float) or not math.isfinite(guidance) \
            or not 0 <= guidance <= limits.max_guidance_scale:
        raise _field_error("guidance_scale", guidance, f"a number from 0 to {limits.max_guidance_scale:g}")
    seed = _int(data, "seed", random_seed, 0, MAX_SEED)
    default = spec.sizes[0]
    size = Size(_int(data, "height", default.height, 1, 1 << 16), _int(data, "width", default.width, 1, 1 << 16))
    if size not in spec.sizes:
        raise RequestError(f"size {size} (height x width) is not served; this endpoint serves "
                           f"{', '.join(map(str, spec.sizes))}")
    return GenerateRequest(prompt=prompt, negative_prompt=negative, steps=steps, guidance_scale=float(guidance),
                           seed=seed, size=size)
