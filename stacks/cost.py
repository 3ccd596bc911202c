"""What a deployment costs, from the price table: per hour and month while it runs, and what
keeps billing after each teardown step (runbooks/cost.md, runbooks/teardown.md).

    python -m stacks.cost [-c key=value ...]                       the tables of runbooks/cost.md
    python -m stacks.cost kept --after teardown|teardown-all [-c key=value ...]

The configuration is cdk.json's context (plus ``-c`` overrides, as the CDK CLI takes them). The
prices are training/prices.yaml: the accelerator instances from its ``prices``
(training/report/prices.py, the table the training report uses), the endpoint from ``serving``,
the rest (head nodes included) from its ``platform`` section (validated here).
Every figure there is a list price written down, not re-read (each entry says so): the tables
show the arithmetic, so new prices can be entered and the tables regenerated.

Fixed costs are what the resources bill by the hour or month whatever is done with them; what
depends on use (GB stored in S3 and ECR, log volume, NAT traffic, CloudTrail events) is listed
with its unit price, never guessed. A month is 730 hours, the convention of AWS's price pages.
Plain data: no aws_cdk import (it runs in the deploy venv, requirements-deploy.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from stacks.config import ConfigError, PlatformConfig, check_known_keys
from training.errors import UserError
from training.report.prices import DEFAULT_PRICES, PriceTable, _entry

HOURS_PER_MONTH = 730
UNITS = ("hour", "month", "GB-month", "GB", "100k-events")
REPO = Path(__file__).resolve().parents[1]
#: After which teardown step a resource still bills (runbooks/teardown.md). "running": always.
STEPS = ("running", "teardown", "teardown-all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitPrice:
    """One entry of the price table's ``platform`` section."""

    name: str
    usd: float
    per: str
    source: str
    verified: bool
    checked: str = ""
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


def load_platform_prices(path: Path = DEFAULT_PRICES) -> dict[str, UnitPrice]:
    """The ``platform`` section; a bad entry raises UserError naming the file and the key."""
    data = yaml.safe_load(Path(path).read_text())
    section = data.get("platform") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise UserError(f"{path}: no 'platform' mapping of name -> {{usd, per, source, checked, verified}}")
    out = {}
    for name, entry in section.items():
        where = f"{path}: key platform.{name}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: expected a mapping with usd, per, source, checked, verified")
        usd = entry.get("usd")
        if isinstance(usd, bool) or not isinstance(usd, int | float) or not usd > 0:
            raise UserError(f"{where}.usd: must be a number > 0, got {usd!r}")
        if entry.get("per") not in UNITS:
            raise UserError(f"{where}.per: {entry.get('per')!r} is not one of {', '.join(UNITS)}")
        if not isinstance(entry.get("source"), str) or not entry["source"]:
            raise UserError(f"{where}.source: missing; say where the price comes from")
        if not isinstance(entry.get("verified"), bool):
            raise UserError(f"{where}.verified: must be true or false")
        checked = entry.get("checked")
        if checked is not None and not isinstance(checked, str | datetime.date):
            raise UserError(f"{where}.checked: a YYYY-MM-DD date or null")
        out[str(name)] = UnitPrice(name=str(name), usd=float(usd), per=entry["per"], source=entry["source"],
                                   verified=entry["verified"], checked=str(checked or ""),
                                   note=str(entry.get("note", "")))
    return out


def instance_price(table: PriceTable, prices: dict[str, UnitPrice], instance_type: str) -> float:
    """$/hour of an ml.* type: the accelerators from ``prices`` (the decision's table), the head
    nodes' CPU types from ``platform``."""
    if instance_type in table.prices:
        return table.prices[instance_type].usd_per_hour
    if instance_type in prices and prices[instance_type].per == "hour":
        return prices[instance_type].usd
    raise UserError(f"no price for {instance_type} in {table.path}: add platform.{instance_type} (usd, per: hour) "
                    "or prices.{instance_type}")


def serving_price(table: PriceTable, instance_type: str) -> float:
    """The endpoint's $/hour from the price file's ``serving`` section (training/report/serving.py's
    layout, validated by the same entry check as every price)."""
    data = yaml.safe_load(Path(table.path).read_text())
    entry = (data.get("serving") or {}).get(instance_type)
    if entry is None:
        raise UserError(f"no serving.{instance_type} in {table.path}; add its endpoint price there")
    return _entry(Path(table.path), "serving", instance_type, entry, table.region).usd_per_hour


def _price(prices: dict[str, UnitPrice], name: str, per: str) -> UnitPrice:
    price = prices.get(name)
    if price is None or price.per != per:
        raise UserError(f"no platform.{name} priced per {per} in the price table; add it to training/prices.yaml")
    return price


def lines(cfg: PlatformConfig, table: PriceTable, prices: dict[str, UnitPrice]) -> list[Line]:
    """Everything ``cfg`` deploys that bills, by stack, with what keeps it after each teardown."""
    retain = cfg.dataRemovalPolicy == "retain"
    kept_data = ("teardown", "teardown-all") if retain else ("teardown",)
    out = []
    nodes = [("controller", cfg.controllerInstanceType, cfg.controllerInstanceCount, cfg.controllerEbsGiB),
             ("login", cfg.loginInstanceType, cfg.loginInstanceCount, cfg.loginEbsGiB),
             ("gpu", cfg.gpuInstanceType, cfg.gpuInstanceCount, cfg.gpuEbsGiB),
             ("trn", cfg.trnInstanceType, cfg.trnInstanceCount, cfg.trnEbsGiB)]
    ebs_gib = 0
    for group, instance_type, count, ebs in nodes:
        if not count:
            continue
        price = instance_price(table, prices, instance_type)
        out.append(Line(item=f"{group} nodes ({instance_type})", stack="cluster", usd_per_hour=count * price,
                        how=f"{count} x ${price:g}/h"))
        ebs_gib += count * ebs
    if cfg.serving:
        price = serving_price(table, cfg.servingInstanceType)
        out.append(Line(item=f"serving endpoint ({cfg.servingInstanceType}, 1 to {cfg.servingMaxInstances} instances)",
                        stack="serving", usd_per_hour=price, how=f"at least 1 x ${price:g}/h (auto-scaling adds more)"))
    ebs = _price(prices, "node_ebs", "GB-month")
    out.append(Line(item="node volumes (secondary EBS)", stack="cluster", usd_per_hour=ebs_gib * ebs.usd / HOURS_PER_MONTH,
                    how=f"{ebs_gib} GB x ${ebs.usd:g}/GB-month"))
    fsx = _price(prices, f"fsx_lustre_persistent2_{cfg.fsxThroughputPerTiB}", "GB-month")
    out.append(Line(item=f"FSx for Lustre ({cfg.fsxStorageGiB} GiB, {cfg.fsxThroughputPerTiB} MB/s/TiB)", stack="storage",
                    usd_per_hour=cfg.fsxStorageGiB * fsx.usd / HOURS_PER_MONTH, kept_after=kept_data,
                    how=f"{cfg.fsxStorageGiB} GB x ${fsx.usd:g}/GB-month"))
    kms = _price(prices, "kms_key", "month")
    out.append(Line(item="KMS keys (platform key; the network stack's handler-log key)", stack="storage, network",
                    usd_per_hour=2 * kms.usd / HOURS_PER_MONTH, kept_after=kept_data,
                    how=f"2 x ${kms.usd:g}/month"))
    nat, ipv4 = _price(prices, "nat_gateway", "hour"), _price(prices, "public_ipv4", "hour")
    out.append(Line(item="NAT gateway and its public IPv4 address", stack="network", kept_after=("teardown",),
                    usd_per_hour=nat.usd + ipv4.usd, how=f"${nat.usd:g}/h + ${ipv4.usd:g}/h"))
    if cfg.slurmAccounting:
        acu, secret = _price(prices, "aurora_serverless_v2", "hour"), _price(prices, "secrets_manager_secret", "month")
        out.append(Line(item="Slurm accounting database (Aurora Serverless v2, writer + reader at 0.5 ACU)",
                        stack="storage", usd_per_hour=2 * 0.5 * acu.usd + secret.usd / HOURS_PER_MONTH,
                        kept_after=("teardown",),
                        how=f"2 x 0.5 ACU x ${acu.usd:g}/ACU-h + 1 secret x ${secret.usd:g}/month"))
    usage = [
        ("S3 objects (data, artefacts incl. FSx exports, lifecycle, access logs)", "storage, network", "s3_standard",
         "GB-month", kept_data),
        ("training images in ECR", "storage", "ecr_storage", "GB-month", kept_data),
        ("CloudWatch log groups (cluster, handlers, accounting)", "all", "cloudwatch_logs_storage", "GB-month",
         ("teardown", "teardown-all")),
        ("NAT gateway traffic", "network", "nat_gateway_data", "GB", ()),
    ]
    if cfg.cloudTrail:
        usage.append(("CloudTrail S3 data events", "storage", "cloudtrail_data_events", "100k-events", ("teardown",)))
    if cfg.slurmAccounting:
        usage.append(("accounting database's final snapshot", "storage", "rds_snapshot_storage", "GB-month",
                      ("teardown-all",) if retain else ()))
    for item, stack, name, per, kept in usage:
        price = _price(prices, name, per)
        out.append(Line(item=item, stack=stack, usage=True, kept_after=kept, how=f"${price.usd:g} per {per}"))
    return out


def hourly(rows: list[Line], step: str = "running") -> float:
    """The fixed cost per hour while running, or of what still bills after ``step``."""
    return sum(r.usd_per_hour for r in rows if not r.usage and (step == "running" or step in r.kept_after))


def _money(usd: float) -> str:
    return f"${usd:,.2f}"


def markdown(cfg: PlatformConfig, rows: list[Line], table_path: Path) -> str:
    """runbooks/cost.md's tables (the doc test compares them with this output)."""
    out = [f"Configuration: cdk.json's context{'' if cfg == PlatformConfig() else ' with overrides'}; prices: "
           f"`{table_path.relative_to(REPO) if table_path.is_relative_to(REPO) else table_path}` (list prices, "
           "unverified: see each entry's source).", "",
           "| what | stack | how | $/hour | $/month |", "|---|---|---|---:|---:|"]
    for r in rows:
        if not r.usage:
            out.append(f"| {r.item} | {r.stack} | {r.how} | {_money(r.usd_per_hour)} | "
                       f"{_money(r.usd_per_hour * HOURS_PER_MONTH)} |")
    total = hourly(rows)
    out += [f"| **running, fixed** | | | **{_money(total)}** | **{_money(total * HOURS_PER_MONTH)}** |", "",
            "Billed by use, on top:", "", "| what | stack | price |", "|---|---|---|"]
    out += [f"| {r.item} | {r.stack} | {r.how} |" for r in rows if r.usage]
    out += ["", "| after | still billing, fixed | $/month | and by use |", "|---|---|---:|---|"]
    for step in STEPS[1:]:
        fixed = [r.item for r in rows if not r.usage and step in r.kept_after]
        used = [r.item for r in rows if r.usage and step in r.kept_after]
        out.append(f"| `make {step}` | {'; '.join(fixed) or 'nothing'} | "
                   f"{_money(hourly(rows, step) * HOURS_PER_MONTH)} | {'; '.join(used) or 'nothing'} |")
    return "\n".join(out)


def kept(rows: list[Line], step: str) -> str:
    """What `make <step>` leaves billing, one line each, for the end of its output."""
    out = [f"{step}: still billing after this step (runbooks/cost.md, runbooks/teardown.md):"]
    for r in rows:
        if step in r.kept_after:
            cost = f"{_money(r.usd_per_hour * HOURS_PER_MONTH)}/month" if not r.usage else r.how
            out.append(f"  - {r.item} [{r.stack}]: {cost}")
    out.append(f"  fixed total: {_money(hourly(rows, step) * HOURS_PER_MONTH)}/month, plus what is billed by use")
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
        rows = lines(cfg, PriceTable.load(args.prices), load_platform_prices(args.prices))
    except (ConfigError, UserError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "kept":
        if args.after is None:
            parser.error("kept needs --after teardown|teardown-all")
        print(kept(rows, args.after))
    else:
        print(markdown(cfg, rows, args.prices.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
