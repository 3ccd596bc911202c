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


def default_rows() -> list[cost.Line]:
    return cost.lines(cost.config_from_args([]), PriceTable.load(DEFAULT_PRICES), cost.load_platform_prices())


def test_the_page_shows_exactly_what_the_price_table_computes():
    tables = cost.markdown(cost.config_from_args([]), default_rows(), DEFAULT_PRICES)
    assert tables in DOC.read_text(), "runbooks/cost.md differs from `python -m stacks.cost`: paste its output"


def money(cell: str) -> float:
    return float(cell.strip("* $").replace(",", ""))


def doc_rows() -> dict[str, tuple[float, float]]:
    """what -> ($/hour, $/month) of the page's first table."""
    rows = {}
    for line in DOC.read_text().splitlines():
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
