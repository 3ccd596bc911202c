"""Training metrics out: JSON lines (always), TensorBoard (optional), a progress bar when
a person is watching (stderr is a TTY) and a plain log line otherwise (Slurm logs), and the
sinks of training/observability (Prometheus gauges, an MLflow run) when configured.

Only rank 0 writes; other ranks get a logger whose methods do nothing.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("training")


class MetricsLogger:
    """Args:
        output_dir: run directory; writes ``metrics.jsonl`` and ``tensorboard/`` there.
        enabled: False on every rank but 0.
        tensorboard: also write TensorBoard scalars.
        total_steps / start_step: for the progress bar.
        sinks: also fed every record, step and image (training/observability ``build_sinks``).
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, tensorboard: bool, total_steps: int,
                 start_step: int = 0, sinks: Sequence[Any] = ()) -> None:
        self.enabled = enabled
        self._sinks = list(sinks) if enabled else []
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        keep_through(self.path, start_step)
        self._jsonl = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events at or after it that an earlier writer
            # left (https://docs.pytorch.org/docs/stable/tensorboard.html, SummaryWriter
            # ``purge_step``), i.e. the steps after the checkpoint this run resumed from.
            self._tb = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def advance(self, step: int) -> None:
        """Called every optimizer step (host-only: no device reads)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
        for sink in self._sinks:
            sink.advance(step)

    def log(self, step: int, values: dict[str, Any]) -> None:
        """One record: JSON line + TensorBoard scalars + bar postfix or a log line."""
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), **values}
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        numbers = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(f"train/{key}", value, step)
        for sink in self._sinks:
            sink.log(step, values)
        short = {k: _fmt(v) for k, v in numbers.items()
                 if k in ("loss", "grad_norm", "lr", "samples_per_s", "mfu")}
        if self._bar is not None:
            self._bar.set_postfix(short, refresh=False)
        else:
            log.info("step %d %s", step, " ".join(f"{k}={v}" for k, v in short.items()))

    def log_image(self, step: int, tag: str, image: Any, path: Path | None = None) -> None:
        """An HWC uint8 image (a validation grid) to TensorBoard, and its saved file (``path``)
        to the sinks that keep artifacts."""
        if self._tb is not None:
            self._tb.add_image(tag, image, step, dataformats="HWC")
            self._tb.flush()
        for sink in self._sinks:
            sink.log_image(step, tag, image, path)

    def close(self, status: str = "FINISHED") -> None:
        """``status``: how the run ended (FINISHED, KILLED by a stop signal, FAILED), for the sinks."""
        for sink in self._sinks:
            sink.close(status)
        self._sinks = []
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._bar = self._tb = self._jsonl = None


ABANDONED = "metrics-abandoned.jsonl"


def keep_through(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to ``step`` (the step a run starts or resumes at).

    The ones after it belong to a trajectory that was abandoned: the steps after the
    checkpoint a crashed or preempted run resumes from, which the resumed run logs again, or a
    whole earlier run in the same directory for a fresh start. They move to
    ``metrics-abandoned.jsonl`` beside it (nothing is lost), so metrics.jsonl has one line per
    logged step. A cut last line (a crash mid-write) goes there too."""
    if not path.exists():
        return
    kept, dropped = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            keep = line.endswith("\n") and int(json.loads(line)["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        (kept if keep else dropped).append(line if line.endswith("\n") else line + "\n")
    if not dropped:
        return
    with open(path.with_name(ABANDONED), "a") as fh:
        fh.writelines(dropped)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def _fmt(value: float) -> str:
    if isinstance(value, int) or value == 0 or not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"
