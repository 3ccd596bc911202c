"""``python -m training.demo`` end to end at a few steps: every stage runs and leaves its output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from training.data.loader import FeatureLoader
from training.demo.steps import main


@pytest.mark.slow
def test_demo_runs_every_step(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    try:
        demo = main(["--out", str(tmp_path / "demo"), "--steps", "12"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "Where everything went:" in out
    index = json.loads((demo.out / "features" / "index.json").read_text())
    assert index["num_samples"] == demo.samples
    # mixed-shape images went into Sana's aspect-ratio buckets, and the training run's order
    # (tiny-cpu.yaml: batch 4, data.seed 0) switches between them
    assert {n: b["samples"] for n, b in index["buckets"].items()} == {"0.5": 16, "1.0": 32, "2.0": 16}
    assert "aspect-ratio buckets" in demo.where and "0.5: 16 x 4x22x44" in out
    loader = FeatureLoader(demo.out / "features", batch_size=4, seed=0, prefetch=0)
    assert len({loader.bucket_at(0, s).name for s in range(12)}) >= 2
    assert demo.where["resumed from"].name == "step-00000006"
    assert (demo.out / "run" / "checkpoints" / "step-00000012" / "manifest.json").exists()
    steps = [json.loads(line)["step"] for line in (demo.out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 12
    assert (demo.out / "export" / "transformer" / "config.json").exists()
    assert (demo.out / "export" / "sample.png").stat().st_size > 0
    # validation grids every steps // 3, across the stop at 6 and the resume
    assert sorted(p.name for p in (demo.out / "run" / "validation").glob("*.png")) == [
        "step-00000004.png", "step-00000008.png", "step-00000012.png"]
    assert demo.where["last validation grid (noise-like: tiny VAE)"].name == "step-00000012.png"
    assert "validation grid: " in out
    # trained and sampled with Sana's CHI, as recorded
    conditioning = json.loads((demo.out / "export" / "transformer" / "text_conditioning.json").read_text())
    assert conditioning["chi"] == "sana" and conditioning["max_text_tokens"] == 16
    # the comparison report: prices with their sources (the shipped table: the demo never asks
    # AWS), the break-even, and the two training runs of the same seed side by side when .venv-xla exists
    md = (demo.out / "compare" / "report" / "report.md").read_text()
    assert re.search(r"Sources asked, in order: [^\n]*training/prices\.yaml\.", md), md
    assert "## Prices and where they came from" in md and "**Cost per sample:**" in md and "## Price scenarios" in md
    from training.report.prices import DEFAULT_PRICES, PriceTable

    shipped = PriceTable.load(DEFAULT_PRICES)  # the break-even of the shipped prices, by hand
    trn1, p5 = shipped.get("ml.trn1.32xlarge"), shipped.get("ml.p5.48xlarge")
    assert f"when its MFU is **{(trn1.usd_per_hour / (16 * 190)) / (p5.usd_per_hour / (8 * 989)):.2f}x**" in md
    assert trn1.source in md and p5.source in md
    if (Path(__file__).resolve().parents[3] / ".venv-xla" / "bin" / "python").exists():
        trn_steps = [json.loads(line)["step"] for line in (demo.out / "run-trn" / "metrics.jsonl").read_text().splitlines()]
        assert trn_steps[-1] == 12
        assert "## Quality parity" in md and "| ![](parity-grid-1-step-00000012.png) |" in md
    # ...and the demo ends by serving that export: one image fetched through POST /invocations
    from PIL import Image

    served = demo.where["served image (via POST /invocations)"]
    assert served == demo.out / "serve" / "served.png" and Image.open(served).size == (64, 64)
    assert "## Serving" in (demo.out / "serve" / "report" / "report.md").read_text()
    assert "served image (via /invocations): " in out
