"""What rank 0 tells the outside while it trains: Prometheus gauges (training/observability/
prometheus.py) and an experiment tracker (tracking.py), as sinks of training/metrics.py's
MetricsLogger. Off is an object that does nothing, so the loop has no branch for either."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from training.observability.config import PrometheusConfig, TrackingConfig
from training.observability.identity import RunIdentity, run_identity

__all__ = ["MetricsSink", "PrometheusConfig", "RunIdentity", "TrackingConfig", "build_sinks", "run_identity"]


class MetricsSink(Protocol):
    def advance(self, step: int) -> None: ...
    def log(self, step: int, values: dict[str, Any]) -> None: ...
    def log_image(self, step: int, tag: str, image: Any, path: Path | None = None) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


def build_sinks(*, prometheus: PrometheusConfig, tracking: TrackingConfig, output_dir: str, is_main: bool,
                start_step: int, run_config: dict[str, Any], provenance: dict[str, Any]) -> list[MetricsSink]:
    """The sinks rank 0 feeds; none elsewhere or when both are off."""
    if not is_main:
        return []
    identity = run_identity(output_dir, tracking.run_name)
    sinks: list[MetricsSink] = []
    if prometheus.enabled:
        from training.observability.prometheus import PrometheusExporter

        sinks.append(PrometheusExporter(prometheus, identity, start_step=start_step))
    if tracking.backend == "mlflow":
        from training.observability.tracking import MlflowTracker

        sinks.append(MlflowTracker(tracking, identity, run_config=run_config, provenance=provenance,
                                   output_dir=output_dir))
    return sinks
