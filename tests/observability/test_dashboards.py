"""Every dashboard in observability/dashboards parses as a Grafana dashboard, and every panel's
query is PromQL that promtool accepts (each becomes a recording rule of a generated rule file,
`promtool check rules`), with Grafana's variables replaced the way Grafana expands them. Every
metric a dashboard or an alert names is one an exporter we deploy publishes: checked against a
real node exporter's and a real training job exporter's output here, and against the sources
cited below for the exporters that need a GPU, a NeuronCore or Slurm."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path

import yaml

from stacks.observability_rules import RULES_FILE, dashboards
from tests.conftest import free_port
from tests.observability.servers import binary, stop, wait_http
from training.observability.config import PrometheusConfig
from training.observability.identity import RunIdentity
from training.observability.prometheus import PrometheusExporter

# Grafana's built-in and our template variables, as Grafana substitutes them in a query.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "30s", "$node": ".*", "$job_id": ".*"}
#: metrics of exporters that cannot run here, from their sources:
#: NVIDIA/dcgm-exporter etc/default-counters.csv (DCGM_FI_DEV_*), the Neuron docs'
#: neuron-monitor-prometheus.py output (neuroncore_utilization_ratio, neuron_runtime_memory_used_bytes),
#: sckyzo/slurm_exporter docs/metrics.md (slurm_node_*), and this repo's textfile writer
#: lifecycle_scripts/node_counters.py (sana_efa_*, sana_lustre_client_*), tested in tests/lifecycle.
CITED = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_XID_ERRORS",
         "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "neuroncore_utilization_ratio",
         "neuron_runtime_memory_used_bytes", "slurm_node_status", "slurm_node_cpu_alloc",
         "sana_efa_rx_bytes_total", "sana_efa_tx_bytes_total", "sana_efa_rdma_read_bytes_total",
         "sana_efa_rdma_write_bytes_total", "sana_lustre_client_read_bytes_total",
         "sana_lustre_client_write_bytes_total", "up"}
FUNCTIONS = {"count", "by", "max", "min", "avg", "sum", "rate", "changes", "time", "vector", "or", "and", "on",
             "label_values", "humanizePercentage", "without", "bool", "offset"}


def expand(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown variable in {expr}"
    return expr


def panel_queries() -> dict[str, str]:
    out = {}
    for name, path in dashboards().items():
        board = json.loads(path.read_text())
        assert board["uid"].startswith("sana-") and board["panels"], name
        for panel in board["panels"]:
            assert panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                out[f"{name}/{panel['title']}/{target['refId']}"] = target["expr"]
    return out


def metric_names(expr: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", without_strings)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", without_labels))
    grouping = set(re.findall(r"(?:by|on|without)\s*\(([^)]*)\)", without_strings))
    labels = {label.strip() for group in grouping for label in group.split(",")}
    return {w for w in words - FUNCTIONS - labels if not re.fullmatch(r"\d+[smhd]?|e", w)}


def test_every_dashboard_parses_and_every_query_is_promql(tmp_path: Path) -> None:
    assert set(dashboards()) == {"cluster", "accelerators", "training"}
    queries = panel_queries()
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": "dashboard:" + re.sub(r"[^a-zA-Z0-9_]", "_", key).lower(), "expr": expand(expr)}
        for key, expr in queries.items()]}]}
    (tmp_path / "dashboards.yaml").write_text(yaml.safe_dump(rules))
    done = subprocess.run([binary("promtool"), "check", "rules", str(tmp_path / "dashboards.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(queries)} rules found" in done.stdout


def test_a_broken_query_is_caught(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "dashboard:bad", "expr": expand("sum by (node (rate(node_cpu_seconds_total[$__rate_interval]))")}]}]}))
    done = subprocess.run([binary("promtool"), "check", "rules", str(tmp_path / "bad.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_every_metric_named_is_published_by_an_exporter_we_deploy(tmp_path: Path) -> None:
    named = set()
    for expr in panel_queries().values():
        named |= metric_names(expand(expr))
    for group in yaml.safe_load(RULES_FILE.read_text())["groups"]:
        for rule in group["rules"]:
            named |= metric_names(rule["expr"])
    # A real node exporter (Debian's prometheus-node-exporter) on loopback.
    port = free_port()
    proc = subprocess.Popen([binary("prometheus-node-exporter"), f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            node = response.read().decode()
    finally:
        stop(proc)
    # A real training exporter (what rank 0 serves).
    exporter = PrometheusExporter(PrometheusConfig(host="127.0.0.1"), RunIdentity(job_id="1", user="u", run_name="r",
                                                                                   node="n"), start_step=0)
    try:
        with urllib.request.urlopen(exporter.url, timeout=10) as response:
            training = response.read().decode()
    finally:
        exporter.close()
    published = set(re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", node + training, re.M)) | CITED
    assert named - published == set(), f"named but published by nothing we deploy: {named - published}"
    assert {m for m in named if m.startswith("sana_training_")} <= set(re.findall(r"^(sana_training_\w+)\{",
                                                                                 training, re.M))
