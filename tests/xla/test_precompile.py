"""``python -m training.trainium --precompile``: traces a few steps, writes no checkpoint,
resumes from none and reads no tensor value."""

from __future__ import annotations

import json
import shutil

import yaml
from xla_helpers import tiny_tree

from training.checkpoint import list_complete
from training.trainium import main


def test_precompile_traces_steps_and_writes_no_checkpoint(xla_run, features, tmp_path, capsys):
    out = tmp_path / "run"
    # a complete checkpoint where --resume auto would find it: precompile must not load it
    shutil.copytree(xla_run["out"] / "checkpoints", out / "checkpoints")
    assert list_complete(out / "checkpoints")
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_tree(features, out)))

    main(["--config", str(config), "--precompile", "--resume", "auto", "--max-steps", "50"])

    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["precompile"] is True
    assert report["steps"] == 3  # trainium.precompile_steps, from step 0 (nothing resumed)
    assert report["final_loss"] is None  # no tensor was read
    assert report["checkpoint"] is None
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000012"]  # only the copy
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or not any("loss" in json.loads(line) for line in metrics.read_text().splitlines())


def test_help_lists_precompile(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "--precompile" in capsys.readouterr().out
