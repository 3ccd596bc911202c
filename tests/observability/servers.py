"""Real servers on loopback for tests/observability: Debian's prometheus (server, agent and
remote-write receiver), prometheus-node-exporter, and an MLflow tracking server from PyPI in
.venv-mlflow (`make setup-mlflow`). Each runs in its own process group and is stopped by the
test that started it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import REPO, free_port, skip_or_fail

MLFLOW = REPO / ".venv-mlflow" / "bin" / "mlflow"


def binary(name: str) -> str:
    """A Debian tool (scripts/install-system-packages.sh installs it), or skip/fail."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail(f"{name} is not installed (make setup: scripts/install-system-packages.sh)",
                     required_by="SANA_REQUIRE_ALL")
    return path


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer in {timeout}s") from None
            time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@contextmanager
def prometheus(workdir: Path, config: dict, *extra: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """A Prometheus (server unless ``extra`` says agent) with ``config``; yields its base URL."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    storage = "--storage.agent.path" if "--enable-feature=agent" in extra else "--storage.tsdb.path"
    log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                             f"{storage}={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}", *extra],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/-/ready", proc)
        yield url
    finally:
        stop(proc)
        log.close()


def query(url: str, promql: str) -> list[dict]:
    """An instant PromQL query; the result vector."""
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}",
                                timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_query(url: str, promql: str, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        result = query(url, promql)
        if result:
            return result
        assert time.monotonic() < deadline, f"{promql} returned nothing from {url} in {timeout}s"
        time.sleep(0.5)


class MlflowServer:
    """``mlflow server`` with a SQLite store and served artifacts, on a fixed port so that a
    stopped server can come back at the same URI."""

    def __init__(self, workdir: Path) -> None:
        if not MLFLOW.exists():
            skip_or_fail(".venv-mlflow is not built (make setup-mlflow)", required_by="SANA_REQUIRE_ALL")
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        log = open(self.workdir / "mlflow.log", "a")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
             "--artifacts-destination", str(self.workdir / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.workdir,
            env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")})
        wait_http(self.uri + "/health", self.proc, timeout=120)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None
