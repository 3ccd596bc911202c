"""The projection (training/report/projection.py) against hand computations and brute force, measured
points on its chart (measured_points.py, projection_chart.py), budget answers (budget.py), and its
one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from bench_fixtures import make_result

from training.model import flops
from training.model.build import PRESETS
from training.report import budget, cli, inputs, projection
from training.report.charts import CHART_PX
from training.report.prices import DEFAULT_PRICES, PriceTable

#: round prices so the hand computations below are readable; p5 and trn1 only
PRICES_YAML = """as_of: "2030-01-01"
currency: USD
region: test
prices:
  ml.p5.48xlarge: {usd_per_hour: 100.0, source: test, checked: "2030-01-01", verified: true}
  ml.trn1.32xlarge: {usd_per_hour: 25.0, source: test, checked: "2030-01-01", verified: true}
"""


@pytest.fixture
def prices(tmp_path: Path) -> Path:
    path = tmp_path / "prices.yaml"
    path.write_text(PRICES_YAML)
    return path


def _plats(prices: Path) -> dict[str, projection.Platform]:
    table = PriceTable.load(prices)
    return {p.instance_type: p for p in projection.platforms(table.prices, "bf16-mixed")}


# ----- the projection against a hand computation -------------------------------------------------

@pytest.mark.parametrize(("preset", "hw"), [("sana-600m-512", (16, 16)), ("sana-1600m-1024", (32, 32))])
@pytest.mark.parametrize(("instance", "usd", "peak_per_instance"), [
    ("ml.p5.48xlarge", 100.0, 8 * 989e12),  # 8 x H100 SXM, 989 TFLOP/s bf16 dense each
    ("ml.trn1.32xlarge", 25.0, 32 * 95e12),  # 16 Trainium chips = 32 NeuronCore-v2 x 95 TFLOP/s
])
def test_projection_matches_hand_computation(tmp_path, prices, preset, hw, instance, usd, peak_per_instance):
    a = projection.Assumptions(typical_mfu=(0.2, 0.4), typical_mfu_trn=(0.2, 0.4), scaling_per_doubling=0.9)
    w = projection.workload(preset, a)
    f = flops.train_flops_per_sample(PRESETS[preset], 300, hw)
    assert (w.latent_hw, w.text_tokens, w.flops_per_sample) == (hw, 300, f)
    p = _plats(prices)[instance]
    for mfu in (0.2, 0.3, 0.4):
        sps = mfu * peak_per_instance / f
        assert projection.samples_per_s_per_instance(w, p, mfu) == pytest.approx(sps, rel=1e-12)
        assert projection.cost_per_million(w, p, mfu) == pytest.approx(usd / (sps * 3600) * 1e6, rel=1e-12)
    # 10M samples x 3 epochs on 4 nodes at 0.9 per doubling -> 0.81 efficiency
    hours = 3e7 / (4 * 0.81 * 0.3 * peak_per_instance / f) / 3600
    assert projection.hours_to_target(w, p, 0.3, 3e7, 4, a) == pytest.approx(hours, rel=1e-12)
    assert projection.cost_to_target(w, p, 0.3, 3e7, 4, a) == pytest.approx(hours * 4 * usd, rel=1e-12)
    # ... and the report prints those figures in its projection table
    out = tmp_path / "out"
    cli.main(["--project", "--out", str(out), "--prices", str(prices), "--preset", preset,
              "--mfu-band", "0.2,0.4", "--scaling-per-doubling", "0.9", "--nodes", "4",
              "--dataset-samples", "10000000", "--epochs", "3"])
    md = (out / "report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith(f"| {preset} | {instance[3:]} |"))
    costs = " / ".join(f"${usd / (m * peak_per_instance / f * 3600) * 1e6:,.2f}" for m in (0.2, 0.3, 0.4))
    assert f"| {costs} |" in row
    assert f"| {hours:,.2f} h, ${hours * 4 * usd:,.0f} |" in row
    assert "MFU assumed; 4 nodes at 81% efficiency assumed; price 2030-01-01 |" in row


def test_sana_600m_numbers_in_words():
    """By hand: 0.947 TFLOP/sample, p5 at the shipped table's price and 30% MFU."""
    a = projection.Assumptions()
    w = projection.workload("sana-600m-512", a)
    usd = PriceTable.load(DEFAULT_PRICES).get("ml.p5.48xlarge").usd_per_hour
    p5 = projection.Platform(instance_type="ml.p5.48xlarge", backend="gpu", accelerator="H100-SXM", devices=8,
                             peak_tflops=989.0, peak_source="", usd_per_hour=usd, price_checked="", price_verified=False)
    # 0.3 x 7912 TFLOP/s / 0.947 TFLOP = 2506 samples/s per instance -> USD/h / (2506 x 3600) x 1e6 per million
    assert projection.samples_per_s_per_instance(w, p5, 0.3) == pytest.approx(0.3 * 7912 / 0.9470, rel=1e-3)
    assert projection.cost_per_million(w, p5, 0.3) == pytest.approx(usd / (2506.4 * 3600) * 1e6, rel=1e-3)


# ----- break-even: the closed form against a brute-force search ------------------------------

def _crossing(f, lo: float = 1e-4, hi: float = 2.0, steps: int = 200_000) -> float:
    """The x in [lo, hi] where f changes sign, by scanning (no algebra)."""
    prev_x, prev = lo, f(lo)
    for i in range(1, steps + 1):
        x = lo + (hi - lo) * i / steps
        cur = f(x)
        if (cur > 0) != (prev > 0):
            return (prev_x + x) / 2
        prev_x, prev = x, cur
    raise AssertionError("no crossing")


@pytest.mark.parametrize("shipped", [False, True])
def test_break_even_formula_matches_brute_force(prices, shipped):
    table = PriceTable.load(DEFAULT_PRICES if shipped else prices)
    plats = {p.instance_type: p for p in projection.platforms(table.prices, "bf16-mixed")}
    gpu, trn = plats["ml.p5.48xlarge"], plats["ml.trn1.32xlarge"]
    a = projection.Assumptions(scaling_per_doubling=0.9)
    w = projection.workload("sana-600m-512", a)
    r = projection.break_even_cost_ratio(gpu, trn)
    if not shipped:  # by hand: (25 / (32 x 95)) / (100 / (8 x 989)) = 0.6507...
        assert r == pytest.approx((25 / (32 * 95)) / (100 / (8 * 989)), rel=1e-12)
    for m_gpu in (0.1, 0.25, 0.4):
        target = projection.cost_per_million(w, gpu, m_gpu)
        m_trn = _crossing(lambda m, target=target: projection.cost_per_million(w, trn, m) - target)
        assert m_trn / m_gpu == pytest.approx(r, abs=2e-5 / m_gpu)
    for n_gpu, n_trn in ((1, 1), (2, 4), (4, 8)):
        m_gpu = 0.3
        hours = projection.hours_to_target(w, gpu, m_gpu, 1e8, n_gpu, a)
        m_trn = _crossing(lambda m, h=hours, n=n_trn: h - projection.hours_to_target(w, trn, m, 1e8, n, a), hi=3.0)
        expected = projection.break_even_time_ratio(gpu, trn, n_gpu, n_trn, a)
        assert m_trn / m_gpu == pytest.approx(expected, abs=3e-5 / m_gpu)


# ----- measured points ------------------------------------------------------------------------------

def _runs(tmp_path: Path, *, gpu_mfu: float, trn_mfu: float, cpu: bool = False) -> list[Path]:
    f = 0.947e12
    datas = {
        "p5.json": make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="H100-SXM", nodes=1,
                               per_node=8, sps_per_accel=gpu_mfu * 989e12 / f, peak=989.0, mfu=gpu_mfu),
        "trn1.json": make_result(backend="trainium", instance_type="ml.trn1.32xlarge", accelerator="NeuronCore-v2",
                                 nodes=1, per_node=32, sps_per_accel=trn_mfu * 95e12 / f, peak=95.0, mfu=trn_mfu,
                                 compile_count=2, compile_seconds=100.0, compiles_in_timed_steps=0),
    }
    if cpu:
        datas["cpu.json"] = make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="cpu", nodes=1,
                                        per_node=8, sps_per_accel=5000.0, device_kind="cpu")
    paths = []
    for name, data in datas.items():
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(tmp_path / name)
    return paths


def _chart_markers(monkeypatch, marker: str = "*", spans: list | None = None) -> list:
    """Capture the projection figure as it is saved: its lines drawn with ``marker`` ("*" =
    measured runs, "D" = the break-even), and the shaded band's x extent into ``spans``."""
    import matplotlib.figure

    seen: list = []
    real = matplotlib.figure.Figure.savefig

    def spy(self, fname, *args, **kwargs):
        if str(fname).endswith("projection.png"):
            seen.extend(line for ax in self.axes for line in ax.get_lines() if line.get_marker() == marker)
            if spans is not None:
                for ax in self.axes:  # axvspan: a Rectangle (matplotlib >= 3.9) or a Polygon
                    for p in ax.patches:
                        xs = ([p.get_x(), p.get_x() + p.get_width()] if hasattr(p, "get_width")
                              else [x for x, _ in p.get_xy()])
                        spans.append(sorted({round(float(x), 6) for x in xs}))
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return seen


def test_measured_points_land_where_their_json_says(tmp_path, prices, monkeypatch):
    markers = _chart_markers(monkeypatch)
    paths = _runs(tmp_path, gpu_mfu=0.30, trn_mfu=0.25)
    out = tmp_path / "out"
    cli.main([*map(str, paths), "--out", str(out), "--prices", str(prices)])
    md = (out / "report.md").read_text()
    table = PriceTable.load(prices)
    expected = {}
    for path in paths:
        data = json.loads(path.read_text())
        usd = table.get(data["instance_type"]).usd_per_hour
        expected[(round(data["mfu"], 9), round(usd / (data["samples_per_s_per_instance"] * 3600) * 1e6, 6))] = path
    got = {(round(float(m.get_xdata()[0]), 9), round(float(m.get_ydata()[0]), 6)) for m in markers}
    assert got == set(expected)
    # and each point sits on its instance type's curve, which the chart draws with the runs' own
    # FLOP count (the JSON's train_flops_per_sample, 0.947e12 here)
    w = dataclasses.replace(projection.workload("sana-600m-512", projection.Assumptions()), flops_per_sample=0.947e12)
    plats = _plats(prices)
    for (mfu, cost), path in expected.items():
        inst = json.loads(path.read_text())["instance_type"]
        assert projection.cost_per_million(w, plats[inst], mfu) == pytest.approx(cost, rel=1e-6)
    # ratio 0.25 / 0.30 = 0.833 against break-even 0.651: Trainium side, +28%
    r = (25 / (32 * 95)) / (100 / (8 * 989))
    section = md.split("### Measured runs on the projection")[1].split("### Budget")[0]
    assert f"a ratio of {0.25 / 0.30:.2f} against the break-even {r:.2f}: {0.25 / 0.30 / r - 1:+.0%}" in section
    assert "on the **Trainium** side" in section
    assert "| trn1.32xlarge |" not in section  # the table is by run label
    assert "![projection](projection.png)" in md and (out / "projection.png").is_file()


def test_chart_marks_the_break_even_and_shades_the_band(tmp_path, prices, monkeypatch):
    spans: list = []
    diamonds = _chart_markers(monkeypatch, "D", spans)
    out = tmp_path / "out"
    cli.main([*map(str, _runs(tmp_path, gpu_mfu=0.30, trn_mfu=0.25)), "--out", str(out), "--prices", str(prices),
              "--mfu-band", "0.2,0.35"])
    r = (25 / (32 * 95)) / (100 / (8 * 989))
    (d,) = diamonds
    # at the measured p5 MFU (0.30): trn1 at r x 0.30 costs what p5 costs at 0.30
    assert float(d.get_xdata()[0]) == pytest.approx(r * 0.30, rel=1e-9)
    p5_cost = 100 / (0.30 * 8 * 989e12 / 0.947e12 * 3600) * 1e6
    assert float(d.get_ydata()[0]) == pytest.approx(p5_cost, rel=1e-9)
    assert spans == [[0.2, 0.35]]


def test_gpu_side_when_trainium_is_below_break_even(tmp_path, prices):
    out = tmp_path / "out"
    cli.main([*map(str, _runs(tmp_path, gpu_mfu=0.40, trn_mfu=0.20)), "--out", str(out), "--prices", str(prices)])
    section = (out / "report.md").read_text().split("### Measured runs on the projection")[1]
    assert "on the **GPU** side" in section  # 0.5 < 0.651


def test_cpu_runs_are_labelled_and_never_move_the_recommendation(tmp_path, prices, monkeypatch):
    markers = _chart_markers(monkeypatch)
    base, with_cpu = tmp_path / "a", tmp_path / "b"
    base.mkdir()
    with_cpu.mkdir()
    cli.main([*map(str, _runs(base, gpu_mfu=0.3, trn_mfu=0.25)), "--out", str(base / "out"),
              "--prices", str(prices), "--allow-mismatch"])
    n_before = len(markers)
    cli.main([*map(str, _runs(with_cpu, gpu_mfu=0.3, trn_mfu=0.25, cpu=True)), "--out", str(with_cpu / "out"),
              "--prices", str(prices), "--allow-mismatch"])
    assert len(markers) - n_before == n_before == 2  # the CPU run is not placed

    def verdict(md: str) -> str:
        return md.split("### Measured runs on the projection")[1].split("### Budget")[0].splitlines()[-1]

    a, b = ((d / "out" / "report.md").read_text() for d in (base, with_cpu))
    assert verdict(a) == verdict(b)
    assert "Against the projection: Measured: trn1.32xlarge at 25.0% MFU and p5.48xlarge at 30.0%" in b
    assert a.split("Against the projection: ")[1].split("\n")[0] == b.split("Against the projection: ")[1].split("\n")[0]
    assert "CPU runs (labelled, not placed on the chart, and never part of the recommendation" in b
    assert "(`cpu.json`)" in b


# ----- real tokens ------------------------------------------------------------------------------------

def test_real_tokens_from_the_feature_shards(tmp_path):
    from training.data.shards import write_synthetic_features

    write_synthetic_features(tmp_path / "f", num_samples=20, latent_shape=(4, 8, 8), text_dim=8,
                             max_text_tokens=300, text_tokens=(7, 7), samples_per_shard=8)
    mean, n, padded = inputs.mean_real_text_tokens(str(tmp_path / "f"))
    assert (mean, n, padded) == (7.0, 20, 300)
    a = projection.Assumptions(real_text_tokens=mean)
    w = projection.workload("sana-600m-512", a)
    assert w.flops_per_sample == flops.train_flops_per_sample(PRESETS["sana-600m-512"], 300, (16, 16),
                                                              real_text_tokens=7)
    assert 0.15 < w.padding_share < 0.25  # ~18% of the 300-token FLOPs is caption padding at 7 real


def test_report_reads_real_tokens_only_when_the_lengths_match(tmp_path, prices):
    from training.data.shards import write_synthetic_features

    write_synthetic_features(tmp_path / "f", num_samples=8, latent_shape=(4, 8, 8), text_dim=8,
                             max_text_tokens=16, text_tokens=(4, 4))
    out = tmp_path / "out"
    cli.main(["--project", "--out", str(out), "--prices", str(prices), "--features-index", str(tmp_path / "f")])
    md = (out / "report.md").read_text()
    assert "not applied: " in md and "pads captions to 16 tokens (mean 4.0 real)" in md
    assert "| sana-600m-512 | p5.48xlarge | 0.947 | 0% |" in md


# ----- budget questions ------------------------------------------------------------------------------

def test_budget_hours_picks_the_cheapest_platform_on_the_fewest_nodes(prices):
    a = projection.Assumptions(typical_mfu=(0.2, 0.4), typical_mfu_trn=(0.2, 0.4), scaling_per_doubling=0.9)
    w = projection.workload("sana-600m-512", a)
    plats = list(_plats(prices).values())
    samples = 1e9
    pick, per = budget.answer_budget(w, plats, a, samples, budget_usd=None, budget_hours=40.0, max_nodes=16,
                                     measured={})
    # brute force: for each platform the fewest n with hours <= 40; the cheapest of those
    best = []
    for p in plats:
        n = next(n for n in range(1, 17) if projection.hours_to_target(w, p, 0.3, samples, n, a) <= 40)
        best.append((projection.cost_to_target(w, p, 0.3, samples, n, a), p.instance_type, n))
    cost, inst, n = min(best)
    assert (pick.platform.instance_type, pick.nodes, pick.usd) == (inst, n, pytest.approx(cost))
    assert pick.depends_most_on.startswith("MFU (assumed 30.0%")
    # a measured MFU replaces the assumption; then it depends most on scaling (n > 1) or the price
    pick2, _ = budget.answer_budget(w, plats, a, samples, budget_usd=None, budget_hours=40.0, max_nodes=16,
                                    measured={p.instance_type: 0.3 for p in plats})
    assert pick2.mfu_measured and pick2.depends_most_on.startswith(
        "scaling efficiency" if pick2.nodes > 1 else "the price")


def test_budget_usd_only_takes_the_most_nodes_it_affords(prices):
    a = projection.Assumptions(scaling_per_doubling=0.9)
    w = projection.workload("sana-600m-512", a)
    plats = list(_plats(prices).values())
    pick, per = budget.answer_budget(w, plats, a, 1e9, budget_usd=20_000.0, budget_hours=None, max_nodes=8,
                                     measured={})
    for ans in per:
        assert ans.usd <= 20_000
        more = ans.nodes + 1
        assert more > 8 or projection.cost_to_target(w, ans.platform, ans.mfu, 1e9, more, a) > 20_000
    assert pick.hours == min(x.hours for x in per)
    none, _ = budget.answer_budget(w, plats, a, 1e9, budget_usd=1.0, budget_hours=None, max_nodes=8, measured={})
    assert none is None


# ----- refusals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "needle"), [
    ([], "give at least one bench result JSON, or --project"),
    (["--project", "--mfu-band", "0.5"], "--mfu-band 0.5: give LO,HI"),
    (["--project", "--mfu-band", "0.5,0.2"], "--mfu-band 0.5,0.2: give LO,HI with 0 < LO < HI <= 1"),
    (["--project", "--preset", "sana-9b"], "--preset sana-9b: unknown"),
    (["--project", "--scaling-per-doubling", "1.5"], "--scaling-per-doubling 1.5: must be in (0, 1]"),
    (["--project", "--budget-hours", "0"], "--budget-hours: must be > 0"),
    (["--project", "--trn-instance", "ml.trn3.48xlarge"], "--trn-instance ml.trn3.48xlarge: no price in"),
])
def test_bad_projection_input_is_one_line_naming_the_flag(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err


def test_projection_only_report_has_the_chart_and_no_run_sections(tmp_path):
    from PIL import Image

    out = tmp_path / "out"
    cli.main(["--project", "--out", str(out), "--budget-usd", "5000", "--dataset-samples", "1000000",
              "--epochs", "10"])
    md = (out / "report.md").read_text()
    assert "## Projection: cost and time as a function of MFU" in md and "## Runs" not in md
    assert "### Break-even" in md and "**Cost per sample:**" in md
    assert "Budget $5,000 for 1,000,000 samples x 10 epochs" in md
    with Image.open(out / "projection.png") as img:
        assert img.size == CHART_PX
    assert math.isfinite(len(md))
