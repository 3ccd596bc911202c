"""The comparison part of ``make demo`` (steps.py ``compare``): both training backends benched on
this CPU (the GPU backend here, the Trainium backend on torch-xla's CPU device in .venv-xla),
then the comparison report. Every figure is labelled a CPU figure."""

from __future__ import annotations

import datetime
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError
from training.perf.bench import main

REPO = Path(__file__).resolve().parents[2]
#: an illustrative round price for the demo's local CPU runs, so the cost sections have numbers
DEMO_LOCAL_USD_PER_HOUR = 1.0


def run_demo_comparison(out_dir: str | Path, *, features: str | Path, dataset_samples: int | None = None,
                        epochs: float = 10.0, steps: int = 10, report_args: Sequence[str] = ()) -> dict[str, Path]:
    """Bench the GPU backend (this process, CPU) and the Trainium backend (torch-xla on PJRT CPU
    in ``.venv-xla``, when that exists) on the tiny preset and ``features``, then write the
    comparison report. Everything is labelled CPU figures. Returns {what: path} for the demo.

    Args:
        out_dir: where the result JSONs, the demo price file and ``report/`` go.
        features: feature directory shaped for the tiny preset (the demo's precompute output).
        dataset_samples / epochs: target for the time/cost section (default: the features' size).
        report_args: more ``python -m training.report`` arguments (the demo's price and parity inputs).
    """

    from training.data.index import FeatureIndex
    from training.report.cli import main as report_main

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = REPO / "training" / "configs" / "tiny-cpu.yaml"
    common = ["--config", str(config), "--set", f"data.path={features}", "--set", "tensorboard=false",
              "--set", "log_every=5", "--steps", str(steps), "--work-dir", str(out / "work"),
              "--notes", "CPU figures from make demo (tiny preset), not accelerator figures"]
    where: dict[str, Path] = {}
    results = [out / "bench-gpu-cpu.json"]
    main(["--backend", "gpu", *common, "--warmup", "2", "--out", str(results[0])])
    where["bench result, GPU backend on CPU"] = results[0]
    xla_python = REPO / ".venv-xla" / "bin" / "python"
    if xla_python.exists():
        trn = out / "bench-trainium-xla-cpu.json"
        env = {**os.environ, "PJRT_DEVICE": "CPU"}
        proc = subprocess.run([str(xla_python), "-m", "training.bench", "--backend", "trainium", *common,
                               "--warmup", "2", "--out", str(trn)], env=env, text=True, capture_output=True,
                              cwd=REPO)
        if proc.returncode != 0:
            raise UserError(f"bench --backend trainium (.venv-xla) failed: {proc.stderr.strip().splitlines()[-1:]}")
        results.append(trn)
        where["bench result, Trainium backend on XLA CPU"] = trn
    else:
        print("bench: .venv-xla not found (make setup-xla): the report has the GPU backend only", flush=True)
    prices = out / "prices-demo.yaml"
    prices.write_text(f"""# Demo only: the runs are on this machine's CPU ("local"); the price is an illustrative
# round number so the cost sections show how they are computed. Not a real price.
as_of: "{datetime.date.today().isoformat()}"
currency: USD
region: local
prices:
  local:
    usd_per_hour: {DEMO_LOCAL_USD_PER_HOUR}
    source: "illustrative round number for a local CPU machine (make demo), not a list price"
    checked: "{datetime.date.today().isoformat()}"
    verified: false
""")
    samples = dataset_samples or FeatureIndex.load(features).num_samples
    report_main([*map(str, results), "--out", str(out / "report"), "--prices", str(prices),
                 "--dataset-samples", str(samples), "--epochs", f"{epochs:g}", "--features-index", str(features),
                 *report_args])
    where["comparison report (CPU figures)"] = out / "report" / "report.md"
    return where


# ----- CLI ---------------------------------------------------------------------------------
