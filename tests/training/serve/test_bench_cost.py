"""The serving bench JSON and the report's "Serving" section: latency percentiles, the projection
formulas checked by hand, measured rows priced and labelled, and the report reading the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from training.report import serving as cost
from training.serve.bench import ServeBenchResult, main, percentile


@pytest.fixture(scope="module")
def bench_json(compiled_model: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve-bench") / "serve-local.json"
    main(["--model-dir", str(compiled_model), "--steps", "2", "--requests", "3", "--warmup", "1",
          "--instance-type", "local", "--notes", "tiny CPU", "--out", str(out)])
    return out


def test_bench_times_whole_requests_and_writes_its_json(bench_json: Path):
    raw = json.loads(bench_json.read_text())
    result = ServeBenchResult.load(bench_json)
    assert (result.backend, result.instance_type, result.height, result.width, result.steps) == (
        "compiled-cpu", "local", 64, 64, 2)
    assert len(result.latencies_s) == 3 and result.is_cpu
    assert raw["p50_s"] == pytest.approx(sorted(result.latencies_s)[1])
    assert raw["images_per_s_per_instance"] == pytest.approx(3 / sum(result.latencies_s))
    assert result.transformer_config["num_layers"] == 1 and result.versions["torch"]


def test_percentile_is_linear_interpolation():
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.9) == pytest.approx(3.7)
    assert percentile([5.0], 0.9) == 5.0


def test_a_result_that_is_not_a_bench_is_refused(tmp_path: Path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"kind": "sana-serve-bench/1", "latencies_s": []}))
    with pytest.raises(Exception, match="not a serving bench result"):
        ServeBenchResult.load(bad)


def test_projection_formulas_by_hand():
    inf2 = cost.SERVING_INSTANCES["ml.inf2.xlarge"]
    assert cost.seconds_per_image(130.0, inf2, 0.2) == pytest.approx(130.0 / (0.2 * 190.0))
    assert cost.cost_per_1000(1.0, 3.6) == pytest.approx(1.0)  # 1000 images/h at $1/h
    d, f, q, kv = 2304, 9216, 8 * 256, 4 * 256
    assert cost.text_encoder_flops(10) == pytest.approx(26 * 10 * (2 * (d * q + 2 * d * kv + q * d + 3 * d * f)
                                                                   + 4 * 10 * q))
    from training.model import flops
    from training.model.build import PRESETS
    parts = cost.image_flops(PRESETS["sana-1600m-1024"], 1024, 1024, 20, real_decoder=False)
    assert parts["transformer"] == pytest.approx(20 * 2 * flops.forward_flops_per_sample(
        PRESETS["sana-1600m-1024"], 300, (32, 32)))


def test_dc_ae_decoder_flops_are_counted_for_the_sana_config():
    at_1024 = cost.decoder_flops(1024, 1024)
    assert at_1024 == pytest.approx(8.3686e12, rel=1e-3)  # measured when this was written
    assert cost.decoder_flops(512, 512) * 4 == pytest.approx(at_1024, rel=0.01)  # ~linear in pixels


def _price(usd: float) -> SimpleNamespace:
    return SimpleNamespace(usd_per_hour=usd, source="test", checked="2026-01-01", verified=True)


def test_section_states_the_equal_mfu_ratio_and_the_assumption():
    lines = "\n".join(cost.section([], {"ml.inf2.xlarge": _price(1.0), "ml.g6.xlarge": _price(2.0)}))
    ratio = (1.0 / 190) / (2.0 / 121)
    assert f"costs {ratio:.2f}x what ml.g6.xlarge costs per image" in lines
    assert f"needs it to reach {ratio / 0.6:.2f}x the GPU's MFU" in lines
    assert "ASSUMPTION, the same band for both platforms" in lines
    assert "No serving bench was measured yet" in lines
    missing = "\n".join(cost.section([], {"ml.inf2.xlarge": _price(1.0)}))
    assert "No price for ml.g6.xlarge in the price table" in missing


def test_report_reads_the_serving_bench(bench_json: Path, tmp_path: Path):
    from training.report import cli
    prices = tmp_path / "prices.yaml"
    prices.write_text('as_of: "2026-01-01"\ncurrency: USD\nregion: local\nprices:\n  local:\n'
                      '    usd_per_hour: 2.0\n    source: test\n    checked: "2026-01-01"\n    verified: false\n')
    cli.main(["--project", "--out", str(tmp_path / "r"), "--prices", str(prices), "--serving", str(bench_json)])
    text = (tmp_path / "r" / "report.md").read_text()
    serving = text[text.index("## Serving"):]
    result = ServeBenchResult.load(bench_json)
    expected = cost.cost_per_1000(2.0, 1 / result.images_per_s_per_instance)
    assert f"| `local` compiled-cpu | 64x64, 2 steps | {result.p50_s:,.3f} / {result.p90_s:,.3f} |" in serving
    assert f"${expected:,.4g} |" in serving
    assert "CPU figures from a local run (tiny model), not accelerator figures" in serving
    assert "ml.inf2.xlarge" in serving and "ml.g6.xlarge" in serving  # projected from the shipped prices


def test_endpoint_prices_live_in_their_own_section_of_the_price_table(tmp_path: Path):
    from training.report.prices import DEFAULT_PRICES, PriceTable

    shipped = cost.serving_prices([DEFAULT_PRICES])
    assert set(shipped) == {"ml.inf2.xlarge", "ml.g6.xlarge"}
    assert all(p.source.startswith("https://") and p.verified and p.checked for p in shipped.values())
    # not HyperPod prices: the decision's table (and --prices aws) never sees them
    assert not set(shipped) & set(PriceTable.load(DEFAULT_PRICES).prices)
    # SageMaker endpoint prices, not the EC2 ones beside them: each costs more than its bare instance
    ec2 = PriceTable.load(DEFAULT_PRICES).ec2
    assert all(p.usd_per_hour > ec2[name.removeprefix("ml.")].usd_per_hour for name, p in shipped.items())
    mine = tmp_path / "mine.yaml"
    mine.write_text('as_of: "2026-12-01"\ncurrency: USD\nregion: us-east-1\nprices: {}\nserving:\n  ml.inf2.xlarge:\n'
                    '    usd_per_hour: 0.5\n    source: "https://example.com/quote"\n    checked: "2026-12-01"\n'
                    '    verified: true\n')
    merged = cost.serving_prices([DEFAULT_PRICES, mine])
    assert merged["ml.inf2.xlarge"].usd_per_hour == 0.5 and merged["ml.g6.xlarge"] == shipped["ml.g6.xlarge"]
