"""Rank 0's exporter alone (training/observability/prometheus.py): what it serves and its
failure paths, none of which may stop training: a port that is taken, no discovery directory."""

from __future__ import annotations

import json
import logging
import math
import socket
import urllib.request
from pathlib import Path

import pytest

from training.observability.config import PrometheusConfig
from training.observability.identity import RunIdentity, run_identity
from training.observability.prometheus import PrometheusExporter

WHO = RunIdentity(job_id="77", user="analyst", run_name="lora-a", node="gpu-1")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("sana_training_")}


def test_it_serves_the_last_values_with_the_jobs_labels_and_removes_its_file(tmp_path: Path) -> None:
    exporter = PrometheusExporter(PrometheusConfig(host="127.0.0.1", targets_dir=str(tmp_path)), WHO, start_step=40)
    labels = '{job_id="77",node="gpu-1",run_name="lora-a",user="analyst"}'
    try:
        (target,) = tmp_path.glob("*.json")
        assert json.loads(target.read_text()) == [{"targets": [f"127.0.0.1:{exporter.port}"], "labels": WHO.labels()}]
        before = scrape(exporter.url)
        assert before[f"sana_training_last_step{labels}"] == 40  # a resumed run starts at its step
        assert math.isnan(before[f"sana_training_samples_per_second{labels}"])  # nothing measured yet
        exporter.advance(41)
        exporter.log(42, {"loss": 0.5, "samples_per_s": 812.5, "mfu": None, "checkpoint_stall_s": 1.25})
        after = scrape(exporter.url)
        assert after[f"sana_training_last_step{labels}"] == 42
        assert after[f"sana_training_samples_per_second{labels}"] == 812.5
        assert after[f"sana_training_checkpoint_stall_seconds{labels}"] == 1.25
        assert math.isnan(after[f"sana_training_mfu_ratio{labels}"])  # no peak for this accelerator
    finally:
        exporter.close()
    assert list(tmp_path.glob("*.json")) == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=2)


def test_a_port_that_is_taken_is_one_warning_and_nothing_else(tmp_path: Path, caplog) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="training.observability.prometheus"):
            exporter = PrometheusExporter(PrometheusConfig(host="127.0.0.1", port=port, targets_dir=str(tmp_path)),
                                          WHO, start_step=0)
        exporter.log(1, {"loss": 1.0})
        exporter.close()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"prometheus: cannot listen on 127.0.0.1:{port} (") and "metrics.jsonl" in warning
    assert exporter.url is None and list(tmp_path.iterdir()) == []


def test_without_a_discovery_directory_the_metrics_are_still_served(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        exporter = PrometheusExporter(PrometheusConfig(host="127.0.0.1", targets_dir=str(tmp_path / "absent")),
                                      WHO, start_step=0)
    try:
        assert exporter.target_file is None and scrape(exporter.url)
        assert not caplog.records  # observability=false is no warning per job
    finally:
        exporter.close()


def test_identity_comes_from_slurm(tmp_path: Path) -> None:
    who = run_identity(str(tmp_path / "runs" / "sana 600m"), environ={"SLURM_JOB_ID": "9", "SLURM_JOB_USER": "ana"})
    assert (who.job_id, who.user, who.run_name) == ("9", "ana", "sana-600m")
    assert run_identity(str(tmp_path), "named", environ={}).job_id.startswith("local-")
