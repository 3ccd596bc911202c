"""``python -m training.serve.smoke [--target auto|inf2|trn1|trn2|cpu]`` (``make serve-smoke``): the Neuron serving check.

The one command that proves serving on real hardware: on an inf2 / trn1 / trn2 host with the
Neuron environment it builds the tiny Sana (training/serve/tiny.py), compiles every graph with
``torch_neuronx.trace`` for this host's target, loads the model directory through the
SageMaker handler, checks that the Neuron image equals the CPU image for the same seed within
the bf16 tolerance, and times a few requests. ``--target cpu`` runs the same steps with
``torch.jit.trace`` (what the tests run here).

Prints one PASS/FAIL line per step and a JSON summary; exits 1 on the first failure, with
the cause in one line. ``auto`` picks the target from this host's EC2 instance type (DMI
product name) and refuses on a host that is not inf2/trn.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly
from training.serve.manifest import TARGETS

#: mean |pixel difference| (0-255) allowed between the Neuron image and the CPU one
PIXEL_TOLERANCE = {"cpu": 0.0, "neuron": 4.0}


class SmokeFailure(Exception):
    """A step failed on this host (exit 1; a bad flag is a UserError, exit 2)."""


def detect_target(instance_type: str | None) -> str:
    """inf2 / trn1 / trn2 from an instance type ("ml.inf2.xlarge", "trn1n.32xlarge", ...)."""
    family = (instance_type or "").removeprefix("ml.").split(".")[0]
    if family.startswith("inf2"):
        return "inf2"
    if family.startswith("trn1"):
        return "trn1"
    if family.startswith("trn2"):
        return "trn2"
    raise UserError(f"--target auto: this host is {instance_type or 'not an EC2 instance'}, not inf2/trn1/trn2; run "
                    "on a Neuron host, or pass --target cpu to run the same check with torch.jit.trace")


def run_smoke(work: Path, *, target: str, requests: int = 3, steps: int = 4,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every step of the check; raises SmokeFailure naming the failed step."""
    import numpy as np

    from training.serve import handler, runtime
    from training.serve.compile import compile_export
    from training.serve.tiny import build_tiny_serving_export

    results: dict[str, Any] = {"target": target, "steps": {}}

    def step(name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            log(f"FAIL {name}: {' '.join(str(exc).split())}")
            raise SmokeFailure(f"serve-smoke: step {name} failed: {' '.join(str(exc).split())}") from None
        seconds = time.perf_counter() - started
        results["steps"][name] = round(seconds, 3)
        log(f"PASS {name} ({seconds:.1f} s)")
        return value

    export = step("export", lambda: build_tiny_serving_export(work / "tiny"))
    model = work / "model"
    shutil.rmtree(model, ignore_errors=True)
    model.mkdir(parents=True)
    shutil.copytree(export, model / "export")
    step(f"compile-{target}", lambda: compile_export(export, model / "compiled", target=target, log=lambda _: None))
    served = step("load", lambda: handler.model_fn(str(model)))
    body = json.dumps({"prompt": "a small red circle on a blue background", "seed": 7, "steps": steps})

    def image(model_: Any) -> Any:
        return np.asarray(handler.predict_fn(handler.input_fn(body, "application/json"), model_)["image"], dtype=float)

    compiled_image = step("first-request", lambda: image(served))
    reference = runtime.load(model, backend="diffusers")
    diff = float(np.abs(compiled_image - image(reference)).mean())
    tolerance = PIXEL_TOLERANCE["cpu" if target == "cpu" else "neuron"]
    results["mean_pixel_difference_vs_cpu"] = diff

    def compare() -> None:
        if diff > tolerance:
            raise RuntimeError(f"compiled image differs from the CPU pipeline's by {diff:.3f} (mean |pixel|; "
                               f"tolerance {tolerance:g})")
    step("matches-cpu", compare)

    def timed() -> list[float]:
        latencies = []
        for _ in range(requests):
            started = time.perf_counter()
            handler.output_fn(handler.predict_fn(handler.input_fn(body, "application/json"), served), "image/png")
            latencies.append(time.perf_counter() - started)
        return latencies
    latencies = step(f"time-{requests}-requests", timed)
    results.update(backend=served.backend, latencies_s=[round(v, 4) for v in latencies],
                   mean_s=round(sum(latencies) / len(latencies), 4), load_s=round(served.load_seconds, 3))
    return results


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from training.model import flops
    p = argparse.ArgumentParser(prog="python -m training.serve.smoke", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="auto", choices=("auto", *TARGETS), help="default: this host's Neuron target")
    p.add_argument("--work", help="working directory (default: a temporary one, removed afterwards)")
    p.add_argument("--requests", type=int, default=3, help="timed requests (default 3)")
    p.add_argument("--steps", type=int, default=4, help="inference steps per request (default 4)")
    args = p.parse_args(argv)
    target = detect_target(flops.host_instance_type()) if args.target == "auto" else args.target
    keep = args.work is not None
    work = Path(args.work) if keep else Path(tempfile.mkdtemp(prefix="sana-serve-smoke-"))
    try:
        results = run_smoke(work, target=target, requests=args.requests, steps=args.steps)
    except SmokeFailure as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results), flush=True)
    print(f"serve-smoke: PASS ({target}, {results['backend']}, mean {results['mean_s']} s per request)",
          file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    main()
