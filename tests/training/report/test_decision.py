"""The report's decision inputs (training/report/): stale prices warned about above the
recommendation, price scenarios against a hand computation, per-platform MFU bands with
their evidence, measured MFU replacing the band, and quality parity from two runs' metrics."""

from __future__ import annotations

import datetime
import json
import math
import random
from pathlib import Path

import pytest
from bench_fixtures import make_result
from PIL import Image

from training.metrics import MetricsLogger
from training.model import flops
from training.model.build import PRESETS
from training.report import cli
from training.report.build import build
from training.report.charts import CHART_PX
from training.report.inputs import Options
from training.report.prices import DEFAULT_PRICES, PriceTable

TODAY = datetime.date.today().isoformat()
F = 0.947e12  # make_result's train_flops_per_sample
R_P5, R_TRN1 = 8 * 989e12, 32 * 95e12  # instance peaks


def _prices(tmp_path: Path, *, checked: str | None = TODAY, verified: bool = True, ec2: bool = False) -> Path:
    c = "null" if checked is None else f'"{checked}"'
    text = f"""as_of: "{TODAY}"
currency: USD
region: test
prices:
  ml.p5.48xlarge: {{usd_per_hour: 100.0, source: "https://example.test/p5", checked: {c}, verified: {str(verified).lower()}}}
  ml.trn1.32xlarge: {{usd_per_hour: 25.0, source: "https://example.test/trn1", checked: {c}, verified: {str(verified).lower()}}}
"""
    if ec2:
        text += f"""ec2:
  p5.48xlarge: {{usd_per_hour: 50.0, source: "https://example.test/ec2", checked: "{TODAY}", verified: true}}
  trn1.32xlarge: {{usd_per_hour: 20.0, source: "https://example.test/ec2", checked: "{TODAY}", verified: true}}
"""
    path = tmp_path / f"prices-{checked}-{verified}-{ec2}.yaml"
    path.write_text(text)
    return path


def _runs(tmp_path: Path, gpu_mfu: float = 0.30, trn_mfu: float = 0.25) -> list[str]:
    datas = {"p5.json": make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="H100-SXM", nodes=1,
                                    per_node=8, sps_per_accel=gpu_mfu * 989e12 / F, peak=989.0, mfu=gpu_mfu),
             "trn1.json": make_result(backend="trainium", instance_type="ml.trn1.32xlarge",
                                      accelerator="NeuronCore-v2", nodes=1, per_node=32,
                                      sps_per_accel=trn_mfu * 95e12 / F, peak=95.0, mfu=trn_mfu)}
    for name, data in datas.items():
        (tmp_path / name).write_text(json.dumps(data))
    return [str(tmp_path / n) for n in datas]


def _report(tmp_path: Path, *args: str, runs: bool = True) -> str:
    out = tmp_path / "out"
    cli.main([*(_runs(tmp_path) if runs else ["--project"]), "--out", str(out), *args])
    return (out / "report.md").read_text()


# ----- prices: stale ones are warned about above the recommendation ----------------------------

def test_stale_prices_warn_above_the_recommendation(tmp_path):
    old = _report(tmp_path, "--prices", str(_prices(tmp_path, checked="2020-01-01")))
    head, rec = old.split("## Recommendation")
    days = (datetime.date.today() - datetime.date(2020, 1, 1)).days
    assert (f"> **Stale prices:** ml.p5.48xlarge (checked 2020-01-01, {days} days ago), ml.trn1.32xlarge "
            f"(checked 2020-01-01, {days} days ago) are older than 12 months or undated.") in head
    assert "Stale prices" not in rec
    fresh = _report(tmp_path, "--prices", str(_prices(tmp_path)))
    assert "Stale prices" not in fresh
    undated = _report(tmp_path, "--prices", str(_prices(tmp_path, checked=None, verified=False)))
    assert "ml.p5.48xlarge (undated), ml.trn1.32xlarge (undated)" in undated.split("## Recommendation")[0]
    assert "| ml.p5.48xlarge | SageMaker HyperPod (ml.* instance price) | test | $100.000 | price table | undated | " \
           "**no** | https://example.test/p5 |" in undated


def test_a_verified_price_needs_a_date(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _report(tmp_path, "--prices", str(_prices(tmp_path, checked=None, verified=True)))
    err = capsys.readouterr().err.strip()
    assert "key prices.ml.p5.48xlarge.checked: give the date" in err and "(a verified figure needs one)" in err


#: training/prices.yaml `platform` entries for which no dated public source was found when the
#: table was re-checked (2026-12-04, from stored copies of public pages and repositories); each
#: keeps its figure with `checked: null`, `verified: false` and a note starting "UNDATED:".
UNDATED_PLATFORM = {
    "node_ebs": "what HyperPod bills per GB-month of an instance group's EBS volume: the dated AWS "
                "Price List extracts found carry SageMaker instance prices only",
    "rds_snapshot_storage": "Aurora backup storage per GB-month: no dated copy of the rate was found",
}


def test_shipped_table_is_dated_within_12_months_cited_and_turns_stale_on_its_own(tmp_path):
    """Every figure of training/prices.yaml (decision prices, EC2 comparison, serving, platform)
    carries a public source and a date no more than 12 months before the table's re-check date, which is
    not in the future; estimates say so; and once a year has passed since an entry's date, a
    report built from the table warns about it (today injected, nothing else changed)."""
    from training.report.assemble import DecisionOptions
    from training.report.serving import serving_prices

    table = PriceTable.load(DEFAULT_PRICES)
    rechecked = datetime.date.fromisoformat(table.as_of[:10])
    assert rechecked <= datetime.date.today()
    sections = {"prices": table.prices.values(), "ec2": table.ec2.values(),
                "serving": serving_prices([DEFAULT_PRICES]).values()}
    for section, entries in sections.items():
        for p in entries:
            assert p.source.startswith("https://") and p.note, p
            assert p.checked and 0 <= (rechecked - datetime.date.fromisoformat(p.checked)).days <= 365, p
            assert p.region == table.region == "us-east-1", p
            assert p.service == {"prices": "hyperpod", "ec2": "ec2", "serving": "other"}[section], p
            assert p.verified or "ESTIMATE" in p.note, p  # an unverified figure says it is one
    # `platform` (what the rest of a deployment bills, stacks/cost.py): the same rule, except the
    # entries no dated public source was found for, named below with the reason; each says so
    from stacks.cost import load_platform_prices

    platform = load_platform_prices(DEFAULT_PRICES)
    for p in platform.values():
        assert p.source.startswith("https://") and p.note, p
        if p.name in UNDATED_PLATFORM:
            assert not p.checked and not p.verified and p.note.startswith("UNDATED:"), p
        else:
            assert p.checked and 0 <= (rechecked - datetime.date.fromisoformat(p.checked)).days <= 365, p
            assert p.verified, p
    assert set(UNDATED_PLATFORM) <= set(platform)  # the exception names entries that exist, no more
    # the SageMaker figures are the EC2 price x one ratio (1.15): the estimates apply the ratio
    # the verified figures show, so an estimate moves with the figures it is derived from
    ratios = {n: p.usd_per_hour / table.ec2_price(n).usd_per_hour for n, p in table.prices.items() if p.verified}
    assert ratios and max(ratios.values()) - min(ratios.values()) < 1e-3, ratios
    ratio = min(ratios.values())
    for name, p in table.prices.items():
        if not p.verified:
            assert p.usd_per_hour == pytest.approx(table.ec2_price(name).usd_per_hour * ratio, rel=1e-3), name
    # the shipped table goes stale by itself: the day after its oldest decision price turns one
    # year old, the report names that entry above the recommendation
    oldest = min(datetime.date.fromisoformat(p.checked) for p in table.prices.values())
    names = sorted(n for n, p in table.prices.items() if datetime.date.fromisoformat(p.checked) == oldest)
    for days, stale in ((365, False), (366, True)):
        opts = Options(project_only=True, decision=DecisionOptions(
            today=oldest + datetime.timedelta(days=days)))
        head = build([], tmp_path / str(days), opts=opts).read_text().split("## Projection")[0]
        assert ("**Stale prices:**" in head) is stale
        if stale:
            assert all(f"{n} (checked {oldest}, 366 days ago)" in head for n in names), head


# ----- price scenarios -------------------------------------------------------------------------------

def _ratio(gpu_usd: float, trn_usd: float) -> float:
    return (trn_usd / R_TRN1) / (gpu_usd / R_P5)


def test_price_scenarios_against_hand_computation(tmp_path):
    md = _report(tmp_path, "--prices", str(_prices(tmp_path, ec2=True)), "--plan-discount", "0.3,0.3",
                 "--negotiated-usd", "60,30")
    sec = md.split("## Price scenarios")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in sec.splitlines() if line.startswith("| ")}
    measured = 0.25 / 0.30
    expect = {"on-demand (decision prices)": (100, 25), "EC2 on-demand (comparison)": (50, 20),
              "plan discount 30% / 30%": (70, 17.5), "negotiated": (60, 30)}
    for name, (g, t) in expect.items():
        r = _ratio(g, t)
        side = "Trainium" if measured > r else "GPU"
        assert f"| ${g:,.2f} | ${t:,.2f} | **{r:.2f}** | {r * 0.30:.1%} | {side} ({measured:.2f} vs {r:.2f}) |" \
               in rows[name], rows[name]
    # an equal discount on both sides leaves the break-even where it was
    assert _ratio(70, 17.5) == pytest.approx(_ratio(100, 25))
    lo, hi = min(_ratio(*v) for v in expect.values()), max(_ratio(*v) for v in expect.values())
    assert f"The break-even spans {lo:.2f}-{hi:.2f} across these scenarios and the measured ratio is {measured:.2f}" in sec
    plain = _report(tmp_path, "--prices", str(_prices(tmp_path)), runs=False)
    assert "Give `--plan-discount GPU,TRN`" in plain.split("## Price scenarios")[1]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--plan-discount", "0.3"], "--plan-discount 0.3: give GPU,TRN as two numbers"),
    (["--plan-discount", "1.2,0.1"], "--plan-discount 1.2,0.1: each value must be in [0, 1)"),
    (["--negotiated-usd", "40,0"], "--negotiated-usd 40,0: each value must be > 0"),
    (["--mfu-band-trn", "0.4,0.1"], "--mfu-band-trn 0.4,0.1: give LO,HI with 0 < LO < HI <= 1"),
    (["--parity-runs", "/nonexistent/a", "/nonexistent/b"], "--parity-runs /nonexistent/a: cannot read"),
])
def test_bad_decision_input_is_one_line(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--project", "--out", str(tmp_path / "o"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err


# ----- MFU bands: per platform, cited, replaced by measurements --------------------------------------

def test_mfu_bands_differ_per_platform_cite_their_evidence_and_yield_to_measurements(tmp_path, monkeypatch):
    from test_projection import _chart_markers

    spans: list = []
    _chart_markers(monkeypatch, "D", spans)
    md = _report(tmp_path, "--prices", str(_prices(tmp_path)), "--project", "--mfu-band-gpu", "0.2,0.3",
                 "--mfu-band-trn", "0.1,0.5", runs=False)
    p5 = next(line for line in md.splitlines() if line.startswith("| sana-600m-512 | p5.48xlarge |"))
    trn = next(line for line in md.splitlines() if line.startswith("| sana-600m-512 | trn1.32xlarge |"))
    assert "| 20%-30% |" in p5 and "| 10%-50% |" in trn
    f = flops.train_flops_per_sample(PRESETS["sana-600m-512"], 300, (16, 16))
    assert " / ".join(f"${25 / (m * R_TRN1 / f * 3600) * 1e6:,.2f}" for m in (0.1, 0.3, 0.5)) in trn
    assert spans == [[0.2, 0.3], [0.1, 0.5]]
    assert "**MFU, GPU** 20%-30%, mid 25.0%: --mfu-band-gpu (given)" in md
    # the defaults cite the published DiT figures and say Trainium has none
    default = _report(tmp_path, "--prices", str(_prices(tmp_path)), runs=False)
    assert "Wan 2.1 14B 32.9% (NeMo DFM Megatron-Core, 128 GPUs), 17.8%" in default and "23.1%" in default
    assert "no MFU has been published for a diffusion transformer on Trainium" in default
    # a bench run's measured MFU replaces the band for its instance type
    measured = _report(tmp_path, "--prices", str(_prices(tmp_path)), "--mfu-band-gpu", "0.2,0.3")
    p5 = next(line for line in measured.splitlines() if line.startswith("| sana-600m-512 | p5.48xlarge |"))
    assert "| measured 30.0% |" in p5 and f"${100 / (0.3 * R_P5 / F * 3600) * 1e6:,.2f}" in p5 and "MFU measured" in p5
    assert "**Measured MFU replaces the band** for p5.48xlarge (30.0%, `p5.json`), trn1.32xlarge (25.0%, " \
           "`trn1.json`)" in measured


# ----- quality parity --------------------------------------------------------------------------------

def write_run(path: Path, losses: list[float], *, per_step: int = 16, log_every: int = 25,
              grid_steps: tuple[int, ...] = (100, 200), seed: int = 0) -> Path:
    """A run directory as the loop leaves it: metrics.jsonl through the real MetricsLogger, grids."""
    metrics = MetricsLogger(path, enabled=True, tensorboard=False, total_steps=len(losses) * log_every)
    for i, loss in enumerate(losses, 1):
        metrics.log(i * log_every, {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "samples_seen": i * log_every * per_step})
    metrics.close()
    (path / "validation").mkdir(exist_ok=True)
    for step in grid_steps:
        Image.new("RGB", (64, 32), (seed * 40 % 255, step % 255, 90)).save(path / "validation" / f"step-{step:08d}.png")
    return path


def _curve(n: int, start: float, end: float, noise: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [start + (end - start) * i / (n - 1) + rng.uniform(-noise, noise) for i in range(n)]


def test_parity_within_tolerance_overlays_states_the_gap_and_shows_both_grids(tmp_path):
    a = write_run(tmp_path / "gpu", _curve(12, 1.2, 0.40, 0.01, 1), seed=1)
    b = write_run(tmp_path / "trn", _curve(12, 1.2, 0.41, 0.01, 2), grid_steps=(100, 200, 300), seed=2)
    md = _report(tmp_path, "--prices", str(_prices(tmp_path)), "--parity-runs", str(a), str(b))
    sec = md.split("## Quality parity")[1].split("\n## ")[0]
    la = [json.loads(x)["loss"] for x in (a / "metrics.jsonl").read_text().splitlines()][-5:]
    lb = [json.loads(x)["loss"] for x in (b / "metrics.jsonl").read_text().splitlines()][-5:]
    ma, mb = sum(la) / 5, sum(lb) / 5
    rel = abs(ma - mb) / ((ma + mb) / 2)
    assert rel <= 0.05
    assert (f"Mean loss over the last 5 logged steps both runs cover: GPU run {ma:.4g}, Trainium run {mb:.4g}; "
            f"**within**: the gap is {rel:.1%}, within the 5% tolerance.") in sec
    assert "Training-loss parity holds" in md.split("## Recommendation")[1].split("\n## ")[0]
    # the latest step both rendered (200), side by side, copied next to the report
    out = tmp_path / "out"
    for i, run in ((1, a), (2, b)):
        copied = out / f"parity-grid-{i}-step-00000200.png"
        assert copied.read_bytes() == (run / "validation" / "step-00000200.png").read_bytes()
    assert "| ![](parity-grid-1-step-00000200.png) | ![](parity-grid-2-step-00000200.png) |" in sec
    with Image.open(out / "parity.png") as img:
        assert img.size == CHART_PX


def test_a_diverging_run_is_flagged_and_fails_parity(tmp_path):
    a = write_run(tmp_path / "gpu", _curve(12, 1.2, 0.40, 0.01, 1))
    rising = write_run(tmp_path / "rise", _curve(12, 1.2, 3.0, 0.01, 3))
    md = _report(tmp_path, "--prices", str(_prices(tmp_path)), "--parity-runs", str(a), str(rising))
    ls = [json.loads(x)["loss"] for x in (rising / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(ls[:5]) / 5, sum(ls[-5:]) / 5
    assert f"**Diverging:** Trainium run: loss rose from {first:.4g} (first 5 logged steps) to {last:.4g} (last 5)." in md
    assert "**Quality parity fails: a run diverges**" in md.split("## Recommendation")[1]
    nan = write_run(tmp_path / "nan", [*_curve(6, 1.2, 0.8, 0.01, 4), math.nan, 0.7])
    md = _report(tmp_path, "--prices", str(_prices(tmp_path)), "--parity-runs", str(a), str(nan))
    assert "**Diverging:** Trainium run: loss is not finite at step 175." in md


def test_a_clear_gap_is_apart_and_parity_stays_unproven(tmp_path):
    a = write_run(tmp_path / "gpu", _curve(12, 1.2, 0.40, 0.005, 1))
    b = write_run(tmp_path / "trn", _curve(12, 1.2, 0.60, 0.005, 2))
    md = _report(tmp_path, "--prices", str(_prices(tmp_path)), "--parity-runs", str(a), str(b))
    assert "**apart**: the gap is" in md and "above the 5% tolerance and more than twice its standard error" in md
    rec = md.split("## Recommendation")[1].split("\n## ")[0]
    assert "Quality parity is unproven: the gap is" in rec


def test_without_parity_runs_the_recommendation_says_parity_is_unproven(tmp_path):
    md = _report(tmp_path, "--prices", str(_prices(tmp_path)))
    assert "Quality parity is unproven: no training runs of the same recipe on both platforms were compared" in \
           md.split("## Recommendation")[1].split("\n## ")[0]
    assert "## Quality parity" not in md


def test_a_resumed_runs_repeated_step_counts_once_and_a_cut_last_line_is_ignored(tmp_path):
    from training.report import parity

    run = write_run(tmp_path / "run", [1.0, 0.9, 0.8])
    with (run / "metrics.jsonl").open("a") as fh:  # resumed from step 50: steps 75 logged again, then cut short
        fh.write(json.dumps({"step": 75, "loss": 0.7, "samples_seen": 1200}) + "\n" + '{"step": 100, "lo')
    curve = parity.load_run(run, "GPU run")
    assert curve.steps == [25, 50, 75] and curve.loss == [1.0, 0.9, 0.7]
