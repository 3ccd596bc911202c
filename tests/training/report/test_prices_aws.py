"""``--prices aws``: the AWS Price List API through the real boto3 ``pricing`` client.

moto (5.2.5, installed) has no ``pricing`` backend, so the API is botocore's ``Stubber`` on a
real client: the client builds and validates every request against the service model
(botocore/data/pricing/2017-10-15/service-2.json) and the Stubber checks it equals what we
expect, then returns a response validated against the same model. The responses follow the
documented shape: ``PriceList`` is a list of JSON *strings* (API reference,
https://docs.aws.amazon.com/aws-cost-management/latest/APIReference/API_pricing_GetProducts.html,
and botocore's recorded example, botocore/data/pricing/2017-10-15/examples-1.json, which
``test_documented_example_parses`` feeds through verbatim). The failure paths run for real:
no credentials, and an endpoint that refuses connections.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import boto3
import botocore
import pytest
from bench_fixtures import make_result
from botocore.stub import Stubber

from training.model import flops
from training.report import aws_prices, cli
from training.report.assemble import DecisionOptions
from training.report.build import build
from training.report.inputs import Options
from training.report.prices import DEFAULT_PRICES, PriceTable

REPO = Path(__file__).resolve().parents[3]
SHIPPED = PriceTable.load(DEFAULT_PRICES)
#: what the report asks the API about: every known accelerator layout (training/model/flops.py)
WANTED = sorted(flops.INSTANCE_TYPES)


def client():
    return boto3.client("pricing", region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def _item(sku: str, attributes: dict, usd: str, *, service: str, unit: str = "Hrs") -> str:
    """One PriceList entry, shaped like the documented example (examples-1.json GetProducts)."""
    term = f"{sku}.JRTCKXETXF"
    return json.dumps({
        "product": {"productFamily": "ML Instance" if service == "AmazonSageMaker" else "Compute Instance",
                    "attributes": {"servicecode": service, "regionCode": "us-east-1", **attributes}, "sku": sku},
        "serviceCode": service,
        "terms": {"OnDemand": {term: {
            "priceDimensions": {f"{term}.6YS6EN2CT7": {
                "unit": unit, "endRange": "Inf", "description": f"${usd} per hour", "appliesTo": [],
                "rateCode": f"{term}.6YS6EN2CT7", "beginRange": "0", "pricePerUnit": {"USD": usd}}},
            "sku": sku, "effectiveDate": "2026-11-01T00:00:00Z", "offerTermCode": "JRTCKXETXF", "termAttributes": {}}}},
        "version": "20261101000000", "publicationDate": "2026-11-01T00:00:00Z"})


#: HyperPod on-demand SKUs in us-east-1, named the three ways SageMaker's offer file does
#: (vantage-sh/ec2instances.info sagemaker.py): instanceName, instanceType "<type>-<component>",
#: and instanceType "NA" with the type at the end of usagetype
HYPERPOD = {
    "ml.p5.48xlarge": ({"instanceName": "ml.p5.48xlarge", "instanceType": "ml.p5.48xlarge-Cluster",
                        "usagetype": "USE1-Cluster:ml.p5.48xlarge", "platoinstancetype": "Cluster"}, "61.2340000000"),
    "ml.trn1.32xlarge": ({"instanceType": "ml.trn1.32xlarge-Cluster", "usagetype": "USE1-Cluster:ml.trn1.32xlarge",
                          "platoinstancetype": "Cluster"}, "23.4560000000"),
    "ml.p4d.24xlarge": ({"instanceType": "NA", "usagetype": "USE1-Cluster:ml.p4d.24xlarge",
                         "platoinstancetype": "Cluster"}, "24.5670000000"),
    "ml.g5.xlarge": ({"instanceName": "ml.g5.xlarge", "usagetype": "USE1-Cluster:ml.g5.xlarge",
                      "platoinstancetype": "Cluster"}, "1.4150000000"),  # not an accelerator we project: ignored
}
#: the stubbed HyperPod prices (made up, and unlike the shipped table's, so a report that used the
#: table instead of the API fails the tests)
P5_API, TRN1_API = (float(HYPERPOD[n][1]) for n in ("ml.p5.48xlarge", "ml.trn1.32xlarge"))
#: EC2 Linux on-demand; p5 also has a Capacity Block SKU at another price, which must be dropped
EC2 = {"p5.48xlarge": "55.0400000000", "trn1.32xlarge": "21.5000000000", "p5en.48xlarge": "63.2960000000"}


def stub_api(stubber: Stubber, region: str = "us-east-1") -> None:
    """The calls ``fetch`` makes, in order, each with the exact parameters we expect."""
    items = [_item(f"HP{i:012d}", attrs, usd, service="AmazonSageMaker") for i, (attrs, usd) in
             enumerate(HYPERPOD.values())]
    base = {"ServiceCode": "AmazonSageMaker", "Filters": aws_prices.hyperpod_filters(region),
            "FormatVersion": "aws_v1", "MaxResults": 100}
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": items[:2], "NextToken": "page-2"},
                         base)
    stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": items[2:]},
                         {**base, "NextToken": "page-2"})
    for name in WANTED:
        ec2 = name.removeprefix("ml.")
        page = []
        if ec2 in EC2:
            page.append(_item(f"EC{len(page)}{ec2}", {"instanceType": ec2, "marketoption": "OnDemand",
                                                      "usagetype": f"BoxUsage:{ec2}"}, EC2[ec2], service="AmazonEC2"))
        if ec2 == "p5.48xlarge":
            page.append(_item("CB" + ec2, {"instanceType": ec2, "marketoption": "CapacityBlock",
                                           "usagetype": f"CapacityBlock:{ec2}"}, "31.4640000000", service="AmazonEC2"))
        stubber.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": page},
                             {"ServiceCode": "AmazonEC2", "Filters": aws_prices.ec2_filters(ec2, region),
                              "FormatVersion": "aws_v1", "MaxResults": 100})


def _runs(tmp_path: Path) -> list[str]:
    paths = []
    for name, data in (("p5.json", make_result(backend="gpu", instance_type="ml.p5.48xlarge", accelerator="H100-SXM",
                                               nodes=1, per_node=8, sps_per_accel=300.0)),
                       ("trn1.json", make_result(backend="trainium", instance_type="ml.trn1.32xlarge",
                                                 accelerator="NeuronCore-v2", nodes=1, per_node=32,
                                                 sps_per_accel=40.0))):
        (tmp_path / name).write_text(json.dumps(data))
        paths.append(str(tmp_path / name))
    return paths


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No shared cache, no real endpoint, no ambient credentials unless a test sets them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                aws_prices.OFFLINE_ENV, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_PRICING"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role lookup either


def test_prices_aws_against_the_stubbed_api_names_the_api_as_the_source(tmp_path, capsys):
    c = client()
    with Stubber(c) as stubber:
        stub_api(stubber)
        out = tmp_path / "out"
        opts = Options(decision=DecisionOptions(prices=["aws"], pricing_client=c))
        md = build(_runs(tmp_path), out, opts=opts).read_text()
        stubber.assert_no_pending_responses()
    prices = md.split("## Prices and where they came from")[1].split("\n## ")[0]
    rows = {line.split(" | ")[0].strip("| "): line for line in prices.splitlines() if line.startswith("| ml.")}
    for name, (_, usd) in HYPERPOD.items():
        if name in rows:
            assert f"${float(usd):,.3f}" in rows[name] and "AWS Price List API |" in rows[name]
            assert "yes" in rows[name] and "GetProducts AmazonSageMaker sku HP" in rows[name]
    assert {"ml.p5.48xlarge", "ml.trn1.32xlarge", "ml.p4d.24xlarge"} <= set(rows)
    assert "ml.g5.xlarge" not in md
    # EC2 for comparison, the Capacity Block SKU dropped
    ec2 = {line.split(" | ")[0].strip("| "): line for line in prices.splitlines() if line.startswith("| p5.")}
    assert "$55.040" in ec2["p5.48xlarge"] and "AmazonEC2" in ec2["p5.48xlarge"] and "31.464" not in md
    # the API had no HyperPod price for p5en: it keeps the shipped figure, and the report says so;
    # trn2 has neither (the shipped table leaves it out): it is left out of the projection
    assert "ml.p5en.48xlarge (no HyperPod (platoinstancetype=Cluster) product)" in md
    shipped_p5en = SHIPPED.get("ml.p5en.48xlarge").usd_per_hour
    assert (f"| ml.p5en.48xlarge | SageMaker HyperPod (ml.* instance price) | us-east-1 | ${shipped_p5en:,.3f} | "
            "price table |") in md
    assert "ml.trn2.48xlarge" not in SHIPPED.prices and "| ml.trn2.48xlarge |" not in md
    err = capsys.readouterr().err
    assert "prices: no HyperPod price for " in err and "ml.trn2.48xlarge" in err and "Traceback" not in err
    # the costs and the break-even use the fetched prices, not the shipped ones
    r = (TRN1_API / (32 * 95)) / (P5_API / (8 * 989))
    shipped_r = (SHIPPED.get("ml.trn1.32xlarge").usd_per_hour / (32 * 95)) / (SHIPPED.get("ml.p5.48xlarge").usd_per_hour
                                                                            / (8 * 989))
    assert f"{r:.2f}" != f"{shipped_r:.2f}"
    assert f"when its MFU is **{r:.2f}x** the GPU's" in md
    assert f"${P5_API / (2400 * 3600) * 1e6:,.2f}" in md  # p5 run: 8 x 300 samples/s per instance
    assert f"${SHIPPED.get('ml.p5.48xlarge').usd_per_hour / (2400 * 3600) * 1e6:,.2f}" not in md
    # the fetch is cached with its time and the filters it used
    cache = json.loads((tmp_path / "cache" / "sana-training" / "prices-aws-us-east-1.json").read_text())
    assert cache["schema"] == aws_prices.CACHE_SCHEMA and cache["fetched_at"][:10] in md
    assert cache["requests"][0] == {"ServiceCode": "AmazonSageMaker", "Filters": aws_prices.hyperpod_filters("us-east-1")}
    assert cache["hyperpod"]["ml.p5.48xlarge"]["usd_per_hour"] == P5_API


def test_documented_example_parses(tmp_path):
    """botocore's recorded GetProducts example (an EBS volume, priced per GB-month) goes
    through the real client and our parser: read, but no hourly instance price in it."""
    examples = json.loads((Path(botocore.__file__).parent / "data" / "pricing" / "2017-10-15" / "examples-1.json")
                          .read_text())["examples"]["GetProducts"][0]
    c = client()
    with Stubber(c) as stubber:
        base = {"ServiceCode": "AmazonEC2", "Filters": examples["input"]["Filters"], "FormatVersion": "aws_v1",
                "MaxResults": 100}
        stubber.add_response("get_products", examples["output"], base)  # verbatim, with its NextToken
        stubber.add_response("get_products", {"PriceList": []}, {**base, "NextToken": examples["output"]["NextToken"]})
        (item,) = aws_prices.get_products(c, "AmazonEC2", examples["input"]["Filters"])
        stubber.assert_no_pending_responses()
    assert item["product"]["sku"] == "WQGC34PB2AWS8R4U"
    assert item["terms"]["OnDemand"]["WQGC34PB2AWS8R4U.JRTCKXETXF"]["priceDimensions"]
    assert aws_prices.on_demand_offers(item, "io1") == []  # GB-Mo, not Hrs


def test_no_credentials_falls_back_to_the_shipped_table_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    cli.main([*_runs(tmp_path), "--out", str(out), "--prices", "aws"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"prices: AWS Price List API not reached (NoCredentialsError: Unable to locate credentials); "
                   f"falling back to the shipped table prices.yaml (as of {SHIPPED.as_of})"]
    md = (out / "report.md").read_text()
    assert err[0] in md.split("## Recommendation")[0]  # the same line, above the recommendation
    assert f"${SHIPPED.get('ml.p5.48xlarge').usd_per_hour:,.3f} | price table |" in md


def test_unreachable_endpoint_falls_back_and_then_uses_the_cache(tmp_path, capsys, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_PRICING", f"http://127.0.0.1:{port}")
    cli.main([*_runs(tmp_path), "--out", str(tmp_path / "a"), "--prices", "aws"])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("prices:")]
    assert line.startswith("prices: AWS Price List API not reached (EndpointConnectionError: ")
    assert line.endswith(f"falling back to the shipped table prices.yaml (as of {SHIPPED.as_of})")
    # a successful fetch leaves a cache; the next failure uses it and says from when
    c = client()
    with Stubber(c) as stubber:
        stub_api(stubber)
        aws_prices.resolve(["aws"], WANTED, client=c, log=lambda _: None)
    cli.main([*_runs(tmp_path), "--out", str(tmp_path / "b"), "--prices", "aws"])
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("prices:")]
    assert "EndpointConnectionError" in line and "using the cached fetch of " in line
    md = (tmp_path / "b" / "report.md").read_text()
    assert f"| ml.p5.48xlarge | SageMaker HyperPod (ml.* instance price) | us-east-1 | ${P5_API:,.3f} | AWS Price List API " \
           "(cached fetch) |" in md


def test_access_denied_and_unreadable_answers_fall_back(tmp_path):
    c = client()
    with Stubber(c) as stubber:
        stubber.add_client_error("get_products", service_error_code="AccessDeniedException",
                                 service_message="User is not authorized to perform: pricing:GetProducts")
        table, notes = aws_prices.resolve(["aws"], WANTED, client=c, log=lambda _: None)
    assert notes == [f"prices: AWS Price List API not reached (AccessDeniedException: User is not authorized to "
                     f"perform: pricing:GetProducts); falling back to the shipped table prices.yaml (as of "
                     f"{SHIPPED.as_of})"]
    assert table.get("ml.p5.48xlarge") == SHIPPED.get("ml.p5.48xlarge")
    with Stubber(c) as stubber:  # a product without the documented keys
        stubber.add_response("get_products", {"PriceList": [json.dumps({"terms": {}})]})
        _, notes = aws_prices.resolve(["aws"], WANTED, client=c, log=lambda _: None)
    assert "not in the documented shape (missing 'product')" in notes[0]


def test_two_different_hyperpod_prices_are_not_guessed(tmp_path):
    c = client()
    attrs = {"instanceName": "ml.p5.48xlarge", "usagetype": "USE1-Cluster:ml.p5.48xlarge", "platoinstancetype": "Cluster"}
    with Stubber(c) as stubber:
        stubber.add_response("get_products", {"PriceList": [_item("A", attrs, "63.296", service="AmazonSageMaker"),
                                                            _item("B", attrs, "70.0", service="AmazonSageMaker")]})
        stubber.add_response("get_products", {"PriceList": []})  # its EC2 query
        result = aws_prices.fetch(["ml.p5.48xlarge"], "us-west-2", client=c)
        stubber.assert_no_pending_responses()
    assert "ml.p5.48xlarge" not in result.hyperpod
    assert result.missing["ml.p5.48xlarge"] == "2 different on-demand prices ($63.296, $70); not guessing"


@pytest.mark.parametrize(("spec", "needle"), [
    ("aws:mars", "--prices aws:mars: 'mars' is not an AWS region code"),
    ("/nonexistent/prices.yaml", "--prices /nonexistent/prices.yaml: cannot read"),
])
def test_bad_prices_source_is_one_line(tmp_path, capsys, spec, needle):
    with pytest.raises(SystemExit):
        cli.main([*_runs(tmp_path), "--out", str(tmp_path / "o"), "--prices", spec])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and "\n" not in err


def test_live_check_command_reports_what_the_filters_find(tmp_path, capsys, monkeypatch):
    """``python -m training.report.aws_prices``: the check to run on a machine with credentials."""
    c = client()
    monkeypatch.setattr(aws_prices, "make_client", lambda: c)
    with Stubber(c) as stubber:
        stub_api(stubber)
        assert aws_prices.main(["--cache", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert f"ml.p5.48xlarge       HyperPod ${P5_API:,.3f}/h sku HP000000000000 | EC2 $55.040/h" in out
    assert "ml.trn2.48xlarge     HyperPod none: no HyperPod (platoinstancetype=Cluster) product | EC2 none" in out
    with Stubber(c) as stubber:  # the filter matches nothing: the offer file changed, exit 1
        stubber.add_response("get_products", {"PriceList": []})
        for _ in WANTED:
            stubber.add_response("get_products", {"PriceList": []})
        assert aws_prices.main(["--cache", str(tmp_path / "c.json")]) == 1
