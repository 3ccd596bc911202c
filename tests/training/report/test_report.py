"""python -m training.report: numbers against hand computations, charts, and its refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from bench_fixtures import make_result  # tests/training/report/bench_fixtures.py (rootdir on sys.path)
from PIL import Image

from training.perf.bench_result import BenchResult
from training.report import cli
from training.report.charts import CHART_PX
from training.report.inputs import Options, fsx_from_cdk
from training.report.prices import DEFAULT_PRICES, PriceTable
from training.report.recommendation import recommendation
from training.report.runs import Run

REPO = Path(__file__).resolve().parents[3]
PRICES = REPO / "training" / "prices.yaml"


def _png_ok(path: Path) -> None:
    with Image.open(path) as img:
        img.verify()  # a truncated or non-PNG file raises here
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size == CHART_PX


def _money(x: float) -> str:
    return f"${x:,.2f}"


def _write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# ----- real runs: GPU backend on CPU, Trainium backend on XLA CPU ------------------------------

@pytest.mark.slow
def test_report_from_real_cpu_runs_matches_hand_computation(demo_comparison, tiny_features):
    md_path = demo_comparison["comparison report (CPU figures)"]
    md = md_path.read_text()
    gpu = BenchResult.load(demo_comparison["bench result, GPU backend on CPU"])
    trn = BenchResult.load(demo_comparison["bench result, Trainium backend on XLA CPU"])
    assert (gpu.backend, gpu.device_kind, trn.backend, trn.device_kind) == ("gpu", "cpu", "trainium", "xla-cpu")
    assert trn.compile_count and trn.compile_count >= 1 and trn.compiles_in_timed_steps == 0
    assert gpu.steps_timed == trn.steps_timed == 4
    assert "CPU figures, not accelerator figures" in md
    price = PriceTable.load(md_path.parent.parent / "prices-demo.yaml").get("local").usd_per_hour
    for r in (gpu, trn):
        cost = price / (r.samples_per_s_per_instance * 3600) * 1e6  # USD per million samples
        hours = 1000 * 2 / r.samples_per_s_total / 3600  # --dataset-samples 1000 --epochs 2
        assert _money(cost) in md
        assert f"| {hours:,.2f} | {_money(hours * price)} |" in md
        assert f"{r.samples_per_s_per_accelerator:,.3f}" in md
    # recommendation: the cheaper of the two by cost per million, with the saving computed
    costs = {r.backend: price / (r.samples_per_s_per_instance * 3600) * 1e6 for r in (gpu, trn)}
    cheap, dear = sorted(costs, key=costs.get)
    rec = md.split("## Recommendation")[1].split("## Runs")[0]
    assert rec.split("is the cheaper platform")[0].strip().endswith(f"{cheap} on local " +
                                                                   ("cpu (cpu)" if cheap == "gpu" else
                                                                    "xla-cpu (xla-CPU)"))
    assert f"{(costs[dear] - costs[cheap]) / costs[dear]:.1%} less" in rec
    # capacity: bytes/sample of the index x total samples/s vs cdk.json 1200 GiB x 250 MB/s/TiB
    from training.data.index import FeatureIndex

    bps = FeatureIndex.load(tiny_features).bytes_per_sample
    assert "Provisioned: 293.0 MB/s" in md
    assert f"{bps * gpu.samples_per_s_total / 1e6:,.3f}" in md
    for name in ("throughput", "cost"):
        _png_ok(md_path.parent / f"{name}.png")
        assert f"({name}.png)" in md
    assert not (md_path.parent / "mfu.png").exists()  # no published CPU peak -> no MFU chart
    # the projection (what make demo shows): shipped prices, since the demo's file prices only "local"
    proj = md.split("## Projection: cost and time as a function of MFU")[1].split("## Runs")[0]
    assert "prices no accelerator instance type, so the projection uses" in proj
    assert "| sana-600m-512 | p5.48xlarge | 0.947 |" in proj and "**Cost per sample:**" in proj
    assert "CPU runs (labelled, not placed on the chart" in proj
    assert "No accelerator run yet" in proj  # the CPU runs do not count as measurements
    assert "Against the projection" not in rec
    # ...with the current break-even of the headline pair, computed by hand from the shipped
    # table (16 Trainium1 chips x 190, 8 H100 x 989 dense bf16 TFLOP/s), and where each price came from
    shipped = PriceTable.load(DEFAULT_PRICES)
    trn1, p5 = shipped.get("ml.trn1.32xlarge"), shipped.get("ml.p5.48xlarge")
    r = (trn1.usd_per_hour / (16 * 190)) / (p5.usd_per_hour / (8 * 989))
    assert f"when its MFU is **{r:.2f}x** the GPU's" in proj
    sources = md.split("## Prices and where they came from")[1].split("\n## ")[0]
    for price in (trn1, p5):
        row = next(line for line in sources.splitlines() if line.startswith(f"| {price.instance_type} |"))
        assert f"${price.usd_per_hour:,.3f} | price table | {price.checked} (" in row and price.source in row
    _png_ok(md_path.parent / "projection.png")


# ----- cluster-scale logic on constructed results ----------------------------------------------

def test_recommendation_scaling_and_mfu_against_hand_computation(tmp_path):
    p5 = [make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="H100-SXM", nodes=n,
                      per_node=8, sps_per_accel=s, peak=989.0, mfu=0.947e12 * s / 989e12)
          for n, s in ((1, 400.0), (2, 360.0))]
    trn = [make_result(backend="trainium", instance_type="ml.trn1.32xlarge", accelerator="NeuronCore-v2",
                       nodes=n, per_node=32, sps_per_accel=s, peak=95.0, mfu=0.947e12 * s / 95e12,
                       compile_count=3, compile_seconds=400.0, compiles_in_timed_steps=0)
           for n, s in ((1, 30.0), (2, 29.0))]
    paths = [_write(tmp_path, f"r{i}.json", d) for i, d in enumerate(p5 + trn)]
    out = tmp_path / "out"
    cli.main([*map(str, paths), "--out", str(out), "--prices", str(PRICES), "--dataset-samples", "10000000",
              "--fsx-throughput-mbps", "500"])
    md = (out / "report.md").read_text()
    prices = PriceTable.load(PRICES)
    usd_p5, usd_trn = prices.get("ml.p5.48xlarge").usd_per_hour, prices.get("ml.trn1.32xlarge").usd_per_hour
    # at one node: p5 3200 samples/s/instance, trn1 960 samples/s/instance
    c_p5, c_trn = usd_p5 / (3200 * 3600) * 1e6, usd_trn / (960 * 3600) * 1e6
    assert _money(c_p5) in md and _money(c_trn) in md
    rec = md.split("## Recommendation")[1].split("## Runs")[0]
    cheap, dear = ("gpu", "trainium") if c_p5 < c_trn else ("trainium", "gpu")
    assert rec.strip().startswith(f"{cheap} on ml.")
    assert f"{abs(c_p5 - c_trn) / max(c_p5, c_trn):.1%} less" in rec
    # scaling efficiency: (2 x 8 x 360 / 2) / (8 x 400) = 90%, trn1 29/30 = 96.7%
    assert "| 2 | 5,760.000 | 90.0% |" in md
    assert f"{29 / 30:.1%}" in md
    assert "keeps 90% scaling efficiency at 2 nodes" in rec
    # MFU: 0.947 TFLOP x 400 / 989 TFLOP/s
    assert f"{0.947e12 * 400 / 989e12:.1%}" in md
    # time to 10M samples on one p5: 10e6 / 3200 / 3600 h
    assert f"{1e7 / 3200 / 3600:,.2f}" in md
    # capacity: 300 kB x 5760 samples/s = 1728 MB/s > 500 provisioned -> warning
    assert "1,728.000" in md and "more than provisioned" in md
    used = [prices.get(n) for n in ("ml.p5.48xlarge", "ml.trn1.32xlarge")]
    assert ("Unverified entries used" in md) == any(not p.verified for p in used)
    for name in ("throughput", "cost", "mfu", "scaling"):
        _png_ok(out / f"{name}.png")


def test_crossover_sentence_when_the_cheaper_platform_is_slower(tmp_path):
    fast = make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="H100-SXM", nodes=1,
                       per_node=8, sps_per_accel=100.0)
    slow = make_result(backend="trainium", instance_type="ml.trn1.32xlarge", accelerator="NeuronCore-v2",
                       nodes=1, per_node=32, sps_per_accel=20.0)
    runs = [Run(path=Path(n), result=BenchResult.from_dict(d), price=PriceTable.load(PRICES).get(
        d["instance_type"])) for n, d in (("a", fast), ("b", slow))]
    text = recommendation(runs, Options(dataset_samples=1_000_000, epochs=3))
    p_fast, p_slow = runs[0].price.usd_per_hour, runs[1].price.usd_per_hour
    t_fast, t_slow = 3e6 / 800 / 3600, 3e6 / 640 / 3600
    c_fast, c_slow = t_fast * p_fast, t_slow * p_slow
    assert c_slow < c_fast  # trn1 cheaper per sample, p5 faster per instance
    assert text.startswith("trainium on ml.trn1.32xlarge")
    assert "1.25x faster per instance" in text
    assert f"worth more than {_money((c_fast - c_slow) / (t_slow - t_fast))}" in text
    assert "takes about 2 ml.trn1.32xlarge nodes" in text  # ceil(800 / 640)


# ----- refusals: one clear line each ---------------------------------------------------------------

def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def _pair(tmp_path, **changes):
    base = make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="H100-SXM", nodes=1,
                       per_node=8, sps_per_accel=400.0)
    other = make_result(backend="trainium", instance_type="ml.trn1.32xlarge", accelerator="NeuronCore-v2",
                        nodes=1, per_node=32, sps_per_accel=30.0, **changes)
    return _write(tmp_path, "a.json", base), _write(tmp_path, "b.json", other)


def test_mismatch_is_refused_naming_the_field(tmp_path, capsys):
    a, b = _pair(tmp_path, precision="bf16")
    err = _fails([str(a), str(b), "--out", str(tmp_path / "o")], capsys)
    assert "field precision is 'bf16'" in err and str(a) in err and "--allow-mismatch" in err
    cli.main([str(a), str(b), "--out", str(tmp_path / "o"), "--allow-mismatch"])
    assert "Mismatched runs compared" in (tmp_path / "o" / "report.md").read_text()


def test_resolution_mismatch_is_refused(tmp_path, capsys):
    a, b = _pair(tmp_path, resolution_px=1024, latent_hw=[32, 32])
    assert "field resolution_px" in _fails([str(a), str(b), "--out", str(tmp_path / "o")], capsys)


def test_missing_price_names_the_instance_type(tmp_path, capsys):
    a, _ = _pair(tmp_path)
    data = json.loads(a.read_text()) | {"instance_type": "ml.g5.48xlarge"}
    err = _fails([str(_write(tmp_path, "g5.json", data)), "--out", str(tmp_path / "o")], capsys)
    assert "no price for instance type ml.g5.48xlarge" in err


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda text, d: text[: len(text) // 2], "not valid JSON"),
    (lambda text, d: json.dumps({k: v for k, v in d.items() if k != "samples_per_s_total"}),
     "field samples_per_s_total: missing"),
    (lambda text, d: json.dumps(d | {"nodes": "one"}), "field nodes: expected an integer"),
    (lambda text, d: json.dumps(d | {"samples_per_s_total": d["samples_per_s_total"] * 2}),
     "field samples_per_s_total:"),
    (lambda text, d: json.dumps(d | {"mfu": 1.7}), "field mfu: must be a fraction"),
    (lambda text, d: json.dumps(d | {"colour": "red"}), "field colour: unknown field"),
    (lambda text, d: json.dumps([d]), "expected a JSON object"),
])
def test_bad_result_json_gives_one_line_naming_file_and_field(tmp_path, capsys, mutate, expected):
    a, _ = _pair(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(mutate(a.read_text(), json.loads(a.read_text())))
    err = _fails([str(bad), "--out", str(tmp_path / "o")], capsys)
    assert str(bad) in err and expected in err


def test_bad_prices_file_names_the_key(tmp_path, capsys):
    a, _ = _pair(tmp_path)
    prices = tmp_path / "p.yaml"
    data = yaml.safe_load(PRICES.read_text())
    data["prices"]["ml.p5.48xlarge"]["usd_per_hour"] = "free"
    prices.write_text(yaml.safe_dump(data))
    err = _fails([str(a), "--out", str(tmp_path / "o"), "--prices", str(prices)], capsys)
    assert "prices.ml.p5.48xlarge.usd_per_hour" in err


def test_shipped_prices_cover_every_hyperpod_instance_type_of_their_region():
    """The shipped table prices exactly the accelerator instance types (training/model/flops.py) that
    HyperPod sells in its region: the AWS::SageMaker::Cluster InstanceType values cfn-lint
    derives per region from the AWS Price List (cfn-lint's update_specs_from_pricing; the
    installed cfnlint/data/schemas/extensions/aws_sagemaker_cluster/instancetype_enum.json)."""
    import cfnlint

    from training.model import flops
    table = PriceTable.load(PRICES)
    enum = json.loads((Path(cfnlint.__file__).parent / "data" / "schemas" / "extensions" / "aws_sagemaker_cluster"
                       / "instancetype_enum.json").read_text())
    sold = set(enum[table.region]["enum"]) & set(flops.INSTANCE_TYPES)
    assert {"ml.p5.48xlarge", "ml.trn1.32xlarge"} <= sold
    assert set(table.prices) == sold
    for name in sold:
        price = table.get(name)
        assert price.usd_per_hour > 0 and price.source.startswith("https://") and re.match(r"\d{4}-\d\d-\d\d",
                                                                                            price.checked)


def test_fsx_defaults_come_from_cdk_json():
    mbps, source = fsx_from_cdk(REPO / "cdk.json")
    ctx = json.loads((REPO / "cdk.json").read_text())["context"]
    assert mbps == pytest.approx(ctx["fsxStorageGiB"] / 1024 * ctx["fsxThroughputPerTiB"])
    assert "fsxStorageGiB" in source


def test_durations_read_naturally():
    from training.report.markdown import duration

    assert duration(12.5) == "12.50 h"
    assert duration(0.05) == "3.0 min"
    assert duration(0.0001) == "0.4 s"
