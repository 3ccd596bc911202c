"""Experiment tracking on MLflow (``tracking.backend: mlflow``), off the training thread.

What a run sends: its resolved config and provenance as params (and whole, as ``config.json``),
every logged step's metrics (with their step and time), the validation grids, and at the end
``metrics.jsonl``; the run ends FINISHED, KILLED (stopped by a signal) or FAILED.

The failure path comes first: the loop only appends to a queue; one worker thread talks to
the server. A server that does not answer (down, unreachable, refusing) never stops or slows
training: the first failure is ONE warning, the worker keeps what is pending (in memory; every
metric is in metrics.jsonl anyway) and tries again every ``retry_s``, so a server that comes
back receives the missing steps with their original step numbers and times (backfill). At the
end of the run it waits at most ``close_timeout_s`` for what is pending, then says in one line
what was not sent. Each request is bounded by ``timeout_s`` and not retried by MLflow itself
(MLFLOW_HTTP_REQUEST_TIMEOUT / MLFLOW_HTTP_REQUEST_MAX_RETRIES, set when the user has not).

URIs: any MLflow tracking URI; a SageMaker managed MLflow tracking server by its ARN through the
sagemaker-mlflow plugin (installed with the training package; it signs requests with the
node's credentials, https://docs.aws.amazon.com/sagemaker/latest/dg/mlflow-track-experiments.html).
A resumed run (same output_dir, same URI) continues the same MLflow run (``mlflow-run.json``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from training.observability.config import TrackingConfig
from training.observability.identity import RunIdentity

log = logging.getLogger(__name__)
RUN_FILE = "mlflow-run.json"
#: MLflow's limits (mlflow/utils/validation.py): 100 params and 1000 metrics per log_batch,
#: 6000 characters per param value
MAX_PARAMS, MAX_METRICS, MAX_PARAM_VALUE = 100, 1000, 6000


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts -> dotted keys; lists and scalars as JSON text (MLflow params are strings)."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    text = tree if isinstance(tree, str) else json.dumps(tree)
    return {prefix.rstrip("."): text[:MAX_PARAM_VALUE]}


class MlflowTracker:
    def __init__(self, cfg: TrackingConfig, identity: RunIdentity, *, run_config: dict[str, Any],
                 provenance: dict[str, Any], output_dir: str | Path) -> None:
        from mlflow.tracking import MlflowClient

        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(cfg.timeout_s))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        self.cfg, self.identity = cfg, identity
        self.uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not self.uri:
            from training.errors import UserError

            raise UserError("tracking.uri: empty and MLFLOW_TRACKING_URI is not set; give the MLflow tracking "
                            "URI (http://host:5000, or the SageMaker tracking server ARN) or set tracking.backend=none")
        import mlflow

        # The sagemaker-mlflow plugin adds its routing header from the *global* tracking URI
        # (sagemaker_mlflow/mlflow_sagemaker_request_header_provider.py: set_arn(get_tracking_uri())),
        # so the global URI must be ours; for a URI that is not an ARN its provider fails on every
        # request and MLflow logs that failure each time: silenced, it concerns only ARNs.
        mlflow.set_tracking_uri(self.uri)
        if not self.uri.startswith("arn:"):
            logging.getLogger("mlflow.tracking.request_header.registry").setLevel(logging.ERROR)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.output_dir = Path(output_dir)
        self.run_id: str | None = None
        self.unsent_warned = False
        self._params = flatten({"config": run_config, "provenance": provenance})
        self._config = run_config
        self._pending: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        # The run is made before training starts (it shows in MLflow from step 0); a server that
        # does not answer now is the same one warning, and the worker makes the run later.
        try:
            self._start_run()
        except Exception as exc:  # noqa: BLE001 - any failure of the server or the network
            self._failed(exc)
        self._thread = threading.Thread(target=self._work, name="mlflow-tracker", daemon=True)
        self._thread.start()

    # ---- the loop's side: append only ----------------------------------------------------
    def _put(self, item: tuple[str, Any]) -> None:
        with self._wake:
            self._pending.append(item)
            self._wake.notify()

    def advance(self, step: int) -> None:
        """Per step: nothing (metrics go at logging steps)."""

    def log(self, step: int, values: dict[str, Any]) -> None:
        numbers = {k: float(v) for k, v in values.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        self._put(("metrics", (step, int(time.time() * 1000), numbers)))

    def log_image(self, step: int, tag: str, image: Any, path: Path | None = None) -> None:
        if path is not None:
            self._put(("artifact", (Path(path), os.path.dirname(tag) or None)))

    #: seconds a failing run waits for the tracker: a failure must end the process within
    #: seconds (training/failure/), whatever the server does
    FAILED_CLOSE_S = 2.0

    def close(self, status: str = "FINISHED") -> None:
        """End the run: metrics.jsonl as an artifact, the status; wait ``close_timeout_s`` at most
        (``FAILED_CLOSE_S`` when the run failed)."""
        metrics = self.output_dir / "metrics.jsonl"
        if metrics.exists():
            self._put(("artifact", (metrics, None)))
        self._put(("end", status))
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(min(self.cfg.close_timeout_s, self.FAILED_CLOSE_S) if status == "FAILED"
                          else self.cfg.close_timeout_s)
        with self._wake:
            left = len(self._pending)
            self._pending.clear()  # the worker, if still waiting on a request, stops after it
        if left:
            log.warning("mlflow: %d updates of run %s were not sent to %s (the server did not answer); "
                        "every metric is in %s", left, self.run_id or "(not created)", self.uri, metrics)

    # ---- the worker ------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if not self._pending:
                    return
            try:
                self._send_pending()
            except Exception as exc:  # noqa: BLE001 - any failure of the server or the network
                self._failed(exc)
                with self._wake:
                    if self._closing:
                        return
                    self._wake.wait(self.cfg.retry_s)  # close() wakes it for one last try

    def _failed(self, exc: Exception) -> None:
        if not self.unsent_warned:
            self.unsent_warned = True
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("mlflow: %s does not answer (%s); training goes on, metrics stay in metrics.jsonl and "
                        "are sent when it answers again (tried every %g s)", self.uri, first[:300], self.cfg.retry_s)

    def _send_pending(self) -> None:
        if self.run_id is None:
            self._start_run()
        while True:
            with self._wake:
                if not self._pending:
                    return
                kind, payload = self._pending[0]
                batch = [payload]
                if kind == "metrics":  # several logging steps in one request
                    while (len(batch) < len(self._pending) and self._pending[len(batch)][0] == "metrics"
                           and sum(len(b[2]) for b in batch) < MAX_METRICS - 64):
                        batch.append(self._pending[len(batch)][1])
            self._send(kind, batch)
            with self._wake:
                for _ in batch:
                    if self._pending:
                        self._pending.popleft()

    def _send(self, kind: str, batch: list[Any]) -> None:
        from mlflow.entities import Metric

        if kind == "metrics":
            self.client.log_batch(self.run_id, metrics=[Metric(key, value, ts, step) for step, ts, numbers in batch
                                                         for key, value in numbers.items()])
        elif kind == "artifact":
            for path, artifact_path in batch:
                if path.exists():
                    self.client.log_artifact(self.run_id, str(path), artifact_path)
        elif kind == "end":
            self.client.set_terminated(self.run_id, status=batch[0])

    def _start_run(self) -> None:
        from mlflow.entities import Param

        record = self.output_dir / RUN_FILE
        previous = _read_json(record)
        if previous.get("tracking_uri") == self.uri and previous.get("run_id"):
            run = self.client.get_run(previous["run_id"])  # a resumed run continues its MLflow run
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            log.info("mlflow: continuing run %s at %s", self.run_id, self.uri)
            return
        experiment = self.client.get_experiment_by_name(self.cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.cfg.experiment)
        run = self.client.create_run(experiment_id, run_name=self.identity.run_name,
                                     tags={f"sana.{k}": v for k, v in self.identity.labels().items()})
        run_id = run.info.run_id
        params = [Param(k, v) for k, v in sorted(self._params.items())]
        for i in range(0, len(params), MAX_PARAMS):
            self.client.log_batch(run_id, params=params[i:i + MAX_PARAMS])
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps(self._config, indent=2, default=str))
            self.client.log_artifact(run_id, str(config), None)
        self.run_id = run_id
        body = json.dumps({"run_id": run_id, "tracking_uri": self.uri, "experiment": self.cfg.experiment})
        part = record.with_name(f".{RUN_FILE}.part")
        part.write_text(body)
        part.replace(record)
        log.info("mlflow: run %s (%s) in experiment %r at %s", run_id, self.identity.run_name,
                 self.cfg.experiment, self.uri)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
