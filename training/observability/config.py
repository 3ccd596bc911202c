"""The ``prometheus`` and ``tracking`` sections of TrainConfig (what rank 0 tells the outside)."""

from __future__ import annotations

import dataclasses
import re

TRACKING_BACKENDS = ("none", "mlflow")
#: Prometheus label values must be UTF-8; ours also become file names and MLflow run names
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclasses.dataclass(kw_only=True)
class PrometheusConfig:
    """Rank 0 serves its training metrics over HTTP for the cluster's collector.

    The port is the job's own (a free one unless ``port`` is set) and the collector finds it
    through a file-discovery target file rank 0 writes into ``targets_dir`` (see
    training/observability/prometheus.py for why a port per job and not a textfile)."""

    #: serve /metrics on rank 0
    enabled: bool = True
    #: address to listen on and to advertise; "" = this node's address (its hostname's)
    host: str = ""
    #: TCP port; 0 = a free one (several jobs can share a node)
    port: int = 0
    #: where the discovery file goes; "" = $SANA_METRICS_TARGETS_DIR (training/slurm/launch.sh
    #: sets <fsx>/observability/targets), unset = no file (metrics served, not collected)
    targets_dir: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"prometheus.port: {self.port} is not a TCP port (0 = a free one)")


@dataclasses.dataclass(kw_only=True)
class TrackingConfig:
    """Experiment tracking: ``backend: mlflow`` logs the run to an MLflow tracking server.

    A server that does not answer never stops training: one warning, the metrics stay in
    metrics.jsonl and are sent later (training/observability/tracking.py)."""

    #: none | mlflow
    backend: str = "none"
    #: tracking URI: http(s)://..., a SageMaker MLflow tracking server ARN (sagemaker-mlflow
    #: plugin), or "" = $MLFLOW_TRACKING_URI
    uri: str = ""
    #: MLflow experiment (created when missing)
    experiment: str = "sana"
    #: the run's name in MLflow and in the Prometheus labels; "" = the output_dir's last part
    run_name: str = ""
    #: seconds one request to the server may take
    timeout_s: float = 10.0
    #: seconds between tries while the server does not answer (what is pending is sent then)
    retry_s: float = 30.0
    #: seconds the end of the run waits to send what is still pending
    close_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in TRACKING_BACKENDS:
            raise ValueError(f"tracking.backend: {self.backend!r}; choose one of {', '.join(TRACKING_BACKENDS)}")
        if self.run_name and not RUN_NAME_RE.match(self.run_name):
            raise ValueError(f"tracking.run_name: {self.run_name!r}; use letters, digits, '.', '_' or '-' "
                             "(at most 128, starting with a letter or digit)")
        if not self.experiment:
            raise ValueError("tracking.experiment: must not be empty")
        for key in ("timeout_s", "retry_s", "close_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"tracking.{key}: must be > 0")
