"""``python -m training.serve.bench --model-dir DIR --size 1024x1024 --steps 20 --out FILE``: serving latency.

Times whole requests through the handler the endpoint runs (training/serve/handler.py:
``input_fn`` -> ``predict_fn`` -> ``output_fn`` to PNG, in this process, after ``model_fn``),
so the figure includes prompt encoding, every denoising step, decoding and PNG encoding, and
excludes only the network. Writes one JSON (``ServeBenchResult``) that
``python -m training.report --serving FILE`` reads into its "Serving" section.

- latency per image: p50 / p90 / mean over ``--requests`` timed requests after ``--warmup``
  (the first requests pay graph loading and allocator warm-up);
- images/s per instance = workers x 1 / mean latency, with ``--workers`` = model copies per
  instance (1: one pipeline, requests one at a time; the stack runs one worker per instance).

On a CPU (``instance_type`` "local") the figures exercise the path; they say nothing about
an accelerator, and the report labels them so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly
from training.serve.spec import parse_size

KIND = "sana-serve-bench/1"


@dataclasses.dataclass(kw_only=True)
class ServeBenchResult:
    """One serving bench: what ran where, and its per-image latencies."""

    instance_type: str  # "ml.inf2.xlarge", "ml.g6.xlarge", ... or "local"
    backend: str  # "compiled-inf2", "diffusers-cuda", "compiled-cpu", "diffusers-cpu"
    device: str
    transformer_config: dict[str, Any]
    height: int
    width: int
    steps: int
    guidance_scale: float
    warmup: int
    latencies_s: list[float]
    workers: int = 1
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    timestamp: str = ""
    command: str = ""
    notes: str = ""
    kind: str = KIND

    def __post_init__(self) -> None:
        if self.kind != KIND:
            raise ValueError(f"kind {self.kind!r} is not {KIND!r}")
        if not self.latencies_s or not all(isinstance(v, int | float) and v > 0 for v in self.latencies_s):
            raise ValueError("latencies_s: needs at least one positive latency")
        if self.workers < 1 or self.steps < 1 or self.height < 1 or self.width < 1:
            raise ValueError("workers, steps, height and width must be >= 1")

    @property
    def p50_s(self) -> float:
        return float(statistics.median(self.latencies_s))

    @property
    def p90_s(self) -> float:
        return percentile(self.latencies_s, 0.90)

    @property
    def mean_s(self) -> float:
        return float(statistics.fmean(self.latencies_s))

    @property
    def images_per_s_per_instance(self) -> float:
        return self.workers / self.mean_s

    @property
    def is_cpu(self) -> bool:
        return self.instance_type == "local" or self.backend.endswith("-cpu")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(p50_s=self.p50_s, p90_s=self.p90_s, mean_s=self.mean_s,
                   images_per_s_per_instance=self.images_per_s_per_instance)
        return out

    @classmethod
    def load(cls, path: str | Path) -> ServeBenchResult:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"--serving {path}: unreadable ({exc})") from None
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in fields})
        except (TypeError, ValueError) as exc:
            raise UserError(f"--serving {path}: not a serving bench result ({exc}); write one with "
                            "python -m training.serve.bench") from None


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default 'linear' method), q in [0, 1]."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "diffusers", "transformers", "torch-neuronx", "neuronx-cc"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def run_bench(model_dir: Path, *, size: str | None = None, steps: int = 20, requests: int = 5, warmup: int = 1,
              guidance_scale: float = 4.5, instance_type: str | None = None, workers: int = 1, notes: str = "",
              command: str = "") -> ServeBenchResult:
    """Load ``model_dir`` once, then time ``requests`` requests after ``warmup`` untimed ones."""
    from training.model import flops
    from training.serve import handler

    if requests < 1 or warmup < 0 or workers < 1:
        raise UserError("--requests >= 1, --warmup >= 0 and --workers >= 1")
    model = handler.model_fn(str(model_dir))
    chosen = parse_size(size, flag="--size") if size else model.spec.sizes[0]
    body = json.dumps({"prompt": "a red fox in the snow, golden hour", "steps": steps, "seed": 0,
                       "guidance_scale": guidance_scale, "height": chosen.height, "width": chosen.width})

    def one() -> float:
        started = time.perf_counter()
        data = handler.input_fn(body, "application/json")
        handler.output_fn(handler.predict_fn(data, model), "image/png")
        return time.perf_counter() - started

    for _ in range(warmup):
        one()
    latencies = [one() for _ in range(requests)]
    config = {k: v for k, v in dict(model.pipe.transformer.config).items() if not k.startswith("_")}
    device = str(getattr(model.pipe, "device", "cpu"))
    return ServeBenchResult(
        instance_type=instance_type or flops.host_instance_type() or "local", backend=model.backend, device=device,
        transformer_config=json.loads(json.dumps(config, default=str)), height=chosen.height, width=chosen.width,
        steps=steps, guidance_scale=guidance_scale, warmup=warmup, latencies_s=latencies, workers=workers,
        versions=_versions(), timestamp=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=command, notes=notes)


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> ServeBenchResult:
    p = argparse.ArgumentParser(prog="python -m training.serve.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="model directory (export/ [+ compiled/]) or a serving export")
    p.add_argument("--size", help="HEIGHTxWIDTH to request (default: the model's first served size)")
    p.add_argument("--steps", type=int, default=20, help="inference steps per image (default 20)")
    p.add_argument("--guidance-scale", type=float, default=4.5, help="CFG scale (default 4.5, Sana's)")
    p.add_argument("--requests", type=int, default=5, help="timed requests (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests first (default 1)")
    p.add_argument("--workers", type=int, default=1, help="model copies per instance (default 1)")
    p.add_argument("--instance-type", help="instance type priced in the report (default: this host's, or local)")
    p.add_argument("--notes", default="", help="free text kept in the JSON")
    p.add_argument("--out", required=True, help="result JSON to write")
    args = p.parse_args(argv)
    result = run_bench(Path(args.model_dir), size=args.size, steps=args.steps, requests=args.requests,
                       warmup=args.warmup, guidance_scale=args.guidance_scale, instance_type=args.instance_type,
                       workers=args.workers, notes=args.notes,
                       command="python -m training.serve.bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    print(json.dumps({"out": str(out), "backend": result.backend, "p50_s": round(result.p50_s, 4),
                      "p90_s": round(result.p90_s, 4), "images_per_s_per_instance":
                      round(result.images_per_s_per_instance, 4)}), flush=True)
    return result


if __name__ == "__main__":
    main()
