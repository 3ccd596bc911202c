"""``--prices aws[:REGION]``: on-demand prices from the AWS Price List API, the source of record.

Two services, one ``pricing:GetProducts`` call family each (boto3 ``pricing`` client; the API
answers at ``api.pricing.us-east-1.amazonaws.com`` whatever region is priced, and needs any
credentials allowed ``pricing:GetProducts``):

- **SageMaker HyperPod** (what HyperPod bills): ``ServiceCode=AmazonSageMaker`` filtered on
  ``regionCode`` and ``platoinstancetype=Cluster``. In SageMaker's offer file every ML instance
  product carries ``platoinstancetype`` (Training, Hosting, ..., ``Cluster`` for HyperPod
  on-demand, ``Cluster-Reserved`` for reserved capacity) and names its instance in
  ``instanceType`` with a component suffix (``ml.x-<component>``), in ``instanceName``, or as
  the ``usagetype``'s tail: vantage-sh/ec2instances.info sagemaker.py reads the real offer file
  (https://pricing.us-east-1.amazonaws.com/offers/v1.0/aws/AmazonSageMaker/current/index.json)
  that way, and so do we.
- **EC2** (for comparison): ``ServiceCode=AmazonEC2`` per instance type, Linux, shared tenancy,
  no pre-installed software, no licence, capacity ``Used`` (the filters
  vantage-sh/ec2instances.info ec2.py ``add_pricing`` uses); Capacity Block SKUs
  (``marketoption=CapacityBlock``) are dropped, as there.

Each ``PriceList`` entry is a JSON *string* (API reference: "PriceList: Array of strings",
https://docs.aws.amazon.com/aws-cost-management/latest/APIReference/API_pricing_GetProducts.html;
botocore's recorded example, botocore/data/pricing/2017-10-15/examples-1.json) holding
``product.attributes`` and ``terms.OnDemand.<offer>.priceDimensions.<rate>.pricePerUnit.USD``.

Failure path: no credentials, no network, access denied, throttling past botocore's retries
or a response we cannot read all end in ``PriceFetchError`` with one line naming the cause;
``resolve`` then uses the last cached fetch for that region, or the shipped table, and says
which. An instance type the API has no single HyperPod price for keeps its table price and
is named. ``SANA_PRICES_OFFLINE=1`` skips the API (air-gapped clusters, tests).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from training.errors import UserError, exits_cleanly
from training.report.prices import DEFAULT_PRICES, Price, PriceTable, merged

#: the Price List API's home endpoint (it also answers in eu-central-1 and ap-south-1)
ENDPOINT_REGION = "us-east-1"
DOC_URL = "https://docs.aws.amazon.com/aws-cost-management/latest/APIReference/API_pricing_GetProducts.html"
OFFLINE_ENV = "SANA_PRICES_OFFLINE"
CACHE_SCHEMA = "sana-prices-cache/1"
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")


class PriceFetchError(Exception):
    """The API could not be asked or answered unreadably; the message is one line."""


def hyperpod_filters(region: str) -> list[dict[str, str]]:
    return [{"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
            {"Type": "TERM_MATCH", "Field": "platoinstancetype", "Value": "Cluster"}]


def ec2_filters(instance_type: str, region: str) -> list[dict[str, str]]:
    return [{"Type": "TERM_MATCH", "Field": "instanceType", "Value": instance_type},
            {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region},
            {"Type": "TERM_MATCH", "Field": "operatingSystem", "Value": "Linux"},
            {"Type": "TERM_MATCH", "Field": "tenancy", "Value": "Shared"},
            {"Type": "TERM_MATCH", "Field": "preInstalledSw", "Value": "NA"},
            {"Type": "TERM_MATCH", "Field": "licenseModel", "Value": "No License required"},
            {"Type": "TERM_MATCH", "Field": "capacityStatus", "Value": "Used"}]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offer:
    """One instance type's on-demand price as the API returned it."""

    instance_type: str
    usd_per_hour: float
    sku: str
    usagetype: str
    effective_date: str


@dataclasses.dataclass(kw_only=True)
class Fetch:
    region: str
    fetched_at: str  # ISO-8601 UTC
    requests: list[dict[str, Any]]  # every GetProducts call: ServiceCode and Filters
    hyperpod: dict[str, Offer]  # "ml.p5.48xlarge" -> offer
    ec2: dict[str, Offer]  # "p5.48xlarge" -> offer
    missing: dict[str, str]  # instance type -> why no single HyperPod price came back

    def to_json(self) -> dict[str, Any]:
        return {"schema": CACHE_SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fetch:
        if data.get("schema") != CACHE_SCHEMA:
            raise ValueError(f"schema is {data.get('schema')!r}, not {CACHE_SCHEMA}")
        offers = {k: {n: Offer(**o) for n, o in data[k].items()} for k in ("hyperpod", "ec2")}
        return cls(region=data["region"], fetched_at=data["fetched_at"], requests=data["requests"],
                   missing=data["missing"], **offers)

    def table(self, *, origin: str) -> PriceTable:
        day = self.fetched_at[:10]

        def price(offer: Offer, code: str) -> Price:
            return Price(instance_type=offer.instance_type, usd_per_hour=offer.usd_per_hour, checked=day,
                         verified=True, service="hyperpod" if code == "AmazonSageMaker" else "ec2",
                         region=self.region, origin=origin,
                         source=f"AWS Price List API GetProducts {code} sku {offer.sku} ({offer.usagetype}), "
                                f"fetched {self.fetched_at}",
                         note=f"effective {offer.effective_date[:10]}" if offer.effective_date else "")

        what = "cached fetch" if origin == "cache" else "fetched"
        return PriceTable(path=f"AWS Price List API ({self.region}, {what} {self.fetched_at})",
                          as_of=f"{what} {self.fetched_at}", currency="USD", region=self.region,
                          prices={n: price(o, "AmazonSageMaker") for n, o in self.hyperpod.items()},
                          ec2={n: price(o, "AmazonEC2") for n, o in self.ec2.items()})


def make_client() -> Any:
    """A real ``pricing`` client with short timeouts, so a machine without network fails fast."""
    import boto3
    from botocore.config import Config

    # A session of its own: boto3's module-level default session caches the credentials it
    # resolved first, so a process that used other credentials earlier would sign with those.
    config = Config(connect_timeout=5, read_timeout=20, retries={"max_attempts": 3, "mode": "standard"})
    return boto3.session.Session().client("pricing", region_name=ENDPOINT_REGION, config=config)


def get_products(client: Any, service_code: str, filters: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Every product of a GetProducts query, all pages, each PriceList string parsed."""
    items: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"ServiceCode": service_code, "Filters": filters, "FormatVersion": "aws_v1",
                              "MaxResults": 100}
    while True:
        page = client.get_products(**kwargs)
        for raw in page.get("PriceList", []):
            if not isinstance(raw, str):  # the real API sends JSON strings, never objects
                raise PriceFetchError(f"GetProducts {service_code}: a PriceList entry is a "
                                      f"{type(raw).__name__}, not the JSON string the API returns")
            try:
                items.append(json.loads(raw))
            except json.JSONDecodeError as exc:
                raise PriceFetchError(f"GetProducts {service_code}: a PriceList entry is not JSON ({exc.msg})") from None
        token = page.get("NextToken")
        if not token:
            return items
        kwargs["NextToken"] = token


def hyperpod_instance(attributes: dict[str, str]) -> str:
    """The ``ml.*`` instance type a SageMaker product prices (see the module docstring)."""
    name = attributes.get("instanceName") or attributes.get("instanceType", "").split("-")[0]
    if not name or name == "NA":
        name = attributes.get("usagetype", "").rsplit(":", 1)[-1]
    return name


def on_demand_offers(item: dict[str, Any], instance_type: str) -> list[Offer]:
    """The hourly, non-zero on-demand rates of one product."""
    offers = []
    attributes = item["product"]["attributes"]
    for term in item.get("terms", {}).get("OnDemand", {}).values():
        for dim in term["priceDimensions"].values():
            try:
                usd = Decimal(dim["pricePerUnit"]["USD"])
            except (KeyError, InvalidOperation):
                continue
            if dim.get("unit", "").lower() not in ("hrs", "hours", "hour") or usd <= 0:
                continue
            offers.append(Offer(instance_type=instance_type, usd_per_hour=float(usd), sku=item["product"]["sku"],
                                usagetype=attributes.get("usagetype", ""),
                                effective_date=term.get("effectiveDate", "")))
    return offers


def _single(offers: list[Offer]) -> Offer | str:
    prices = sorted({o.usd_per_hour for o in offers})
    if not prices:
        return "no on-demand hourly price in the response"
    if len(prices) > 1:
        return f"{len(prices)} different on-demand prices ({', '.join(f'${p:g}' for p in prices)}); not guessing"
    return offers[0]


def fetch(instance_types: Iterable[str], region: str, *, client: Any) -> Fetch:
    """Ask the API for the HyperPod and EC2 on-demand price of every ``ml.*`` instance type."""
    from botocore.exceptions import BotoCoreError, ClientError

    wanted = sorted({t for t in instance_types if t.startswith("ml.")})
    requests = [{"ServiceCode": "AmazonSageMaker", "Filters": hyperpod_filters(region)}]
    requests += [{"ServiceCode": "AmazonEC2", "Filters": ec2_filters(t.removeprefix("ml."), region)} for t in wanted]
    fetched_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        found: dict[str, list[Offer]] = {}
        for item in get_products(client, "AmazonSageMaker", requests[0]["Filters"]):
            name = hyperpod_instance(item["product"]["attributes"])
            if name in wanted:
                found.setdefault(name, []).extend(on_demand_offers(item, name))
        ec2: dict[str, Offer] = {}
        for request in requests[1:]:
            name = request["Filters"][0]["Value"]
            offers = [o for item in get_products(client, "AmazonEC2", request["Filters"])
                      if item["product"]["attributes"].get("marketoption") != "CapacityBlock"
                      for o in on_demand_offers(item, name)]
            if isinstance(one := _single(offers), Offer):
                ec2[name] = one
    except ClientError as exc:
        err = exc.response.get("Error", {})
        raise PriceFetchError(f"{err.get('Code', 'ClientError')}: {err.get('Message', str(exc))}") from None
    except BotoCoreError as exc:
        raise PriceFetchError(f"{type(exc).__name__}: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise PriceFetchError(f"GetProducts response not in the documented shape (missing {exc}); see {DOC_URL}") from None
    hyperpod, missing = {}, {}
    for name in wanted:
        one = _single(found.get(name, []))
        if isinstance(one, Offer):
            hyperpod[name] = one
        else:
            missing[name] = "no HyperPod (platoinstancetype=Cluster) product" if name not in found else one
    return Fetch(region=region, fetched_at=fetched_at, requests=requests, hyperpod=hyperpod, ec2=ec2,
                 missing=missing)


def default_cache(region: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "sana-training" / f"prices-aws-{region}.json"


def save_cache(result: Fetch, path: Path) -> None:
    """Atomically: a reader never sees half a cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    tmp.replace(path)


def load_cache(path: Path) -> Fetch | None:
    try:
        return Fetch.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no cache, or one we cannot trust: as if there were none


def parse_source(spec: str) -> tuple[str, str | None]:
    """``aws`` / ``aws:REGION`` -> ("aws", region); anything else -> ("file", None)."""
    if spec != "aws" and not spec.startswith("aws:"):
        return "file", None
    region = spec.partition(":")[2] or "us-east-1"
    if not _REGION.match(region):
        raise UserError(f"--prices {spec}: {region!r} is not an AWS region code; give e.g. aws:us-west-2")
    return "aws", region


def resolve(specs: Sequence[str], instance_types: Iterable[str], *, client: Any = None,
            client_factory: Callable[[], Any] = make_client, cache: Path | None = None,
            log: Callable[[str], None] = print) -> tuple[PriceTable, list[str]]:
    """The price table of ``--prices`` (repeatable: the first source with a figure wins) and
    one note per source that is not what was asked for (the API unreachable, a type missing)."""
    wanted = set(instance_types)
    tables, notes = [], []
    for spec in specs:
        kind, region = parse_source(spec)
        if kind == "file":
            tables.append(PriceTable.load(spec))
            continue
        assert region is not None
        table, note = _from_api(region, wanted, client=client, client_factory=client_factory,
                                cache=cache or default_cache(region))
        tables.append(table)
        notes += note
    for note in notes:
        log(note)
    return merged(tables), notes


def _from_api(region: str, wanted: set[str], *, client: Any, client_factory: Callable[[], Any],
              cache: Path) -> tuple[PriceTable, list[str]]:
    shipped = PriceTable.load(DEFAULT_PRICES)
    try:
        if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
            raise PriceFetchError(f"{OFFLINE_ENV}=1 set")
        result = fetch(wanted | set(shipped.prices), region, client=client if client is not None else client_factory())
    except PriceFetchError as exc:
        cached = load_cache(cache)
        if cached is not None and cached.region == region:
            return merged([cached.table(origin="cache"), shipped]), [
                f"prices: AWS Price List API not reached ({exc}); using the cached fetch of {cached.fetched_at} ({cache})"]
        return shipped, [f"prices: AWS Price List API not reached ({exc}); falling back to the shipped table "
                         f"{DEFAULT_PRICES.name} (as of {shipped.as_of})"]
    notes = []
    try:
        save_cache(result, cache)
    except OSError as exc:
        notes.append(f"prices: fetched, but the cache {cache} could not be written ({exc.strerror}); not kept")
    kept = sorted(set(result.missing) & set(shipped.prices))
    if kept:
        notes.append("prices: the API gave no single HyperPod price for " + "; ".join(
            f"{n} ({result.missing[n]})" for n in kept) + f": those keep the shipped table's figure ({DEFAULT_PRICES.name})")
    if dropped := sorted(set(result.missing) - set(shipped.prices)):
        notes.append(f"prices: no HyperPod price for {', '.join(dropped)} in {result.region}: left out of the projection")
    return merged([result.table(origin="api"), shipped]), notes


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m training.report.aws_prices [--region R]``: the one-command check, on a machine with
    AWS credentials, that the filters above find HyperPod and EC2 prices in the live API. Prints one
    line per accelerator instance type; exit 0 when the HyperPod filter found prices, 1 when it found
    none (the offer file no longer matches these filters), 2 when the API cannot be asked."""
    import argparse

    from training.model import flops
    p = argparse.ArgumentParser(prog="python -m training.report.aws_prices", description="check the Price List API filters against the live API (needs AWS credentials)")
    p.add_argument("--region", default="us-east-1", help="region to price (default %(default)s)")
    p.add_argument("--cache", help=f"where to keep the fetch (default {default_cache('REGION')})")
    args = p.parse_args(argv)
    parse_source(f"aws:{args.region}")
    try:
        result = fetch(flops.INSTANCE_TYPES, args.region, client=make_client())
    except PriceFetchError as exc:
        raise UserError(f"AWS Price List API not reached: {exc}") from None
    save_cache(result, Path(args.cache) if args.cache else default_cache(args.region))
    for name in sorted(flops.INSTANCE_TYPES):
        hp, ec2 = result.hyperpod.get(name), result.ec2.get(name.removeprefix("ml."))
        print(f"{name:20s} HyperPod {f'${hp.usd_per_hour:,.3f}/h sku {hp.sku}' if hp else 'none: ' + result.missing[name]}"
              f" | EC2 {f'${ec2.usd_per_hour:,.3f}/h' if ec2 else 'none'}")
    print(f"fetched {result.fetched_at} from {ENDPOINT_REGION} for {args.region}; filters: "
          + json.dumps(result.requests[0]["Filters"]))
    return 0 if result.hyperpod else 1


if __name__ == "__main__":
    raise SystemExit(main())
