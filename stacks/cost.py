"""What a deployment costs, from the price table: per hour and month while it runs, and what
keeps billing after each teardown step (runbooks/cost.md, runbooks/teardown.md).

    python -m stacks.cost [-c key=value ...]                       the tables of runbooks/cost.md
    python -m stacks.cost kept --after teardown|teardown-all [-c key=value ...]

The configuration is cdk.json's context (plus ``-c`` overrides, as the CDK CLI takes them). The
prices are training/prices.yaml: the accelerator instances from its ``prices``
# source), note (what the source is)}. `serving`: endpoint prices for the report's "Serving"
# section (training/report/serving.py), same entry layout. `platform` (at the end): what the rest
# of a deployment bills (stacks/cost.py, runbooks/cost.md), {usd, per, source, checked, verified,
# note}, same dating rule.

Fixed costs are what the resources bill by the hour or month whatever is done with them; what
depends on use (GB stored in S3 and ECR, log and metric volume, NAT or endpoint traffic,
CloudTrail events, Grafana users) is listed with its unit price, never guessed. A fixed line whose
price the table lacks (the MLflow tracking server: no public figure was found; an instance or
endpoint type the table leaves out, such as ml.trn2.48xlarge) is listed as not priced, outside
the totals, rather than failing a teardown's closing summary. A month is 730
hours, the convention of AWS's price pages. Plain data: no aws_cdk import (it runs in the deploy
venv, requirements-deploy.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from stacks.config import ConfigError, PlatformConfig, check_known_keys
from stacks.endpoints import required_endpoints
from training.errors import UserError
from training.report.prices import DEFAULT_PRICES, PriceTable, parse_price, price_provenance

HOURS_PER_MONTH = 730
UNITS = ("hour", "month", "GB-month", "GB", "100k-events", "10M-samples", "user-month")
REPO = Path(__file__).resolve().parents[1]
#: After which teardown step a resource still bills (runbooks/teardown.md). "running": always.
STEPS = ("running", "teardown", "teardown-all")
#: The `make` step whose `cdk destroy` removes each stack (the Makefile's teardown targets).
#: `cdk destroy X` also destroys every stack that depends on X unless --exclusively (the aws-cdk
#: CLI selects destroy targets with expandDown: aws-cdk npm package 2.1148.1, lib/index.js,
#: `case "destroy"`), so the observability stack, which depends on storage's key, goes with
#: `teardown-all`; `teardown` leaves it (the cluster depends on it, not the reverse).
REMOVED_BY = {"serving": "teardown", "cluster": "teardown", "observability": "teardown-all",
              "storage": "teardown-all", "network": "teardown-all"}
#: The hourly price of the tracking server size stacks/observability.py deploys (Small). Not
#: shipped in training/prices.yaml: no public figure was found (its platform section says so).
MLFLOW_PRICE = "sagemaker_mlflow_small"


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitPrice:
    """One entry of the price table's ``platform`` section."""

    name: str
    usd: float
    per: str
    source: str
    verified: bool
    checked: str = ""  # YYYY-MM-DD the source shows; "" when undated
    note: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Line:
    """One thing that bills: a fixed $/hour (``usd_per_hour``) or a price per use (``usage``)."""

    item: str
    stack: str
    how: str
    kept_after: tuple[str, ...] = ()
    usd_per_hour: float = 0.0
    usage: bool = False
    prices: tuple[str, ...] = ()
    """The price table entries the line is priced from (``platform`` keys or ml.* types)."""
    unpriced: str = ""
    """A fixed line whose price the table lacks: the entry to add (``prices.<ml type>``,
    ``platform.<key>``); the line is listed outside the totals."""


def until_removed(stack: str) -> tuple[str, ...]:
    """The teardown steps after which a resource of ``stack`` still exists (it bills until its stack goes)."""
    return STEPS[1:STEPS.index(REMOVED_BY[stack])]


def load_platform_prices(path: Path = DEFAULT_PRICES) -> dict[str, UnitPrice]:
    """The ``platform`` section; a bad entry raises UserError naming the file and the key."""
    data = yaml.safe_load(Path(path).read_text())
    section = data.get("platform") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise UserError(f"{path}: no 'platform' mapping of name -> {{usd, per, source, checked, verified}}")
    return {str(name): _platform_entry(Path(path), str(name), entry) for name, entry in section.items()}


def _platform_entry(path: Path, name: str, entry: Any) -> UnitPrice:
    where = f"{path}: key platform.{name}"
    if not isinstance(entry, dict):
        raise UserError(f"{where}: expected a mapping with usd, per, source, checked, verified")
    usd = entry.get("usd")
    if isinstance(usd, bool) or not isinstance(usd, int | float) or not usd > 0:
        raise UserError(f"{where}.usd: must be a number > 0, got {usd!r}")
    if entry.get("per") not in UNITS:
        raise UserError(f"{where}.per: {entry.get('per')!r} is not one of {', '.join(UNITS)}")
    checked = price_provenance(entry, where)
    return UnitPrice(name=name, usd=float(usd), per=entry["per"], source=entry["source"],
                     verified=entry["verified"], checked=str(checked), note=str(entry.get("note", "")))


def instance_price(table: PriceTable, prices: dict[str, UnitPrice], instance_type: str) -> float:
    """$/hour of an ml.* type: the accelerators from ``prices`` (the decision's table), the head
    nodes' CPU types from ``platform``."""
    if instance_type in table.prices:
        return table.prices[instance_type].usd_per_hour
    if instance_type in prices and prices[instance_type].per == "hour":
        return prices[instance_type].usd
    raise UserError(f"no price for {instance_type} in {table.path}: add platform.{instance_type} (usd, per: hour) "
                    f"or prices.{instance_type}")


def serving_price(table: PriceTable, instance_type: str) -> float:
    """The endpoint's $/hour from the price file's ``serving`` section (training/report/serving.py's
    layout, validated by the same entry check as every price)."""
    data = yaml.safe_load(Path(table.path).read_text())
    entry = (data.get("serving") or {}).get(instance_type)
    if entry is None:
        raise UserError(f"no serving.{instance_type} in {table.path}; add its endpoint price there")
    return parse_price(Path(table.path), "serving", instance_type, entry, table.region).usd_per_hour


def _price(prices: dict[str, UnitPrice], name: str, per: str) -> UnitPrice:
    price = prices.get(name)
    if price is None or price.per != per:
        raise UserError(f"no platform.{name} priced per {per} in the price table; add it to training/prices.yaml")
    return price


def lines(cfg: PlatformConfig, table: PriceTable, prices: dict[str, UnitPrice]) -> list[Line]:
    """Everything ``cfg`` deploys that bills, by stack, with what keeps it after each teardown."""
    data_kept = STEPS[1:] if cfg.dataRemovalPolicy == "retain" else until_removed("storage")
    return [*_compute_lines(cfg, table, prices), *_storage_lines(cfg, prices, data_kept),
            *_network_lines(cfg, prices), *_observability_lines(cfg, prices), *_usage_lines(cfg, prices, data_kept)]


def _compute_lines(cfg: PlatformConfig, table: PriceTable, prices: dict[str, UnitPrice]) -> list[Line]:
    out = []
    nodes = [("controller", cfg.controllerInstanceType, cfg.controllerInstanceCount, cfg.controllerEbsGiB),
             ("login", cfg.loginInstanceType, cfg.loginInstanceCount, cfg.loginEbsGiB),
             ("gpu", cfg.gpuInstanceType, cfg.gpuInstanceCount, cfg.gpuEbsGiB),
             ("trn", cfg.trnInstanceType, cfg.trnInstanceCount, cfg.trnEbsGiB)]
    ebs_gib = 0
    for group, instance_type, count, ebs in nodes:
        if not count:
            continue
        ebs_gib += count * ebs
        item = f"{group} nodes ({instance_type})"
        try:
            price = instance_price(table, prices, instance_type)
        except UserError:  # a type the table leaves out on purpose (ml.trn2, ml.p5e: training/prices.yaml)
            out.append(Line(item=item, stack="cluster", unpriced=f"prices.{instance_type}",
                            how=f"{count} x (no price in the table: add prices.{instance_type}, usd_per_hour)"))
            continue
        out.append(Line(item=item, stack="cluster", usd_per_hour=count * price, how=f"{count} x ${price:g}/h",
                        prices=(instance_type,)))
    if cfg.serving:
        item = f"serving endpoint ({cfg.servingInstanceType}, 1 to {cfg.servingMaxInstances} instances)"
        try:
            price = serving_price(table, cfg.servingInstanceType)
        except UserError:  # a size the table has no price for (ml.inf2.8xlarge, ml.g6.2xlarge)
            out.append(Line(item=item, stack="serving", unpriced=f"serving.{cfg.servingInstanceType}",
                            how=f"at least 1 x (no price in the table: add serving.{cfg.servingInstanceType})"))
        else:
            out.append(Line(item=item, stack="serving", usd_per_hour=price, prices=(cfg.servingInstanceType,),
                            how=f"at least 1 x ${price:g}/h (auto-scaling adds more)"))
    ebs = _price(prices, "node_ebs", "GB-month")
    out.append(Line(item="node volumes (secondary EBS)", stack="cluster", usd_per_hour=ebs_gib * ebs.usd / HOURS_PER_MONTH,
                    how=f"{ebs_gib} GB x ${ebs.usd:g}/GB-month", prices=(ebs.name,)))
    return out


def _storage_lines(cfg: PlatformConfig, prices: dict[str, UnitPrice], data_kept: tuple[str, ...]) -> list[Line]:
    fsx = _price(prices, f"fsx_lustre_persistent2_{cfg.fsxThroughputPerTiB}", "GB-month")
    kms = _price(prices, "kms_key", "month")
    out = [Line(item=f"FSx for Lustre ({cfg.fsxStorageGiB} GiB, {cfg.fsxThroughputPerTiB} MB/s/TiB)", stack="storage",
                usd_per_hour=cfg.fsxStorageGiB * fsx.usd / HOURS_PER_MONTH, kept_after=data_kept,
                how=f"{cfg.fsxStorageGiB} GB x ${fsx.usd:g}/GB-month", prices=(fsx.name,)),
           Line(item="KMS keys (platform key; the network stack's handler-log key)", stack="storage, network",
                usd_per_hour=2 * kms.usd / HOURS_PER_MONTH, kept_after=data_kept, how=f"2 x ${kms.usd:g}/month",
                prices=(kms.name,))]
    if cfg.slurmAccounting:
        acu, secret = _price(prices, "aurora_serverless_v2", "hour"), _price(prices, "secrets_manager_secret", "month")
        out += [Line(item="Slurm accounting database (Aurora Serverless v2, writer + reader at 0.5 ACU)",
                     stack="storage", usd_per_hour=2 * 0.5 * acu.usd, kept_after=until_removed("storage"),
                     how=f"2 x 0.5 ACU x ${acu.usd:g}/ACU-h", prices=(acu.name,)),
                Line(item="Secrets Manager secret (slurmdbd's login)", stack="storage",
                     usd_per_hour=secret.usd / HOURS_PER_MONTH, kept_after=data_kept,
                     how=f"1 x ${secret.usd:g}/month", prices=(secret.name,))]
    return out


def _network_lines(cfg: PlatformConfig, prices: dict[str, UnitPrice]) -> list[Line]:
    """NAT egress, or with privateNetwork one interface endpoint per required service, each in the
    cluster subnet's one AZ (stacks/private_endpoints.py), so one endpoint-hour per hour."""
    if cfg.privateNetwork:
        endpoint = _price(prices, "vpc_interface_endpoint", "hour")
        return [Line(item=f"interface endpoint {e.service} (1 AZ)", stack="network", usd_per_hour=endpoint.usd,
                     kept_after=until_removed("network"), how=f"1 x ${endpoint.usd:g}/h", prices=(endpoint.name,))
                for e in required_endpoints(cfg)]
    nat, ipv4 = _price(prices, "nat_gateway", "hour"), _price(prices, "public_ipv4", "hour")
    return [Line(item="NAT gateway and its public IPv4 address", stack="network", kept_after=until_removed("network"),
                 usd_per_hour=nat.usd + ipv4.usd, how=f"${nat.usd:g}/h + ${ipv4.usd:g}/h", prices=(nat.name, ipv4.name))]


def _observability_lines(cfg: PlatformConfig, prices: dict[str, UnitPrice]) -> list[Line]:
    """The observability stack's fixed part: only the optional MLflow tracking server bills by the
    hour (the Prometheus workspace, its rules, the SNS topic and Grafana bill by use)."""
    if not (cfg.observability and cfg.mlflowTrackingServer):
        return []
    item, kept = "SageMaker MLflow tracking server (Small)", until_removed("observability")
    price = prices.get(MLFLOW_PRICE)
    if price is None or price.per != "hour":
        return [Line(item=item, stack="observability", kept_after=kept, unpriced=f"platform.{MLFLOW_PRICE}",
                     how=f"no price in the table: add platform.{MLFLOW_PRICE} (per: hour)")]
    return [Line(item=item, stack="observability", kept_after=kept, usd_per_hour=price.usd, how=f"1 x ${price.usd:g}/h",
                 prices=(price.name,))]


def _usage_lines(cfg: PlatformConfig, prices: dict[str, UnitPrice], data_kept: tuple[str, ...]) -> list[Line]:
    kept_observability = until_removed("observability")
    usage = [
        ("S3 objects (data, artefacts incl. FSx exports, lifecycle, access logs)", "storage, network", "s3_standard",
         "GB-month", data_kept),
        ("training images in ECR", "storage", "ecr_storage", "GB-month", data_kept),
        ("CloudWatch Logs ingestion (nodes' logs, handlers, accounting)", "all", "cloudwatch_logs_ingestion", "GB", ()),
        ("CloudWatch log groups (cluster, handlers, accounting)", "all", "cloudwatch_logs_storage", "GB-month",
         STEPS[1:]),
    ]
    if cfg.privateNetwork:
        usage.append(("interface endpoint traffic", "network", "vpc_endpoint_data", "GB", ()))
    else:
        usage.append(("NAT gateway traffic", "network", "nat_gateway_data", "GB", ()))
    if cfg.cloudTrail:
        usage.append(("CloudTrail S3 data events", "storage", "cloudtrail_data_events", "100k-events",
                      until_removed("storage")))
    if cfg.slurmAccounting:
        usage.append(("accounting database's final snapshot", "storage", "rds_snapshot_storage", "GB-month",
                      ("teardown-all",) if cfg.dataRemovalPolicy == "retain" else ()))
    if cfg.observability:
        usage += [("Managed Prometheus samples ingested (the nodes' and jobs' metrics)", "observability",
                   "amp_ingestion", "10M-samples", ()),
                  ("Managed Prometheus metrics stored (the workspace's history)", "observability", "amp_storage",
                   "GB-month", kept_observability)]
        if cfg.grafana:
            usage += [("Managed Grafana editors (active users)", "observability", "grafana_editor", "user-month",
                       kept_observability),
                      ("Managed Grafana viewers (active users)", "observability", "grafana_viewer", "user-month",
                       kept_observability)]
    out = []
    for item, stack, name, per, kept in usage:
        price = _price(prices, name, per)
        out.append(Line(item=item, stack=stack, usage=True, kept_after=kept, how=f"${price.usd:g} per {per}",
                        prices=(name,)))
    return out


def hourly(rows: list[Line], step: str = "running") -> float:
    """The fixed cost per hour while running, or of what still bills after ``step`` (priced lines only)."""
    return sum(r.usd_per_hour for r in rows if not r.usage and (step == "running" or step in r.kept_after))


def _money(usd: float) -> str:
    return f"${usd:,.2f}"


def _source_words(rows: list[Line], prices: dict[str, UnitPrice]) -> str:
    undated = sorted({p for r in rows for p in r.prices if p in prices and not prices[p].checked})
    return ("each entry names the dated public source it was read in"
            + (f"; undated: {', '.join(undated)}" if undated else ""))


def markdown(rows: list[Line], table_path: Path, prices: dict[str, UnitPrice], overrides: Sequence[str] = ()) -> str:
    """runbooks/cost.md's tables (the doc test compares them with this output)."""
    shown = table_path.relative_to(REPO) if table_path.is_relative_to(REPO) else table_path
    context = "cdk.json's context" + "".join(f" -c {o}" for o in overrides)
    out = [f"Configuration: {context}; prices: `{shown}` ({_source_words(rows, prices)}).", "",
           "| what | stack | how | $/hour | $/month |", "|---|---|---|---:|---:|"]
    for r in rows:
        if r.usage:
            continue
        figures = ("not priced", "not priced") if r.unpriced else (_money(r.usd_per_hour),
                                                                   _money(r.usd_per_hour * HOURS_PER_MONTH))
        out.append(f"| {r.item} | {r.stack} | {r.how} | {figures[0]} | {figures[1]} |")
    total = hourly(rows)
    out.append(f"| **running, fixed** | | | **{_money(total)}** | **{_money(total * HOURS_PER_MONTH)}** |")
    unpriced = [r.item for r in rows if r.unpriced]
    if unpriced:
        out += ["", f"Not in the totals (no price in the table): {'; '.join(unpriced)}."]
    out += ["", "Billed by use, on top:", "", "| what | stack | price |", "|---|---|---|"]
    out += [f"| {r.item} | {r.stack} | {r.how} |" for r in rows if r.usage]
    out += ["", "| after | still billing, fixed | $/month | and by use |", "|---|---|---:|---|"]
    for step in STEPS[1:]:
        fixed = [r.item + (" (not priced)" if r.unpriced else "") for r in rows if not r.usage and step in r.kept_after]
        used = [r.item for r in rows if r.usage and step in r.kept_after]
        out.append(f"| `make {step}` | {'; '.join(fixed) or 'nothing'} | "
                   f"{_money(hourly(rows, step) * HOURS_PER_MONTH)} | {'; '.join(used) or 'nothing'} |")
    return "\n".join(out)


def kept(rows: list[Line], step: str) -> str:
    """What `make <step>` leaves billing, one line each, for the end of its output."""
    out = [f"{step}: still billing after this step (runbooks/cost.md, runbooks/teardown.md):"]
    for r in rows:
        if step in r.kept_after:
            if r.unpriced:
                cost = f"not priced (add {r.unpriced} to the price table)"
            else:
                cost = f"{_money(r.usd_per_hour * HOURS_PER_MONTH)}/month" if not r.usage else r.how
            out.append(f"  - {r.item} [{r.stack}]: {cost}")
    unpriced = sum(1 for r in rows if r.unpriced and step in r.kept_after)
    out.append(f"  fixed total: {_money(hourly(rows, step) * HOURS_PER_MONTH)}/month"
               + (f" plus {unpriced} not priced" if unpriced else "") + ", plus what is billed by use")
    return "\n".join(out)


def config_from_args(overrides: list[str]) -> PlatformConfig:
    """cdk.json's context with ``-c key=value`` overrides, validated as synth does."""
    context: dict[str, Any] = json.loads((REPO / "cdk.json").read_text())["context"]
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(key, item, "allowed: -c key=value")
        context[key] = value
    check_known_keys(context)
    return PlatformConfig.from_context(context)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacks.cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=("tables", "kept"), default="tables")
    parser.add_argument("--after", choices=STEPS[1:], help="kept: the teardown step")
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--prices", type=Path, default=DEFAULT_PRICES, help="price table (training/prices.yaml)")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args.context)
        prices = load_platform_prices(args.prices)
        rows = lines(cfg, PriceTable.load(args.prices), prices)
    except (ConfigError, UserError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "kept":
        if args.after is None:
            parser.error("kept needs --after teardown|teardown-all")
        print(kept(rows, args.after))
    else:
        print(markdown(rows, args.prices.resolve(), prices, args.context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
