"""Deployment smoke test: does this HyperPod cluster really run Sana jobs?

``sbatch training/slurm/smoke.sbatch`` runs ``python -m training.smoke run`` on one node; it
checks the cluster (Slurm partitions and node states, every node's lifecycle status file,
FSx flock, S3 with the execution role), submits one 2-node job per accelerator partition
(GPU all-reduce over NCCL with the EFA plugin proven from NCCL's own log; Trainium
all-reduce with ``training.smoke.trn`` plus the Neuron version check on every node) and
prints ONE table, one row per check, exiting 1 on any FAIL. Operator guide: runbooks/deploy.md.

Layout: ``parse`` (pure parsers), ``checks`` (one function per check, each returning a
:class:`Row`), ``allreduce`` (the torchrun worker), ``__main__`` (the CLI).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PASS, FAIL, SKIP, WARN = "PASS", "FAIL", "SKIP", "WARN"


@dataclass(frozen=True)
class Row:
    """One line of the smoke table. ``detail`` is ONE line: on FAIL it names what is wrong
    and what to do (runbooks/deploy.md lists every FAIL line). WARN: an optional part that does
    not work (a node's container runtime, its accounting association); the job still passes."""

    check: str
    verdict: str
    detail: str

    def __post_init__(self) -> None:
        if self.verdict not in (PASS, FAIL, SKIP, WARN):
            raise ValueError(f"verdict {self.verdict!r}: use PASS, FAIL, SKIP or WARN")
        object.__setattr__(self, "detail", " ".join(self.detail.split()))


def render(rows: Iterable[Row]) -> str:
    """The table: fixed-width check and verdict columns, then the detail, one row per line."""
    rows = list(rows)
    width = max([len("check"), *(len(r.check) for r in rows)])
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  {'-' * 40}"]
    lines += [f"{r.check:<{width}}  {r.verdict:<6}  {r.detail}" for r in rows]
    failed = sum(r.verdict == FAIL for r in rows)
    skipped = sum(r.verdict == SKIP for r in rows)
    warned = sum(r.verdict == WARN for r in rows)
    lines.append(f"SMOKE {'FAIL' if failed else 'PASS'}: {len(rows) - failed - skipped - warned} passed, "
                 f"{failed} failed, {skipped} skipped" + (f", {warned} warnings" if warned else ""))
    return "\n".join(lines)


def exit_code(rows: Iterable[Row]) -> int:
    return 1 if any(r.verdict == FAIL for r in rows) else 0
