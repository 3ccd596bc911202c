"""runbooks/cost.md's figures are the computation from the price table (stacks/cost.py), and
that computation is the arithmetic a reader would do by hand from training/prices.yaml."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stacks import cost
from stacks.config import PlatformConfig
from training.errors import UserError
from training.report.prices import DEFAULT_PRICES, PriceTable

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "runbooks" / "cost.md"
PRICES = yaml.safe_load(DEFAULT_PRICES.read_text())
CONTEXT = json.loads((REPO / "cdk.json").read_text())["context"]


def rows_for(*overrides: str, prices: Path = DEFAULT_PRICES) -> list[cost.Line]:
    return cost.lines(cost.config_from_args(list(overrides)), PriceTable.load(prices), cost.load_platform_prices(prices))


def default_rows() -> list[cost.Line]:
    return rows_for()


@pytest.mark.parametrize("overrides", [[], ["privateNetwork=true"]], ids=["default", "private"])
def test_the_page_shows_exactly_what_the_price_table_computes(overrides):
    tables = cost.markdown(rows_for(*overrides), DEFAULT_PRICES, cost.load_platform_prices(), overrides)
    assert tables in DOC.read_text(), (f"runbooks/cost.md differs from `python -m stacks.cost "
                                       f"{' '.join('-c ' + o for o in overrides)}`: paste its output")


def money(cell: str) -> float:
    return float(cell.strip("* $").replace(",", ""))


def doc_rows() -> dict[str, tuple[float, float]]:
    """what -> ($/hour, $/month) of the page's first table (the default deployment's)."""
    rows = {}
    section = DOC.read_text().split("## The default deployment")[1].split("\n## ")[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\**\$[\d,.]+\**", cells[3]):
            rows[cells[0].strip("*")] = (money(cells[3]), money(cells[4]))
    return rows


def test_the_figures_are_the_price_table_times_the_default_counts():
    """Independently of stacks/cost.py: each instance group is its cdk.json count times its price
    in training/prices.yaml, FSx its capacity times its GB-month price, a month 730 hours."""
    rows = doc_rows()
    for group in ("controller", "login", "gpu", "trn"):
        instance_type = CONTEXT[f"{group}InstanceType"]
        entry = PRICES["prices"].get(instance_type) or PRICES["platform"][instance_type]  # head nodes: platform
        hourly = CONTEXT[f"{group}InstanceCount"] * entry.get("usd_per_hour", entry.get("usd"))
        assert rows[f"{group} nodes ({instance_type})"] == (round(hourly, 2), round(hourly * 730, 2)), group
    fsx = CONTEXT["fsxStorageGiB"] * PRICES["platform"][f"fsx_lustre_persistent2_{CONTEXT['fsxThroughputPerTiB']}"]["usd"]
    assert rows[f"FSx for Lustre ({CONTEXT['fsxStorageGiB']} GiB, {CONTEXT['fsxThroughputPerTiB']} MB/s/TiB)"][1] == \
        round(fsx, 2)
    nat = PRICES["platform"]["nat_gateway"]["usd"] + PRICES["platform"]["public_ipv4"]["usd"]
    assert rows["NAT gateway and its public IPv4 address"] == (round(nat, 2), round(nat * 730, 2))
    ebs = sum(CONTEXT[f"{g}InstanceCount"] * CONTEXT[f"{g}EbsGiB"] for g in ("controller", "login", "gpu", "trn"))
    assert rows["node volumes (secondary EBS)"][1] == round(ebs * PRICES["platform"]["node_ebs"]["usd"], 2)
    fixed = [r for what, r in rows.items() if what != "running, fixed"]
    assert rows["running, fixed"][1] == pytest.approx(sum(m for _, m in fixed), abs=0.05)


def test_what_bills_after_each_teardown_step():
    rows = default_rows()
    after = {step: {r.item for r in rows if not r.usage and step in r.kept_after} for step in ("teardown", "teardown-all")}
    # teardown: the network and storage stacks stay; teardown-all: what dataRemovalPolicy=retain keeps.
    assert {i.split(" (")[0] for i in after["teardown"]} == {"FSx for Lustre", "KMS keys", "NAT gateway and its public IPv4 address"}
    assert {i.split(" (")[0] for i in after["teardown-all"]} == {"FSx for Lustre", "KMS keys"}
    assert not any(r.stack == "cluster" and r.kept_after for r in rows)
    # The observability stack outlives `make teardown` (the cluster depends on it): its workspace's
    # metrics history bills by use until `make teardown-all` destroys it with the storage stack.
    used = {step: {r.item for r in rows if r.usage and step in r.kept_after} for step in ("teardown", "teardown-all")}
    history = "Managed Prometheus metrics stored (the workspace's history)"
    assert history in used["teardown"] and history not in used["teardown-all"]
    destroy = cost.lines(PlatformConfig(dataRemovalPolicy="destroy"), PriceTable.load(DEFAULT_PRICES),
                         cost.load_platform_prices())
    assert cost.hourly(destroy, "teardown-all") == 0.0


def test_make_teardown_prints_what_stays_and_a_bad_key_is_one_line():
    run = [sys.executable, "-m", "stacks.cost"]
    out = subprocess.run([*run, "kept", "--after", "teardown-all"], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == "teardown-all: still billing after this step (runbooks/cost.md, runbooks/teardown.md):"
    assert re.search(r"^  - FSx for Lustre \(1200 GiB, 250 MB/s/TiB\) \[storage\]: \$252\.00/month$", out.stdout, re.M)
    bad = subprocess.run([*run, "-c", "gpuInstanceCont=2"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: invalid context value gpuInstanceCont='2': unknown context key; known keys:")
    assert bad.stderr.count("\n") == 1


def test_a_bad_platform_price_names_its_key(tmp_path):
    broken = dict(PRICES)
    broken["platform"] = {**PRICES["platform"], "nat_gateway": {**PRICES["platform"]["nat_gateway"], "per": "day"}}
    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(UserError, match=r"key platform\.nat_gateway\.per: 'day' is not one of hour, month"):
        cost.load_platform_prices(path)


def test_a_platform_price_needs_a_real_date_when_verified(tmp_path):
    for checked, verified in (("June 2026", True), (None, True)):
        broken = dict(PRICES)
        broken["platform"] = {**PRICES["platform"],
                              "kms_key": {**PRICES["platform"]["kms_key"], "checked": checked, "verified": verified}}
        path = tmp_path / "prices.yaml"
        path.write_text(yaml.safe_dump(broken))
        with pytest.raises(UserError, match=r"key platform\.kms_key\.checked: give the date the source shows"):
            cost.load_platform_prices(path)


def line(rows: list[cost.Line], start: str) -> cost.Line:
    (found,) = [r for r in rows if r.item.startswith(start)]
    return found


def test_grafana_bills_per_active_user_while_the_observability_stack_exists():
    rows = rows_for("grafana=true")
    for role in ("editor", "viewer"):
        r = line(rows, f"Managed Grafana {role}s")
        assert r.usage and r.prices == (f"grafana_{role}",) and r.stack == "observability"
        assert r.how == f"${PRICES['platform'][f'grafana_{role}']['usd']:g} per user-month"
        assert r.kept_after == cost.until_removed("observability") == ("teardown",)
    assert cost.hourly(rows) == cost.hourly(default_rows())  # by use only: the fixed figures do not move
    assert not [r for r in rows_for("observability=false") if r.stack == "observability"]


def test_an_unpriced_mlflow_server_is_listed_outside_the_totals_and_the_teardown_summary_still_runs(tmp_path):
    """No public price for the tracking server is shipped: `make teardown`'s closing summary must
    still run (it follows the destroy) and name what to enter; a price file with one prices it."""
    rows = rows_for("mlflowTrackingServer=true")
    server = line(rows, "SageMaker MLflow tracking server")
    assert server.unpriced == f"platform.{cost.MLFLOW_PRICE}" and server.kept_after == ("teardown",)
    assert cost.hourly(rows) == cost.hourly(default_rows())
    run = [sys.executable, "-m", "stacks.cost"]
    out = subprocess.run([*run, "kept", "--after", "teardown", "-c", "mlflowTrackingServer=true"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ("  - SageMaker MLflow tracking server (Small) [observability]: not priced (add "
            f"platform.{cost.MLFLOW_PRICE} to the price table)") in out.stdout.splitlines()
    assert out.stdout.splitlines()[-1].endswith("plus 1 not priced, plus what is billed by use")
    tables = subprocess.run([*run, "-c", "mlflowTrackingServer=true"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    assert "Not in the totals (no price in the table): SageMaker MLflow tracking server (Small)." in tables
    # With a price entered, the server is an hourly line inside the totals.
    mine = dict(PRICES)
    entry = {**PRICES["platform"]["nat_gateway"], "usd": 0.75, "note": "what we pay"}
    mine["platform"] = {**PRICES["platform"], cost.MLFLOW_PRICE: entry}
    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump(mine))
    priced = rows_for("mlflowTrackingServer=true", prices=path)
    assert not line(priced, "SageMaker MLflow").unpriced
    assert cost.hourly(priced) == pytest.approx(cost.hourly(default_rows()) + 0.75)
    assert cost.hourly(priced, "teardown") == pytest.approx(cost.hourly(default_rows(), "teardown") + 0.75)


def test_accounting_keeps_its_secret_after_teardown_all_and_its_database_until_then():
    rows = rows_for("slurmAccounting=true")
    database, secret = line(rows, "Slurm accounting database"), line(rows, "Secrets Manager secret")
    acu = PRICES["platform"]["aurora_serverless_v2"]["usd"]
    assert database.usd_per_hour == pytest.approx(2 * 0.5 * acu) and database.kept_after == ("teardown",)
    assert secret.usd_per_hour * 730 == pytest.approx(PRICES["platform"]["secrets_manager_secret"]["usd"])
    assert secret.kept_after == ("teardown", "teardown-all")  # dataRemovalPolicy=retain (cdk.json)
    gone = rows_for("slurmAccounting=true", "dataRemovalPolicy=destroy")
    assert cost.hourly(gone, "teardown-all") == 0.0


def test_a_type_the_table_leaves_out_is_listed_not_priced_and_teardown_still_summarizes():
    """ml.trn2.48xlarge has no dated price (training/prices.yaml says why): a deployment of it
    still gets `make teardown`'s closing summary, and the tables say which entry to add."""
    run = [sys.executable, "-m", "stacks.cost", "-c", "trnInstanceType=ml.trn2.48xlarge"]
    out = subprocess.run([*run[:3], "kept", "--after", "teardown", *run[3:]], cwd=REPO, capture_output=True, text=True)
    after = cost.hourly(default_rows(), "teardown") * cost.HOURS_PER_MONTH  # the trn nodes are gone by then anyway
    assert out.returncode == 0 and f"fixed total: ${after:,.2f}/month, plus what is billed by use" in out.stdout, \
        out.stderr
    rows = rows_for("trnInstanceType=ml.trn2.48xlarge")
    trn = line(rows, "trn nodes")
    assert trn.unpriced == "prices.ml.trn2.48xlarge" and trn.usd_per_hour == 0
    assert cost.hourly(rows) == pytest.approx(cost.hourly(default_rows()) - PRICES["prices"]["ml.trn1.32xlarge"]["usd_per_hour"])
    tables = subprocess.run(run, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "Not in the totals (no price in the table): trn nodes (ml.trn2.48xlarge)." in tables
    # The same for an endpoint size the `serving` section has no price for.
    served = ["serving=true", "servingInstanceType=ml.g6.2xlarge",
              "servingModelDataUrl=s3://sana-artefacts-123456789012-us-east-1/serving/model-0123456789ab.tar.gz"]
    endpoint = line(rows_for(*served), "serving endpoint")
    assert endpoint.unpriced == "serving.ml.g6.2xlarge" and endpoint.kept_after == ()
    assert "ml.g6.2xlarge" not in PRICES["serving"]
