"""runbooks/data.md's offline loop, run as written: tiny models -> precompute -> train ->
export -> SanaPipeline -> one image, with nothing downloaded. The block between the
``offline-loop`` markers is handed to bash unchanged (``LOOP`` pointed at a temp dir, the
environment's ``python`` first on PATH), so the runbook cannot drift from what works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def runbook_block() -> str:
    text = (REPO / "runbooks" / "data.md").read_text()
    start, end = "<!-- offline-loop: start -->\n", "<!-- offline-loop: end -->"
    assert start in text and end in text, "offline-loop markers missing from runbooks/data.md"
    block = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert block.startswith("```bash\n") and block.endswith("```"), block[:80]
    return block.removeprefix("```bash\n").removesuffix("```")


@pytest.mark.slow
def test_the_runbooks_offline_loop_runs_as_written_and_makes_an_image(tmp_path):
    from PIL import Image

    commands = runbook_block()
    env = {**os.environ, "LOOP": str(tmp_path / "loop"), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    loop = tmp_path / "loop"
    index = json.loads((loop / "features" / "index.json").read_text())
    assert index["num_samples"] == 24 and index["buckets"]  # Sana's multi-scale buckets, the default
    assert (loop / "export" / "transformer" / "text_conditioning.json").is_file()
    image = Image.open(loop / "sample.png")
    assert image.size == (64, 64) and image.mode == "RGB"
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed["sampler"] == "flow_dpm-solver" and printed["chi"] == "sana"
