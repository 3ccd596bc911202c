"""Quality parity beside cost: do the two platforms train the same model?

A cheaper platform is only the answer if it trains what the other one trains. Given the run
directories of the same recipe on both platforms (each with the loop's ``metrics.jsonl``,
training/metrics.py, and validation grids ``validation/step-XXXXXXXX.png``,
training/evaluation/validation.py), this overlays the loss curves against samples seen, states the gap
over the last N logged steps of each (within the samples range both runs cover) against the
noise of those steps, shows the two validation grids of the latest step both have side by
side, and flags a run that diverges.

Verdicts (``Parity.status``):
- ``diverged``: a loss is not finite, or a run's mean over its last N logged steps is above
  its mean over its first N (training made it worse);
- ``within``: the relative gap of the two last-N means is at most ``tolerance``;
- ``apart``: the gap is larger than the tolerance and than twice its standard error (the
  logged losses are single-step values, noisy by the timestep and noise draws);
- ``inconclusive``: larger than the tolerance but within noise, too few points, or no overlap.

Only ``within`` counts as loss parity, and loss parity is not image-quality parity: the
report says so and puts the grids beside each other for a person to look at.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import statistics
from pathlib import Path

from training.errors import UserError

GRID = re.compile(r"^step-(\d+)\.png$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Curve:
    label: str
    path: Path  # the run directory
    steps: list[int]
    samples: list[float]
    loss: list[float]
    grids: dict[int, Path]

    @property
    def samples_per_step(self) -> float:
        return self.samples[-1] / self.steps[-1]


def load_run(path: str | Path, label: str) -> Curve:
    """A run directory (or its metrics.jsonl): the last record per step, ordered by step."""
    path = Path(path)
    run = path.parent if path.name == "metrics.jsonl" else path
    metrics = run / "metrics.jsonl"
    try:
        text = metrics.read_text()
    except OSError as exc:
        raise UserError(f"--parity-runs {path}: cannot read {metrics} ({exc.strerror}); give a training run "
                        "directory (its output_dir)") from None
    records: dict[int, dict] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if n == len(text.splitlines()):
                continue  # a last line cut short by a killed run
            raise UserError(f"--parity-runs {path}: {metrics} line {n} is not JSON") from None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and "loss" in rec and "samples_seen" in rec:
            records[rec["step"]] = rec  # a resumed run logs a step again: the last one counts
    if not records:
        raise UserError(f"--parity-runs {path}: {metrics} has no logged step with loss and samples_seen; give the "
                        "output_dir of a run that logged (log_every)")
    steps = sorted(records)
    grids = {int(m.group(1)): p for p in sorted((run / "validation").glob("step-*.png")) if (m := GRID.match(p.name))}
    return Curve(label=label, path=run, steps=steps, samples=[float(records[s]["samples_seen"]) for s in steps],
                 loss=[float(records[s]["loss"]) for s in steps], grids=grids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parity:
    a: Curve
    b: Curve
    last_n: int
    tolerance: float
    status: str  # within | apart | inconclusive | diverged
    reason: str
    mean_a: float | None = None
    mean_b: float | None = None
    rel_gap: float | None = None
    se: float | None = None
    diverging: tuple[str, ...] = ()

    @property
    def proven(self) -> bool:
        return self.status == "within"


def divergence(c: Curve, n: int, tolerance: float) -> str | None:
    """Why ``c`` diverges, or None."""
    bad = next((s for s, v in zip(c.steps, c.loss, strict=True) if not math.isfinite(v)), None)
    if bad is not None:
        return f"{c.label}: loss is not finite at step {bad}"
    k = max(1, min(n, len(c.loss) // 2))
    first, last = statistics.fmean(c.loss[:k]), statistics.fmean(c.loss[-k:])
    if last > first * (1 + tolerance):
        return f"{c.label}: loss rose from {first:.4g} (first {k} logged steps) to {last:.4g} (last {k})"
    return None


def compare(a: Curve, b: Curve, *, last_n: int = 5, tolerance: float = 0.05) -> Parity:
    if last_n < 2 or not 0 < tolerance < 1:
        raise UserError(f"--parity-last {last_n} / --parity-tolerance {tolerance:g}: need N >= 2 and 0 < tolerance < 1")
    diverging = tuple(d for d in (divergence(a, last_n, tolerance), divergence(b, last_n, tolerance)) if d)
    if diverging:
        return Parity(a=a, b=b, last_n=last_n, tolerance=tolerance, status="diverged", reason="; ".join(diverging),
                      diverging=diverging)
    lo, hi = max(a.samples[0], b.samples[0]), min(a.samples[-1], b.samples[-1])
    tail_a = [v for s, v in zip(a.samples, a.loss, strict=True) if lo <= s <= hi][-last_n:]
    tail_b = [v for s, v in zip(b.samples, b.loss, strict=True) if lo <= s <= hi][-last_n:]
    if min(len(tail_a), len(tail_b)) < 2:
        return Parity(a=a, b=b, last_n=last_n, tolerance=tolerance, status="inconclusive",
                      reason=f"the runs share {min(len(tail_a), len(tail_b))} logged point(s) in samples "
                             f"{lo:,.0f}-{hi:,.0f}; log more steps or train both to the same length")
    mean_a, mean_b = statistics.fmean(tail_a), statistics.fmean(tail_b)
    rel = abs(mean_a - mean_b) / ((mean_a + mean_b) / 2)
    se = math.sqrt(statistics.variance(tail_a) / len(tail_a) + statistics.variance(tail_b) / len(tail_b))
    if rel <= tolerance:
        status, reason = "within", f"the gap is {rel:.1%}, within the {tolerance:.0%} tolerance"
    elif abs(mean_a - mean_b) > 2 * se:
        status, reason = "apart", (f"the gap is {rel:.1%}, above the {tolerance:.0%} tolerance and more than twice "
                                   f"its standard error ({se:.3g})")
    else:
        status, reason = "inconclusive", (f"the gap is {rel:.1%}, above the {tolerance:.0%} tolerance but within twice "
                                          f"its standard error ({se:.3g}): log more steps")
    return Parity(a=a, b=b, last_n=min(len(tail_a), len(tail_b)), tolerance=tolerance, status=status, reason=reason,
                  mean_a=mean_a, mean_b=mean_b, rel_gap=rel, se=se)


def sentence(p: Parity | None) -> str:
    """What the recommendation says about quality."""
    if p is None:
        return ("Quality parity is unproven: no training runs of the same recipe on both platforms were compared, and "
                "a cheaper platform is only the answer if it trains the same model (pass --parity-runs GPU_RUN "
                "TRN_RUN).")
    if p.status == "diverged":
        return f"**Quality parity fails: a run diverges** ({p.reason}); do not decide on cost until it trains."
    if p.status == "within":
        return (f"Training-loss parity holds: {p.reason} over the last {p.last_n} logged steps; image quality is not "
                "measured, so compare the validation grids (section Quality parity) before deciding.")
    return f"Quality parity is unproven: {p.reason} (section Quality parity)."


def section(p: Parity, out: Path, *, px: tuple[int, int], dpi: int) -> list[str]:
    """The report's quality-parity section; writes ``parity.png`` and copies the grids next to it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(px[0] / dpi, px[1] / dpi), dpi=dpi)
    for c, style in ((p.a, "-o"), (p.b, "--s")):
        ax.plot(c.samples, [v if math.isfinite(v) else float("nan") for v in c.loss], style, ms=3, label=c.label)
    ax.set(xlabel="samples seen", ylabel="training loss (logged steps)", title="Loss against samples seen")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.subplots_adjust(bottom=0.12, top=0.9)
    fig.savefig(out / "parity.png", dpi=dpi)
    plt.close(fig)
    flag = "**Diverging:** " + "; ".join(p.diverging) + "." if p.diverging else ""
    lines = ["## Quality parity", "", f"Runs: {p.a.label} `{p.a.path}` and {p.b.label} `{p.b.path}` "
             f"({p.a.samples_per_step:g} and {p.b.samples_per_step:g} samples per step).", ""]
    lines += [flag, ""] if flag else []
    lines += ["![parity](parity.png)", ""]
    if p.mean_a is not None and p.mean_b is not None:
        lines += [f"Mean loss over the last {p.last_n} logged steps both runs cover: {p.a.label} {p.mean_a:.4g}, "
                  f"{p.b.label} {p.mean_b:.4g}; **{p.status}**: {p.reason}.", ""]
    else:
        lines += [f"**{p.status}**: {p.reason}.", ""]
    common = sorted(set(p.a.grids) & set(p.b.grids))
    if common:
        step = common[-1]
        names = []
        for i, c in enumerate((p.a, p.b), 1):
            names.append(f"parity-grid-{i}-step-{step:08d}.png")
            shutil.copyfile(c.grids[step], out / names[-1])
        lines += [f"Validation grids at step {step} (the latest both runs rendered; same prompts and noise):", "",
                  f"| {p.a.label} | {p.b.label} |", "|---|---|", f"| ![]({names[0]}) | ![]({names[1]}) |", ""]
    else:
        lines += ["No validation step both runs rendered, so no grids to compare (set validation.every_steps the "
                  "same on both).", ""]
    lines.append("Loss parity is not image-quality parity: the same loss can come with different images, so look at "
                 "the grids, and evaluate the exported models on your own prompts before switching platforms.")
    return lines
