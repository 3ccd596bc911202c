#!/usr/bin/env python3
"""The collector's configuration and a node's discovery file (observability step, stdlib only).

    python3 observability_config.py collector --fsx /fsx --remote-write URL --region R --cluster NAME \
        [--slurm-exporter HOST:PORT] [--scrape-interval 30s]
    python3 observability_config.py node-targets --node NAME --role ROLE --address IP --exporter node=9100 ...

The collector is Prometheus in agent mode on the controller (scrape, then remote write only;
https://prometheus.io/docs/prometheus/latest/feature_flags/#prometheus-agent): it signs its
remote writes with SigV4 as the node's execution role (remote_write ``sigv4``,
https://prometheus.io/docs/prometheus/latest/configuration/configuration/#remote_write), the
way Amazon Managed Service for Prometheus takes them
(https://docs.aws.amazon.com/prometheus/latest/userguide/AMP-onboard-ingest-metrics-remote-write.html).
What it scrapes, all by file-based discovery on FSx (every node sees the same files):
  <fsx>/observability/nodes/<node>.json    each node's exporters, written by its observability step
  <fsx>/observability/targets/*.json       each training job's rank 0 (training/observability/prometheus.py)
and the Slurm exporter next to it on the controller. Node-level targets carry ``node`` (the
Slurm node name) and ``role``, so the alert rules join GPU, NeuronCore and Slurm series by node.
Prometheus reads YAML, and JSON is YAML: printed as JSON so no YAML library is needed here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

INTERVAL = re.compile(r"^[1-9][0-9]*[smh]$")
JOB_NAMES = {"node": "node", "dcgm": "dcgm", "neuron": "neuron", "slurm": "slurm"}


def collector(args: argparse.Namespace) -> dict:
    fsx = args.fsx.rstrip("/")
    scrape = [
        {"job_name": "nodes", "file_sd_configs": [{"files": [f"{fsx}/observability/nodes/*.json"]}]},
        # honor_labels: the job's own job_id/user/run_name/node labels are the ones the alerts use.
        {"job_name": "sana-training", "honor_labels": True,
         "file_sd_configs": [{"files": [f"{fsx}/observability/targets/*.json"]}],
         # Any cluster user writes these files: a target is scraped at /metrics over http and
         # nothing else (discovery labels such as __metrics_path__ or __param_* would otherwise
         # choose the request), never at a link-local address (the instance metadata service,
         # which this root process could reach).
         "relabel_configs": [
             {"source_labels": ["__address__"], "regex": r"(169\.254\.|\[?fe80:).*", "action": "drop"},
             {"target_label": "__metrics_path__", "replacement": "/metrics"},
             {"target_label": "__scheme__", "replacement": "http"},
             {"regex": "__param_.*", "action": "labeldrop"},
         ]},
    ]
    if args.slurm_exporter:
        # honor_labels: the exporter's `node` (the Slurm node) must not become exported_node.
        scrape.append({"job_name": "slurm", "honor_labels": True,
                       "static_configs": [{"targets": [args.slurm_exporter], "labels": {"role": "controller"}}]})
    return {
        "global": {"scrape_interval": args.scrape_interval,
                   "external_labels": {"cluster": args.cluster}},
        "scrape_configs": scrape,
        "remote_write": [{"url": args.remote_write, "sigv4": {"region": args.region}}],
    }


def node_targets(args: argparse.Namespace) -> list:
    out = []
    for spec in args.exporter:
        name, _, port = spec.partition("=")
        if name not in JOB_NAMES or not port.isdigit() or not 0 < int(port) < 65536:
            raise SystemExit(f"--exporter {spec}: expected one of {', '.join(JOB_NAMES)}=<port>")
        out.append({"targets": [f"{args.address}:{port}"],
                    "labels": {"job": JOB_NAMES[name], "node": args.node, "role": args.role}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="observability_config.py")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collector")
    c.add_argument("--fsx", required=True)
    c.add_argument("--remote-write", required=True)
    c.add_argument("--region", required=True)
    c.add_argument("--cluster", required=True)
    c.add_argument("--slurm-exporter", default="")
    c.add_argument("--scrape-interval", default="30s")
    n = sub.add_parser("node-targets")
    n.add_argument("--node", required=True)
    n.add_argument("--role", required=True)
    n.add_argument("--address", required=True)
    n.add_argument("--exporter", action="append", default=[])
    args = parser.parse_args(argv)
    if args.command == "collector":
        if not INTERVAL.match(args.scrape_interval):
            raise SystemExit(f"--scrape-interval {args.scrape_interval}: expected e.g. 30s")
        if not args.remote_write.startswith(("https://", "http://")):
            raise SystemExit(f"--remote-write {args.remote_write}: not an http(s) URL")
        json.dump(collector(args), sys.stdout, indent=2)
    else:
        json.dump(node_targets(args), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
