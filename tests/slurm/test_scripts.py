"""Static and no-daemon checks of the job scripts: shellcheck, headers, refusing to run bare."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "training" / "slurm"
SCRIPTS = sorted([*SLURM_DIR.glob("*.sbatch"), *SLURM_DIR.glob("*.sh")])
PARTITIONS = {"train-gpu.sbatch": "gpu", "train-trainium.sbatch": "trn", "precompute.sbatch": "gpu",
              "bench.sbatch": "gpu"}


def shellcheck() -> str:
    venv = REPO / ".venv" / "bin" / "shellcheck"
    found = str(venv) if venv.exists() else shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck not installed; run `make setup`")
    return found


def test_the_four_job_scripts_and_the_launcher_exist():
    assert sorted(p.name for p in SCRIPTS) == sorted([*PARTITIONS, "launch.sh"])


def test_scripts_are_shellcheck_clean():
    proc = subprocess.run([shellcheck(), "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(PARTITIONS))
def test_sbatch_header_asks_for_whole_nodes_one_task_each_on_its_partition(name):
    header = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", (SLURM_DIR / name).read_text(), re.M))
    assert header["partition"] == PARTITIONS[name]
    assert header["ntasks-per-node"] == "1"
    assert "exclusive" in header
    assert header["nodes"].isdigit()


def test_launcher_refuses_to_run_outside_a_slurm_job(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SANA_"))}
    proc = subprocess.run(["bash", str(SLURM_DIR / "launch.sh"), "job", "gpu"], capture_output=True, text=True,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 1
    assert "not inside a Slurm job; submit with sbatch" in proc.stderr


def test_launcher_names_an_unknown_kind(tmp_path):
    proc = subprocess.run(["bash", str(SLURM_DIR / "launch.sh"), "job", "cuda"], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 1
    assert "unknown job kind 'cuda'; use gpu, trainium, precompute or bench" in proc.stderr
