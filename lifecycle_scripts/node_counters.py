#!/usr/bin/env python3
"""EFA and Lustre client counters as a node exporter textfile (stdlib only; run every 15 s by
sana-node-counters.timer, installed by lifecycle_scripts/observability.sh).

    python3 node_counters.py --out /var/lib/sana-observability/textfile/sana-node-counters.prom [--root /]

- EFA: every counter of every RDMA device's ports under /sys/class/infiniband/<dev>/ports/<n>/
  hw_counters/ (the EFA kernel driver's port statistics: tx_bytes, rx_bytes, rdma_read_bytes,
  rdma_write_bytes, ...; amzn-drivers kernel/linux/efa efa_verbs.c, the port stats table) as
  ``sana_efa_<counter>_total{device, port}``. The node exporter's own infiniband collector reads
  only ports/<n>/counters/, which EFA devices do not fill.
- FSx for Lustre: the client's read and write byte sums from llite stats (what
  ``lctl get_param llite.*.stats`` prints: "<name> <count> samples [<unit>] <min> <max> <sum>"),
  under /sys/kernel/debug/lustre/llite or /proc/fs/lustre/llite, as
  ``sana_lustre_client_{read,write}_bytes_total{fs}``.

The file is written whole (temp file + rename): the textfile collector reads *.prom files and
must never see half of one (node_exporter README, "Textfile Collector").
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

NAME = re.compile(r"^[a-z0-9_]+$")
#: settings, not counters, in the EFA port statistics
NOT_COUNTERS = {"lifespan"}
LLITE_DIRS = ("sys/kernel/debug/lustre/llite", "proc/fs/lustre/llite")


def efa_lines(root: Path) -> list[str]:
    out = []
    for counters in sorted((root / "sys/class/infiniband").glob("*/ports/*/hw_counters")):
        device, port = counters.parents[2].name, counters.parent.name
        for path in sorted(counters.iterdir()):
            if not NAME.match(path.name) or path.name in NOT_COUNTERS:
                continue
            try:
                value = int(path.read_text().strip())
            except (OSError, ValueError):
                continue
            out.append(f'sana_efa_{path.name}_total{{device="{device}",port="{port}"}} {value}')
    return out


def lustre_lines(root: Path) -> list[str]:
    out = []
    for base in LLITE_DIRS:
        for stats in sorted((root / base).glob("*/stats")):
            fs = stats.parent.name
            try:
                lines = stats.read_text().splitlines()
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if len(fields) >= 7 and fields[0] in ("read_bytes", "write_bytes") and fields[2] == "samples":
                    out.append(f'sana_lustre_client_{fields[0]}_total{{fs="{fs}"}} {int(fields[6])}')
        if out:
            break
    return out


def render(root: Path) -> str:
    efa, lustre = efa_lines(root), lustre_lines(root)
    samples = efa + lustre
    lines = []
    for name in sorted({line.split("{")[0] for line in samples}):  # each metric's samples together
        lines.append(f"# TYPE {name} counter")
        lines.extend(line for line in samples if line.split("{")[0] == name)
    return "\n".join(lines) + ("\n" if lines else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_counters.py")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--root", default="/", type=Path, help="the node's root (tests: a pretend node)")
    args = parser.parse_args(argv)
    text = render(args.root)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
