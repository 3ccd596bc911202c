"""stacks/cost.py bills what the synthesized templates deploy, and says what bills after each
teardown step as the Makefile's destroys and the stacks' dependencies decide it.

Each cost line is re-derived from the templates of a synthesized variant (conftest.py) and the
price table: ``default`` (observability on, NAT egress), ``private`` (privateNetwork with
accounting: no NAT, one interface endpoint per required service) and ``trn_only``
(observability off, the serving stack on). Nothing here is a typed figure: counts, sizes and
instance types come from the templates, prices from training/prices.yaml.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from stacks import cost
from stacks.platform import PlatformConfig, cdk_json_context
from training.report.prices import DEFAULT_PRICES, PriceTable

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PRICES = cost.load_platform_prices()
TABLE = PriceTable.load(DEFAULT_PRICES)


def cost_lines(synth) -> list[cost.Line]:
    return cost.lines(PlatformConfig.from_context({**cdk_json_context(), **synth.context}), TABLE, PRICES)


def priced_by(rows: list[cost.Line], name: str) -> list[cost.Line]:
    return [r for r in rows if name in r.prices]


def count(synth, type_: str) -> int:
    return sum(1 for t in synth.templates.values() for r in t["Resources"].values() if r["Type"] == type_)


def monthly(rows: list[cost.Line]) -> float:
    return sum(r.usd_per_hour for r in rows) * cost.HOURS_PER_MONTH


@pytest.mark.parametrize("variant", ["default", "private", "trn_only"])
def test_every_fixed_line_is_what_the_templates_deploy_at_the_table_price(variant, synthesized):
    synth = synthesized(variant)
    rows = cost_lines(synth)
    # Instance groups: count x the ml.* price, and the secondary volumes x the node_ebs price.
    ebs_gib = 0
    for name, group in synth.groups().items():
        (line,) = [r for r in rows if r.item == f"{name} nodes ({group['InstanceType']})"]
        if group["InstanceType"] in TABLE.prices or group["InstanceType"] in PRICES:
            assert line.usd_per_hour == pytest.approx(group["InstanceCount"] * cost.instance_price(
                TABLE, PRICES, group["InstanceType"])), name
        else:  # a type the table leaves out (trn_only's ml.trn2.48xlarge): listed, outside the totals
            assert line.unpriced == f"prices.{group['InstanceType']}" and line.usd_per_hour == 0, line
        ebs_gib += group["InstanceCount"] * sum(c["EbsVolumeConfig"].get("VolumeSizeInGB", 0)
                                                for c in group["InstanceStorageConfigs"] if "EbsVolumeConfig" in c
                                                and not c["EbsVolumeConfig"].get("RootVolume"))
    assert monthly(priced_by(rows, "node_ebs")) == pytest.approx(ebs_gib * PRICES["node_ebs"].usd)
    # FSx: capacity x the price of its throughput tier.
    (fsx,) = [r["Properties"] for r in synth.resources("Storage", "AWS::FSx::FileSystem").values()]
    tier = f"fsx_lustre_persistent2_{fsx['LustreConfiguration']['PerUnitStorageThroughput']}"
    assert monthly(priced_by(rows, tier)) == pytest.approx(fsx["StorageCapacity"] * PRICES[tier].usd)
    # Every customer managed key of every stack, per month.
    assert monthly(priced_by(rows, "kms_key")) == pytest.approx(count(synth, "AWS::KMS::Key") * PRICES["kms_key"].usd)
    # NAT egress: each gateway's hours and each Elastic IP's, or none at all.
    nat = priced_by(rows, "nat_gateway")
    assert monthly(nat) == pytest.approx(count(synth, "AWS::EC2::NatGateway") * PRICES["nat_gateway"].usd * 730
                                         + count(synth, "AWS::EC2::EIP") * PRICES["public_ipv4"].usd * 730)
    assert bool(nat) == (count(synth, "AWS::EC2::NatGateway") > 0)
    # The accounting database: its instances at their minimum ACU, and its secret.
    for db in synth.resources("Storage", "AWS::RDS::DBCluster").values():
        minimum = db["Properties"]["ServerlessV2ScalingConfiguration"]["MinCapacity"]
        assert monthly(priced_by(rows, "aurora_serverless_v2")) == pytest.approx(
            count(synth, "AWS::RDS::DBInstance") * minimum * PRICES["aurora_serverless_v2"].usd * 730)
    assert bool(priced_by(rows, "aurora_serverless_v2")) == (count(synth, "AWS::RDS::DBCluster") > 0)
    assert monthly(priced_by(rows, "secrets_manager_secret")) == pytest.approx(
        count(synth, "AWS::SecretsManager::Secret") * PRICES["secrets_manager_secret"].usd)
    # The serving endpoint, where its stack exists.
    endpoints = synth.resources("Serving", "AWS::SageMaker::Endpoint") if "Serving" in synth.templates else {}
    assert len([r for r in rows if r.stack == "serving"]) == len(endpoints)


def interface_endpoints(synth) -> dict[str, dict]:
    """Service (after com.amazonaws.<region>.) -> properties, of the template's interface endpoints."""
    out = {}
    for props in (r["Properties"] for r in synth.resources("Network", "AWS::EC2::VPCEndpoint").values()):
        if props["VpcEndpointType"] == "Interface":
            out[props["ServiceName"]["Fn::Join"][1][2].removeprefix(".")] = props
    return out


@pytest.mark.parametrize("variant", ["default", "private"])
def test_a_private_network_bills_one_line_per_interface_endpoint_and_no_nat(variant, synthesized):
    synth = synthesized(variant)
    rows = cost_lines(synth)
    in_template = interface_endpoints(synth)
    lines = {re.fullmatch(r"interface endpoint (\S+) \(1 AZ\)", r.item).group(1): r
             for r in priced_by(rows, "vpc_interface_endpoint")}
    assert set(lines) == set(in_template)
    for service, props in in_template.items():  # billed per endpoint and AZ: one subnet each here
        assert lines[service].usd_per_hour == pytest.approx(len(props["SubnetIds"]) * PRICES["vpc_interface_endpoint"].usd)
    usage = {r.item for r in rows if r.usage}
    if variant == "private":
        assert len(lines) == len(in_template) >= 10
        assert not priced_by(rows, "nat_gateway") and "NAT gateway traffic" not in usage
        assert "interface endpoint traffic" in usage
    else:
        assert not lines and "interface endpoint traffic" not in usage and "NAT gateway traffic" in usage


@pytest.mark.parametrize("variant", ["default", "trn_only"])
def test_observability_lines_follow_its_stack(variant, synthesized):
    synth = synthesized(variant)
    rows = cost_lines(synth)
    workspaces = synth.resources("Observability", "AWS::APS::Workspace") if "Observability" in synth.templates else {}
    amp = [r for r in rows if {"amp_ingestion", "amp_storage"} & set(r.prices)]
    assert len(amp) == 2 * len(workspaces)
    assert all(r.usage and r.stack == "observability" for r in amp)
    assert bool(workspaces) == (variant == "default")  # trn_only turns observability off
    assert not [r for r in rows if r.stack == "observability" and r not in amp]  # no Grafana, no MLflow asked


def removed_by_make() -> dict[str, str]:
    """stack -> the `make` step that destroys it, from the Makefile's teardown recipes and the cloud
    assembly's dependencies of the default variant: `cdk destroy X` also destroys X's dependents
    (aws-cdk CLI: expandDown unless --exclusively)."""
    makefile = (REPO / "Makefile").read_text()
    named: dict[str, set[str]] = {}
    for step in cost.STEPS[1:]:
        recipe = re.search(rf"^{step}:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
        named[step] = {m for line in recipe.splitlines() if "destroy" in line
                       for m in re.findall(r"\$\(PROJECT\)-([a-z]+)", line)}
    return named


@pytest.fixture(scope="module")
def dependents(default) -> dict[str, set[str]]:
    manifest = json.loads((default.outdir / "manifest.json").read_text())
    stacks = {k.removeprefix("sana-") for k, v in manifest["artifacts"].items()
              if v["type"] == "aws:cloudformation:stack"} | {"serving"}
    deps = {s: {d.removeprefix("sana-") for d in manifest["artifacts"].get(f"sana-{s}", {}).get("dependencies", [])}
            for s in stacks}
    return {s: {t for t in stacks if s in deps[t]} for s in stacks}


def test_each_stack_is_removed_by_the_step_the_makefile_and_the_dependencies_say(dependents):
    removed: dict[str, str] = {}
    for step, named in removed_by_make().items():
        todo = list(named)
        while todo:  # the named stacks and, transitively, every stack that depends on one
            stack = todo.pop()
            if stack not in removed:
                removed[stack] = step
                todo += dependents.get(stack, set())
    assert removed == cost.REMOVED_BY
    assert removed["observability"] == "teardown-all"  # it depends on storage; the cluster depends on it


@pytest.mark.parametrize("variant", ["default", "private", "trn_only"])
def test_a_fixed_line_bills_until_its_stack_is_destroyed(variant, synthesized):
    """...and beyond only where dataRemovalPolicy=retain keeps the resource (FSx, the keys, the secret)."""
    for r in cost_lines(synthesized(variant)):
        if r.usage:
            continue
        last = max(r.stack.split(", "), key=lambda stack: cost.STEPS.index(cost.REMOVED_BY[stack]))
        assert r.kept_after in (cost.until_removed(last), cost.STEPS[1:]), r
        if r.kept_after == cost.STEPS[1:]:
            assert set(r.prices) & {"kms_key", "secrets_manager_secret"} or r.item.startswith("FSx"), r
