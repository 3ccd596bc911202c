"""benchmarks/gpu-check.sh: its CPU dry run, its PASS/FAIL table on results below and on
target, its preflight checks and its venv build that leaves nothing behind when it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training.report.bench_fixtures import make_result
from training.perf import gpu_check
from training.perf.bench_result import BenchResult

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "gpu-check.sh"
RUNS = gpu_check.RUNS
GIB = 2**30


# shellcheck: tests/test_lint.py covers benchmarks/*.sh with every other script (never skipped).


def _run(*args: str, env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_gpu_check_refuses_a_wrong_command_line(tmp_path) -> None:
    proc = _run(str(tmp_path), "--bogus")
    assert proc.returncode == 2 and "usage:" in proc.stderr
    assert _run(str(tmp_path), "--dry-run", "--evaluate").returncode == 2


# ----- the table: fake H100 results on and below target --------------------------------------

def _h100(name: str, *, mfu: float = 0.47, ratio: float = 1.4, sps: float = 500.0, compiles: int = 0,
          breaks: int = 0, peak_gib: float = 60.0, estimate_gib: float = 62.0, compiled: bool = True) -> dict:
    """A valid result of run ``name`` as an H100 would write it (identities hold)."""
    extra: dict = dict(compile_count=4 if compiled else None, compile_seconds=80.0 if compiled else None,
                       compiles_in_timed_steps=compiles if compiled else None,
                       graph_breaks=breaks if compiled else None, caption_lengths="full (test)")
    if name == gpu_check.BIG:
        extra.update(model_preset="sana-1600m-1024", peak_memory_bytes=int(peak_gib * GIB),
                     memory_estimate={"total": estimate_gib, "mesh": "fsdp"})
    else:
        total = sps  # one GPU
        extra["reference"] = {"samples_per_s_total": total / ratio, "ratio": ratio, "ratio_median": ratio,
                              "ratios": [ratio] * 5, "compiled": name == gpu_check.COMPILED}
    return make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="H100-SXM", nodes=1,
                       per_node=1, sps_per_accel=sps, peak=989.0, mfu=mfu, mfu_padded=mfu, **extra)


def _write(out: Path, **overrides: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    runs = {gpu_check.EAGER: _h100(gpu_check.EAGER, sps=400.0, compiled=False), gpu_check.COMPILED:
            _h100(gpu_check.COMPILED), gpu_check.BIG: _h100(gpu_check.BIG)}
    for name, data in {**runs, **overrides}.items():
        if data is None:
            (out / f"{name}.json").unlink(missing_ok=True)
            continue
        BenchResult.from_dict(data)
        (out / f"{name}.json").write_text(json.dumps(data))
    return out


def test_results_on_target_pass_and_print_one_table(tmp_path) -> None:
    proc = _run(str(_write(tmp_path / "ok")), "--evaluate")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpu-check: H100-SXM, peak 989 bf16 TFLOP/s")
    assert lines[-1].startswith("gpu-check: PASS (10 passed, 0 skipped)")
    assert (tmp_path / "ok" / "summary.txt").read_text() == proc.stdout
    assert "1.25x" in proc.stdout  # compile speed-up 500 / 400


@pytest.mark.parametrize(("what", "overrides", "failing"), [
    ("MFU below 45%", {gpu_check.COMPILED: _h100(gpu_check.COMPILED, mfu=0.40)}, "MFU >= 45%"),
    ("ratio below 1.3x", {gpu_check.EAGER: _h100(gpu_check.EAGER, ratio=1.2, sps=400.0, compiled=False)},
     "ratio to reference >= 1.3x, both eager"),
    ("memory off by 20%", {gpu_check.BIG: _h100(gpu_check.BIG, peak_gib=50.0, estimate_gib=62.5)},
     "1.6B peak within 10%"),
    ("compiled slower", {gpu_check.COMPILED: _h100(gpu_check.COMPILED, sps=380.0)}, "compile speed-up"),
    ("a recompile", {gpu_check.BIG: _h100(gpu_check.BIG, compiles=2)}, "no recompiles after warm-up"),
    ("a graph break", {gpu_check.COMPILED: _h100(gpu_check.COMPILED, breaks=4)}, "no graph breaks"),
    ("a run missing", {gpu_check.BIG: None}, "run step-1600m-1024-1gpu"),
    ("unknown GPU", {gpu_check.COMPILED: {**_h100(gpu_check.COMPILED), "accelerator": "NVIDIA GH200 480GB",
                                          "mfu": None, "mfu_padded": None, "peak_tflops_per_accelerator": None,
                                          "peak_source": None}}, "MFU >= 45%"),
    ("CPU results", {gpu_check.COMPILED: {**_h100(gpu_check.COMPILED), "device_kind": "cpu"}}, "MFU >= 45%"),
])
def test_a_missed_target_fails_the_check(tmp_path, what, overrides, failing) -> None:
    proc = _run(str(_write(tmp_path / "run", **overrides)), "--evaluate")
    assert proc.returncode == 1, (what, proc.stdout)
    failed = [line for line in proc.stdout.splitlines() if line.startswith(failing)]
    assert failed and " FAIL" in failed[0], (what, proc.stdout)
    assert proc.stdout.splitlines()[-1].startswith("gpu-check: FAIL ("), proc.stdout
    if what == "unknown GPU":
        assert "add its CUDA device name and datasheet peak to training/model/flops.py" in failed[0]


# ----- preflight and the venv -------------------------------------------------------------------

def _fake_python(tmp_path: Path, *, version: str = "", include: str = "") -> Path:
    """A python3 that lies about its version or its include directory, else the real one."""
    fake = tmp_path / "python3"
    real = sys.executable
    fake.write_text(f"""#!/usr/bin/env bash
case "$*" in
  *version_info*) {f'echo {version}; exit 0' if version else f'exec {real} "$@"'} ;;
  *sysconfig*) {f'echo {include}; exit 0' if include else f'exec {real} "$@"'} ;;
esac
exec {real} "$@"
""")
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize(("env", "step", "says"), [
    ({"PYTHON": "VERSION"}, "python", "is 3.10.12; the training package needs >= 3.11"),
    ({"CC": "/nonexistent/cc"}, "compiler", "no C compiler (/nonexistent/cc)"),
    ({"PYTHON": "HEADERS"}, "headers", "Python.h: Triton and Inductor build C extensions"),
])
def test_preflight_fails_first_with_one_line(tmp_path, env, step, says) -> None:
    if env.get("PYTHON") == "VERSION":
        env = {"PYTHON": str(_fake_python(tmp_path, version="3.10.12"))}
    elif env.get("PYTHON") == "HEADERS":
        env = {"PYTHON": str(_fake_python(tmp_path, include=str(tmp_path / "no-include")))}
    proc = _run(str(tmp_path / "out"), "--dry-run", "--build-venv", env={**env, "GPU_CHECK_CACHE": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"gpu-check: FAIL {step}") and says in last, proc.stderr
    assert "run compare" not in proc.stderr  # nothing ran after the failed check


@pytest.mark.parametrize(("requirements", "cause"), [
    ("no-such-package-for-gpu-check==0.0.0\n", "pip install -r"),  # pip fails (PIP_NO_INDEX: no network)
    ("", "the new venv cannot import torch"),  # pip "succeeds" but the venv is half-built
])
@pytest.mark.slow
def test_a_broken_venv_build_fails_and_caches_nothing(tmp_path, requirements, cause) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text(requirements)
    cache = tmp_path / "cache"
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    env = {"GPU_CHECK_REQUIREMENTS": str(req), "GPU_CHECK_CACHE": str(cache), "PIP_NO_INDEX": "1",
           "PYTHON": str(base if base.exists() else sys.executable)}
    for attempt in (1, 2) if not requirements else (1,):  # the second run builds again: nothing was kept
        proc = _run(str(tmp_path / "out"), "--dry-run", "--build-venv", env=env, timeout=300)
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("gpu-check: FAIL venv") and cause in last and "nothing was cached" in last, last
        assert "building" in proc.stderr and "reusing" not in proc.stderr, attempt
        assert sorted(p.name for p in cache.iterdir()) == [], list(cache.iterdir())


# ----- the dry run ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_gpu_check_dry_run_writes_valid_results_and_a_passing_table(tmp_path) -> None:
    """The same three bench commands as on a GPU, on the tiny config (about two minutes here),
    compiled with aot_eager: the graph counts are checked for real, the GPU figures skipped."""
    out = tmp_path / "results"
    proc = _run(str(out), "--dry-run", env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = {name: BenchResult.load(out / f"{name}.json") for name in RUNS}  # full schema validation
    eager, compiled, big = (results[n] for n in RUNS)
    assert eager.reference["compiled"] is False and compiled.reference["compiled"] is True
    assert eager.reference["text_tokens_real"] == eager.text_tokens_real  # identical caption lengths
    for r in (compiled, big):
        assert r.compile_count and r.compiles_in_timed_steps == 0 and r.graph_breaks == 0
    assert big.reference is None and big.memory_estimate["mesh"] == "fsdp"
    assert big.memory_estimate["activation_checkpointing"] == "full"
    summary = (out / "summary.txt").read_text()
    assert summary == proc.stdout and "FAIL" not in summary
    assert "no recompiles after warm-up" in summary and "SKIP (CPU dry run)" in summary
    assert proc.stdout.splitlines()[-1].startswith("gpu-check: PASS")
    for line in ("PASS python", "PASS venv", "PASS compiler", "PASS headers"):
        assert f"gpu-check: {line}" in proc.stderr
