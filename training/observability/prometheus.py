"""Rank 0's training metrics as Prometheus gauges, served on a port of the job's own.

Why a port per job and a discovery file, not the node exporter's textfile collector: the
textfile directory is the node's, so every user's job would need write access to one shared
directory (any user could then publish any job's metrics), and a job that dies leaves its last
values there, which the stall alert would take for a stalled job forever. A job's own HTTP
server and its own file (written by the job's user, removed when the job ends) fix both: when
the job is gone its target goes down and its series go stale, so no alert outlives it.

The collector on the controller reads every ``*.json`` in the targets directory with
Prometheus file-based discovery (``file_sd_configs``: a JSON list of ``{"targets": [...],
"labels": {...}}``, https://prometheus.io/docs/prometheus/latest/configuration/configuration/#file_sd_config)
and scrapes ``http://<host>:<port>/metrics`` (lifecycle_scripts/observability_config.py).

A port that cannot be opened or a directory that cannot be written is one warning: training
goes on without it (metrics.jsonl is always written).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from training.observability.config import PrometheusConfig
from training.observability.identity import RunIdentity

log = logging.getLogger(__name__)
TARGETS_ENV = "SANA_METRICS_TARGETS_DIR"
PREFIX = "sana_training_"
#: metrics.jsonl key -> (gauge name after PREFIX, help)
GAUGES = {
    "loss": ("loss", "Training loss (rank 0's mean over the last optimizer step)"),
    "samples_per_s": ("samples_per_second", "Global samples per second over the last logging window"),
    "tokens_per_s": ("tokens_per_second", "Global image + caption tokens per second over the last logging window"),
    "mfu": ("mfu_ratio", "Model FLOPs utilisation (0..1; NaN where the accelerator has no peak entry)"),
    "step_time_s": ("step_time_seconds", "Mean optimizer step time over the last logging window"),
    "checkpoint_stall_s": ("checkpoint_stall_seconds",
                           "Seconds the loop waited on checkpoint saves during the last logging window"),
    "grad_norm": ("grad_norm", "Gradient norm before clipping"),
    "lr": ("learning_rate", "Learning rate"),
}


class PrometheusExporter:
    """Gauges of the last logged values, ``last_step`` every step, served on ``host:port``."""

    def __init__(self, cfg: PrometheusConfig, identity: RunIdentity, *, start_step: int,
                 environ: dict[str, str] | None = None) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        env = os.environ if environ is None else environ
        self.identity = identity
        self.registry = CollectorRegistry()
        names = list(identity.labels())
        self._gauges = {key: Gauge(PREFIX + name, text, names, registry=self.registry).labels(**identity.labels())
                        for key, (name, text) in GAUGES.items()}
        self._last_step = Gauge(PREFIX + "last_step", "Last optimizer step completed (the stall alert watches it)",
                                names, registry=self.registry).labels(**identity.labels())
        started = Gauge(PREFIX + "start_time_seconds", "Unix time this process started training",
                        names, registry=self.registry).labels(**identity.labels())
        started.set(time.time())
        self._last_step.set(start_step)
        for gauge in self._gauges.values():
            gauge.set(math.nan)  # nothing measured yet (0 would read as "0 samples/s")
        self.host = cfg.host or _node_address()
        self.server = None
        self.target_file: Path | None = None
        try:
            self.server, self._thread = start_http_server(cfg.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            log.warning("prometheus: cannot listen on %s:%d (%s); this run's metrics are not served "
                        "(metrics.jsonl has them)", self.host, cfg.port, exc.strerror or exc)
            return
        self.port = int(self.server.server_port)
        log.info("prometheus: serving training metrics on http://%s:%d/metrics", self.host, self.port)
        targets = cfg.targets_dir or env.get(TARGETS_ENV, "")
        if targets:
            self.target_file = _write_target(Path(targets), identity, f"{self.host}:{self.port}")

    @property
    def url(self) -> str | None:
        return None if self.server is None else f"http://{self.host}:{self.port}/metrics"

    def advance(self, step: int) -> None:
        self._last_step.set(step)

    def log(self, step: int, values: dict[str, Any]) -> None:
        self._last_step.set(step)
        for key, gauge in self._gauges.items():
            if key in values:
                value = values[key]
                gauge.set(math.nan if value is None else float(value))

    def log_image(self, step: int, tag: str, image: Any, path: Path | None = None) -> None:
        """Images are not metrics."""

    def close(self, status: str = "FINISHED") -> None:
        if self.target_file is not None:
            self.target_file.unlink(missing_ok=True)
            self.target_file = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _node_address() -> str:
    """This node's address as the other nodes reach it: its hostname's (HyperPod's /etc/hosts
    names each node by its cluster-subnet address)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _write_target(directory: Path, identity: RunIdentity, target: str) -> Path | None:
    """``<dir>/<job>-<node>-<port>.json``, written whole (temp file + rename: the collector
    re-reads the directory whenever it changes and must never see half a file)."""
    name = f"{identity.job_id}-{identity.node}-{target.rsplit(':', 1)[1]}.json"
    path = directory / name
    if not directory.is_dir():  # observability=false: the platform made no such directory
        log.info("prometheus: no discovery directory %s; no collector will scrape this run", directory)
        return None
    tmp = directory / f".{name}.tmp"
    body = json.dumps([{"targets": [target], "labels": identity.labels()}])
    try:
        tmp.write_text(body)
        tmp.chmod(0o644)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("prometheus: cannot write the discovery file %s (%s); the collector will not scrape "
                    "this run (its metrics are still served and in metrics.jsonl)", path, exc.strerror or exc)
        tmp.unlink(missing_ok=True)
        return None
    log.info("prometheus: discovery file %s", path)
    return path
