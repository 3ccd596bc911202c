"""``python -m training.demo --out DIR`` (``make demo``): the whole training path on this CPU.

Synthetic image+caption pairs of three aspect ratios -> precompute into NVlabs Sana's
aspect-ratio buckets (the 512 table scaled to the tiny VAE) with tiny random DC-AE / Gemma-2 /
tokenizer (Sana's complex human instruction, plus the validation prompts) -> train the ``tiny`` preset
(checkpoint every 50 steps, a validation grid every 100) -> stop at step 150 and resume to
300 -> train the same recipe and seed on the Trainium backend (torch-xla's CPU device, when
``.venv-xla`` exists) -> export a diffusers directory -> sample one image with ``SanaPipeline``
under the recorded text conditioning -> bench both backends and write the comparison report
(prices from the AWS Price List API when it answers, else the shipped table; the two training
runs' loss curves and grids side by side) -> serve the export on loopback (the SageMaker
handler behind /ping and /invocations) and save one image fetched through it -> print where
everything went.

The run is a list of steps (``STEPS``); each takes the shared ``Demo`` and records what it
made in ``demo.where``. To extend the demo (bench, report), append a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "training" / "configs" / "tiny-cpu.yaml"
#: validation prompts in the tiny tokenizer's vocabulary (other words would all be <unk>)
VALIDATION_PROMPTS = ("a small red circle on a blue background", "a large green square on a white background",
                      "the bright yellow triangle with a black ring", "a dark purple cross on an orange background")


@dataclasses.dataclass
class Demo:
    """State shared by the steps: the output root and what each step produced."""

    out: Path
    samples: int = 64
    steps: int = 300
    resume_at: int = 150
    checkpoint_every: int = 50
    validate_every: int = 100
    where: dict[str, Any] = dataclasses.field(default_factory=dict)

    def path(self, name: str) -> Path:
        return self.out / name


#: (subfolder, height / width, share of the samples): three buckets of Sana's 512 table
RAW_ASPECTS = (("square", 1.0, 0.5), ("tall", 2.0, 0.25), ("wide", 0.5, 0.25))


def make_raw_data(demo: Demo) -> None:
    """Image + caption pairs of three aspect ratios, in the folder layout precompute reads."""
    from training.model.tiny import write_image_caption_folder

    for seed, (name, aspect, share) in enumerate(RAW_ASPECTS):
        # width 80 (160 for wide ones, so no side is under the bucket's), height width * aspect
        write_image_caption_folder(demo.path("raw") / name, num=round(demo.samples * share),
                                   size=160 if aspect < 1 else 80, aspect=aspect, seed=seed)
    demo.where["raw images + captions"] = demo.path("raw")


def make_tiny_models(demo: Demo) -> None:
    """Random tiny DC-AE, Gemma-2 and tokenizer (no downloads; shapes fit the tiny preset)."""
    from training.model.tiny import build_tiny_components

    paths = build_tiny_components(demo.path("models"))
    demo.where.update({f"tiny {name}": path for name, path in paths.items()})


def precompute(demo: Demo) -> None:
    """Images -> DC-AE latents in aspect-ratio buckets, captions -> Gemma-2 embeddings, as shards."""
    from training.data import precompute as pc
    from training.model.tiny import TINY_RESOLUTION

    models = demo.path("models")
    prompts = demo.path("validation-prompts.txt")
    prompts.write_text("".join(f"{p}\n" for p in VALIDATION_PROMPTS))
    pc.main(["--input", str(demo.path("raw")), "--out", str(demo.path("features")),
             "--vae", str(models / "vae"), "--text-encoder", str(models / "text_encoder"),
             "--tokenizer", str(models / "tokenizer"), "--resolution", str(TINY_RESOLUTION), "--buckets", "512",
             "--max-text-tokens", "16", "--batch-size", "16", "--samples-per-shard", "32",
             "--device", "cpu", "--dtype", "fp32", "--work-dir", str(demo.path("precompute-work")),
             "--validation-prompts", str(prompts)])  # --chi: Sana's, the default
    demo.where["feature shards"] = demo.path("features")
    index = json.loads((demo.path("features") / "index.json").read_text())
    demo.where["aspect-ratio buckets"] = ", ".join(
        f"{name}: {b['samples']} x {'x'.join(map(str, b['latent_shape']))}" for name, b in index["buckets"].items())


def _train_args(demo: Demo, max_steps: int, run: str = "run") -> list[str]:
    return ["--config", str(TINY_CONFIG), "--set", f"data.path={demo.path('features')}",
            "--set", f"checkpoint.every_steps={demo.checkpoint_every}", "--set", "checkpoint.keep_last=3",
            "--set", "ema.decay=0.99", "--set", "log_every=25",
            "--set", f"validation.every_steps={demo.validate_every}", "--set", "validation.num_inference_steps=10",
            # constant LR: part 1 stops early by a smaller --max-steps, which would otherwise
            # change the cosine horizon (a preempted job keeps its max_steps)
            "--set", "optim.schedule=constant",
            "--max-steps", str(max_steps), "--output-dir", str(demo.path(run))]


def train_first_part(demo: Demo) -> None:
    """Train from scratch and stop part-way, as a preempted job would."""
    from training import gpu
    started = time.perf_counter()
    gpu.main([*_train_args(demo, demo.resume_at), "--resume", "none"])
    demo.where["train seconds (part 1)"] = round(time.perf_counter() - started, 1)


def train_resumed(demo: Demo) -> None:
    """Resume from the newest complete checkpoint and finish."""
    from training import gpu
    from training.checkpoint.layout import find_latest

    resume_from = find_latest(demo.path("run") / "checkpoints")
    started = time.perf_counter()
    gpu.main([*_train_args(demo, demo.steps), "--resume", "auto"])
    demo.where["resumed from"] = resume_from
    demo.where["train seconds (part 2)"] = round(time.perf_counter() - started, 1)
    demo.where["checkpoints"] = demo.path("run") / "checkpoints"
    demo.where["metrics (JSON lines)"] = demo.path("run") / "metrics.jsonl"
    demo.where["TensorBoard"] = demo.path("run") / "tensorboard"
    records = [json.loads(line) for line in (demo.path("run") / "metrics.jsonl").read_text().splitlines()]
    demo.where["loss first -> last logged"] = f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"
    grids = sorted((demo.path("run") / "validation").glob("step-*.png"))
    demo.where["validation grids"] = f"{len(grids)} in {demo.path('run') / 'validation'} (and TensorBoard)"
    demo.where["last validation grid (noise-like: tiny VAE)"] = grids[-1]
    print(f"    validation grid: {grids[-1]} (prompts: {grids[-1].parent / 'prompts.txt'})", flush=True)


def train_trainium(demo: Demo) -> None:
    """The same recipe and seed on the Trainium backend (torch-xla, CPU device): the parity run."""
    import os
    import subprocess

    xla_python = REPO / ".venv-xla" / "bin" / "python"
    if not xla_python.exists():
        print("    .venv-xla not found (make setup-xla): no Trainium run, so the report's parity stays unproven",
              flush=True)
        return
    started = time.perf_counter()
    proc = subprocess.run([str(xla_python), "-m", "training.trainium", *_train_args(demo, demo.steps, "run-trn"),
                           "--resume", "none"], env={**os.environ, "PJRT_DEVICE": "CPU"}, cwd=REPO, text=True,
                          capture_output=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"demo step train_trainium: python -m training.trainium (.venv-xla) failed: {tail}")
    demo.where["Trainium-backend run (XLA CPU, same seed)"] = demo.path("run-trn")
    demo.where["train seconds (Trainium backend)"] = round(time.perf_counter() - started, 1)


def export(demo: Demo) -> None:
    """Newest checkpoint -> diffusers SanaTransformer2DModel directory."""
    from training.checkpoint import export as ex
    ex.main([str(demo.path("run") / "checkpoints"), "--out", str(demo.path("export") / "transformer"),
             "--overwrite"])
    demo.where["diffusers transformer"] = demo.path("export") / "transformer"


def sample(demo: Demo) -> None:
    """Load the export into a SanaPipeline with the tiny VAE/text encoder and make an image,
    with the text conditioning the export records and Sana's sampler (training/evaluation/sample.py)."""
    import torch

    from training.evaluation.sample import load_pipeline
    from training.model.tiny import TINY_RESOLUTION

    pipe, conditioning = load_pipeline(demo.path("export") / "transformer", demo.path("models") / "vae")
    image = pipe("a small red circle on a blue background", height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                 num_inference_steps=4, guidance_scale=4.5, max_sequence_length=conditioning.max_text_tokens,
                 complex_human_instruction=list(conditioning.complex_human_instruction or []) or None,
                 use_resolution_binning=False, generator=torch.Generator().manual_seed(0)).images[0]
    path = demo.path("export") / "sample.png"
    image.save(path)
    demo.where["sample image (random tiny VAE: noise-like)"] = path


def compare(demo: Demo) -> None:
    """Bench both backends on this CPU and write the GPU-vs-Trainium report (CPU figures)."""
    from training.demo.compare import run_demo_comparison
    from training.report.prices import DEFAULT_PRICES

    # Prices: the shipped, dated table (training/prices.yaml), each figure labelled with its
    # source. The demo never calls AWS (it runs on machines without an account, where even the
    # credential lookup would probe the instance metadata address); `--prices aws` on the
    # report command asks the Price List API (runbooks/compare.md). Parity: the two runs above.
    parity = (["--parity-runs", str(demo.path("run")), str(demo.path("run-trn"))]
              if (demo.path("run-trn") / "metrics.jsonl").exists() else [])
    demo.where.update(run_demo_comparison(demo.path("compare"), features=demo.path("features"),
                                          report_args=["--prices", str(DEFAULT_PRICES), *parity]))
    # The report always has the projection (training/report/projection.py): cost per million samples
    # against MFU for the real presets on p5/trn1 list prices, with the break-even marked.
    report_dir = demo.path("compare") / "report"
    demo.where["projection + break-even chart (assumptions)"] = report_dir / "projection.png"
    print(f"    projection: section 'Projection' of {report_dir / 'report.md'}, chart {report_dir / 'projection.png'}",
          flush=True)


def serve(demo: Demo) -> None:
    """Serve the export: serving export + CPU graphs -> the SageMaker handler on loopback ->
    one image fetched through POST /invocations; a serving bench and the report's Serving section."""
    from training.demo.serve import serve_demo

    demo.where.update(serve_demo(demo.path("serve"), transformer=demo.path("export") / "transformer",
                                 models=demo.path("models"), prompt=VALIDATION_PROMPTS[0]))
    print(f"    served image (via /invocations): {demo.where['served image (via POST /invocations)']}", flush=True)


#: The demo, in order. Append steps here (e.g. bench, report).
STEPS: list[Callable[[Demo], None]] = [
    make_raw_data, make_tiny_models, precompute, train_first_part, train_resumed, train_trainium, export, sample,
    compare, serve,
]


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> Demo:
    p = argparse.ArgumentParser(prog="python -m training.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="demo-output", help="directory for everything the demo makes")
    p.add_argument("--steps", type=int, default=300, help="tiny-preset training steps (resumes at half)")
    args = p.parse_args(argv)
    demo = Demo(out=Path(args.out).resolve(), steps=args.steps, resume_at=max(1, args.steps // 2),
                checkpoint_every=max(1, args.steps // 6), validate_every=max(1, args.steps // 3))
    demo.out.mkdir(parents=True, exist_ok=True)
    for step in STEPS:
        started = time.perf_counter()
        print(f"==> {step.__name__}: {(step.__doc__ or '').splitlines()[0]}", flush=True)
        step(demo)
        print(f"    done in {time.perf_counter() - started:.1f} s", flush=True)
    print("\nWhere everything went:")
    for what, where in demo.where.items():
        print(f"  {what:44s} {where}")
    return demo


if __name__ == "__main__":
    main(sys.argv[1:])
