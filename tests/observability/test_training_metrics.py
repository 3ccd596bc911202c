"""A real CPU training run (``python -m training.gpu``, tiny preset) whose rank 0 metrics the
platform's collector (Debian's Prometheus in agent mode, with the config the controller's
observability step generates: lifecycle_scripts/observability_config.py) scrapes through the
job's discovery file and remote-writes, SigV4-signed, to a Prometheus remote-write receiver
standing in for Amazon Managed Service for Prometheus; a PromQL query reads them back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.observability.servers import prometheus, wait_query
from training.data.shards import write_synthetic_features

pytestmark = pytest.mark.slow
JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_USER": "researcher"}
# SigV4 signs with the standard credential chain (the node's role on a cluster; here environment
# credentials, which the receiver ignores). Prometheus refuses a config whose SigV4 has no
# credentials at all ("could not get SigV4 credentials"), so the collector needs them to start.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"}


def collector_config(fsx: Path, remote_write: str) -> dict:
    out = subprocess.run([sys.executable, str(REPO / "lifecycle_scripts/observability_config.py"), "collector",
                          "--fsx", str(fsx), "--remote-write", remote_write, "--region", "us-east-1",
                          "--cluster", "sana-test", "--scrape-interval", "1s"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_a_training_run_reaches_the_workspace_through_the_collector(tmp_path: Path) -> None:
    features = tmp_path / "features"
    write_synthetic_features(features, num_samples=16, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8)
    fsx = tmp_path / "fsx"
    targets = fsx / "observability" / "targets"
    targets.mkdir(parents=True)
    (fsx / "observability" / "nodes").mkdir()
    run_dir = tmp_path / "runs" / "tiny-obs"
    # The receiver: Amazon Managed Service for Prometheus takes the same remote-write protocol.
    with prometheus(tmp_path / "workspace", {"global": {}}, "--web.enable-remote-write-receiver") as workspace, \
            prometheus(tmp_path / "collector", collector_config(fsx, f"{workspace}/api/v1/write"),
                       "--enable-feature=agent", env=CREDENTIALS):
        train = subprocess.Popen(
            [sys.executable, "-m", "training.gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
             "--set", f"data.path={features}", "--set", "tensorboard=false", "--set", "log_every=2",
             "--set", "prometheus.host=127.0.0.1", "--set", "checkpoint.every_steps=0",
             "--max-steps", "100000", "--output-dir", str(run_dir)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **JOB, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
                 "SANA_METRICS_TARGETS_DIR": str(targets)})
        try:
            (result,) = wait_query(workspace, 'sana_training_samples_per_second{job_id="4242"} > 0')
            (files,) = list(targets.glob("*.json")) or [None]
            assert files is not None and files.name.startswith("4242-")
            # What the job serves itself (its own port, bound to the address it advertises).
            target = json.loads(files.read_text())[0]["targets"][0]
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
                served = response.read().decode()
            (step,) = wait_query(workspace, 'sana_training_last_step{job_id="4242"} >= 2')
        finally:
            train.send_signal(signal.SIGTERM)  # what Slurm sends at the time limit
            out, err = train.communicate(timeout=120)
    labels = result["metric"]
    assert labels["job_id"] == "4242" and labels["user"] == "researcher" and labels["run_name"] == "tiny-obs"
    assert labels["job"] == "sana-training" and labels["cluster"] == "sana-test"  # the collector's labels
    assert float(result["value"][1]) > 0
    assert int(float(step["value"][1])) >= 2
    for name in ("loss", "tokens_per_second", "mfu_ratio", "step_time_seconds", "checkpoint_stall_seconds",
                 "last_step", "start_time_seconds"):
        assert f"sana_training_{name}{{" in served, name
    # Stopped by SIGTERM: exit 128+15 and its discovery file removed, so no stale target remains.
    assert train.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert list(targets.glob("*.json")) == []
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "checkpoint_stall_s" in records[-1]


def test_the_collector_scrapes_a_job_file_only_at_metrics_and_never_link_local(tmp_path: Path) -> None:
    """A discovery file is written by any cluster user: the collector (real Prometheus, the
    generated config) takes its address, never a path or query of the user's choosing, and
    drops link-local addresses (the instance metadata service)."""
    fsx = tmp_path / "fsx"
    targets = fsx / "observability" / "targets"
    targets.mkdir(parents=True)
    (targets / "evil.json").write_text(json.dumps([
        {"targets": ["169.254.169.254:80"], "labels": {"job_id": "1"}},
        {"targets": ["127.0.0.1:9"], "labels": {"job_id": "2", "__metrics_path__": "/latest/meta-data/",
                                                "__param_x": "y", "__scheme__": "https"}}]))
    with prometheus(tmp_path / "collector", collector_config(fsx, "http://127.0.0.1:9/api/v1/write"),
                    "--enable-feature=agent", env=CREDENTIALS) as collector:
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(f"{collector}/api/v1/targets", timeout=5) as response:
                active = [t for t in json.loads(response.read())["data"]["activeTargets"]
                          if t["labels"]["job"] == "sana-training"]
            if active:
                break
            assert time.monotonic() < deadline, "the collector never picked the file up"
            time.sleep(0.5)
    (target,) = active
    assert target["scrapeUrl"] == "http://127.0.0.1:9/metrics"
