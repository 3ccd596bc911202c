"""Price tables: what an instance-hour costs, what service bills it, and where the figure came from.

A table is ``training/prices.yaml`` (shipped), a user's ``--prices FILE`` of the same layout,
or a fetch from the AWS Price List API (``training/report/aws_prices.py``). Every figure
carries its service (``hyperpod``: the SageMaker ``ml.*`` instance price HyperPod bills;
``ec2``: the EC2 on-demand price, shown for comparison only), its region, the date it was
read from its source (``checked``; empty when nobody could date it), the source itself and
whether someone verified it there. A figure older than ``MAX_AGE_DAYS`` or undated is
*stale*: the report says so above its recommendation.

Layout (``prices`` is what the decision uses, ``ec2`` is optional)::

    as_of: "2026-12-04"
    currency: USD
    region: us-east-1
    prices:
      ml.p5.48xlarge: {usd_per_hour: 63.296, service: hyperpod, source: URL, checked: "2026-04-21",
                       verified: true, note: "what the source is"}
    ec2:
      p5.48xlarge: {usd_per_hour: 55.04, source: URL, checked: "2026-01-21", verified: true}
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from training.errors import UserError

DEFAULT_PRICES = Path(__file__).resolve().parents[1] / "prices.yaml"
#: a figure checked longer ago than this is stale (the report warns above its recommendation)
MAX_AGE_DAYS = 365
SERVICES = {"hyperpod": "SageMaker HyperPod (ml.* instance price)", "ec2": "EC2 on-demand (for comparison)",
            "other": "other (not an AWS list price)"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Price:
    instance_type: str
    usd_per_hour: float
    source: str
    checked: str  # YYYY-MM-DD the figure was read from ``source``; "" when undated
    verified: bool
    service: str = "other"
    region: str = ""
    origin: str = "table"  # "table" (a prices file) | "api" (fetched now) | "cache" (an earlier fetch)
    note: str = ""

    def age_days(self, today: datetime.date) -> int | None:
        if not self.checked:
            return None
        return (today - datetime.date.fromisoformat(self.checked)).days

    def is_stale(self, today: datetime.date) -> bool:
        age = self.age_days(today)
        return age is None or age > MAX_AGE_DAYS

    def date_label(self) -> str:
        """``checked`` as the reader sees it: the date, or that there is none."""
        return self.checked or "undated"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PriceTable:
    path: Path | str  # the file, or a description of the source ("AWS Price List API ...")
    as_of: str
    currency: str
    region: str
    prices: dict[str, Price]  # instance type as bench results name it -> the price the decision uses
    ec2: dict[str, Price] = dataclasses.field(default_factory=dict)  # EC2 name -> EC2 on-demand price

    @classmethod
    def load(cls, path: str | Path) -> PriceTable:
        """Read and validate a prices file; UserError naming the file and the key."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise UserError(f"--prices {path}: cannot read ({exc.strerror})") from None
        except yaml.YAMLError as exc:
            raise UserError(f"--prices {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict) or not isinstance(data.get("prices"), dict):
            raise UserError(f"--prices {path}: needs a 'prices' mapping of instance type -> "
                            "{usd_per_hour, source, checked, verified}")
        for key in ("as_of", "currency", "region"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise UserError(f"--prices {path}: key {key}: missing or not a string")
        if not isinstance(data.get("ec2", {}), dict):
            raise UserError(f"--prices {path}: key ec2: expected a mapping of EC2 instance type -> price entry")
        prices = {str(n): parse_price(path, "prices", str(n), e, data["region"]) for n, e in data["prices"].items()}
        ec2 = {str(n): parse_price(path, "ec2", str(n), e, data["region"]) for n, e in (data.get("ec2") or {}).items()}
        return cls(path=path, as_of=str(data["as_of"]), currency=data["currency"], region=data["region"],
                   prices=prices, ec2=ec2)

    def get(self, instance_type: str) -> Price:
        try:
            return self.prices[instance_type]
        except KeyError:
            raise UserError(f"no price for instance type {instance_type} in {self.path}; add "
                            f"prices.{instance_type}.usd_per_hour there or pass --prices FILE") from None

    def ec2_price(self, instance_type: str) -> Price | None:
        """The EC2 on-demand price of the instance behind ``ml.<type>``, if the table has one."""
        return self.ec2.get(instance_type.removeprefix("ml."))

    def stale(self, names: Iterable[str], today: datetime.date) -> list[Price]:
        """The decision prices among ``names`` that are undated or older than MAX_AGE_DAYS."""
        return [self.prices[n] for n in sorted(set(names)) if n in self.prices and self.prices[n].is_stale(today)]


def parse_price(path: Path, section: str, name: str, entry: Any, region: str) -> Price:
    """One entry of a price table (``section.name`` in ``path``); a bad one raises UserError naming the key."""
    where = f"--prices {path}: key {section}.{name}"
    if not isinstance(entry, dict):
        raise UserError(f"{where}: expected a mapping with usd_per_hour, source, checked, verified")
    usd = entry.get("usd_per_hour")
    if isinstance(usd, bool) or not isinstance(usd, int | float) or not usd > 0:
        raise UserError(f"{where}.usd_per_hour: must be a number > 0, got {usd!r}")
    checked = price_provenance(entry, where)
    default_service = "ec2" if section == "ec2" else ("hyperpod" if name.startswith("ml.") else "other")
    service = entry.get("service", default_service)
    if service not in SERVICES or (section == "ec2") != (service == "ec2"):
        allowed = "ec2" if section == "ec2" else "hyperpod or other (EC2 prices go under the ec2 key)"
        raise UserError(f"{where}.service: {service!r} is not {allowed}")
    for key in ("region", "note"):
        if not isinstance(entry.get(key, ""), str):
            raise UserError(f"{where}.{key}: must be a string")
    return Price(instance_type=name, usd_per_hour=float(usd), source=entry["source"], checked=str(checked),
                 verified=entry["verified"], service=service, region=entry.get("region") or region,
                 note=entry.get("note", ""))


def price_provenance(entry: Mapping[str, Any], where: str) -> str:
    """Check a price entry's ``source``, ``verified`` and ``checked`` (the same rules for every
    price table: instances, serving, platform services) and return ``checked`` as text: the
    date the source shows, or "" for an unverified figure nobody could date (stale by definition)."""
    if not isinstance(entry.get("source"), str) or not entry["source"]:
        raise UserError(f"{where}.source: missing; say where the price comes from")
    if not isinstance(entry.get("verified"), bool):
        raise UserError(f"{where}.verified: must be true or false")
    checked = entry.get("checked")
    if checked is None and not entry["verified"]:
        return ""
    if not isinstance(checked, str | datetime.date) or not _is_date(str(checked)):
        raise UserError(f"{where}.checked: give the date the source shows for the figure as YYYY-MM-DD"
                        + (" (a verified figure needs one)" if entry["verified"] else " or null"))
    return str(checked)


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return len(text) == 10


def merged(tables: Iterable[PriceTable]) -> PriceTable:
    """One table from several sources: each instance type takes its price from the first
    table that has one (``--prices A --prices B``: A's figures win)."""
    tables = list(tables)
    prices: dict[str, Price] = {}
    ec2: dict[str, Price] = {}
    for table in tables:
        for name, price in table.prices.items():
            prices.setdefault(name, price)
        for name, price in table.ec2.items():
            ec2.setdefault(name, price)
    if len(tables) == 1:
        return tables[0]
    return PriceTable(path=" + ".join(str(t.path) for t in tables), as_of=", ".join(t.as_of for t in tables),
                      currency=tables[0].currency, region=tables[0].region, prices=prices, ec2=ec2)


def source_rows(table: PriceTable, names: Iterable[str], today: datetime.date) -> list[list[str]]:
    """Rows of the report's price-source table: every figure the report uses, with its source."""
    rows = []
    for name in sorted(set(names)):
        for price in (table.prices.get(name), table.ec2_price(name)):
            if price is None:
                continue
            age = price.age_days(today)
            rows.append([price.instance_type, SERVICES[price.service], price.region, f"${price.usd_per_hour:,.3f}",
                         _origin_label(price), price.date_label() + ("" if age is None else f" ({age} d ago)"),
                         "yes" if price.verified else "**no**", price.source + (f" ({price.note})" if price.note
                                                                                 else "")])
    return rows


def _origin_label(price: Price) -> str:
    return {"api": "AWS Price List API", "cache": "AWS Price List API (cached fetch)"}.get(price.origin,
                                                                                          "price table")


def stale_warning(stale: Mapping[str, Price] | list[Price], today: datetime.date) -> str:
    """The warning printed above the recommendation when a price it uses is stale."""
    items = list(stale.values()) if isinstance(stale, Mapping) else list(stale)
    bits = [f"{p.instance_type} ({'undated' if not p.checked else f'checked {p.checked}, {p.age_days(today)} days ago'})"
            for p in items]
    return (f"> **Stale prices:** {', '.join(bits)} {'is' if len(bits) == 1 else 'are'} older than "
            f"{MAX_AGE_DAYS // 30} months or undated. Prices change (AWS cut P4/P5 EC2 prices in June 2025): "
            "fetch current ones with `--prices aws` or pass your own with `--prices FILE` before deciding.")
