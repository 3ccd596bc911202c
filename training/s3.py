"""S3 access for data, pretrained weights and checkpoint mirroring.

The endpoint is boto3's own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` setting (or
``endpoint_url=``), so tests point everything at a loopback S3 without code paths of
their own. Retries use botocore's standard mode (exponential backoff with jitter on
throttling, 5xx and dropped connections); multipart uploads come from the transfer
manager and are retried part by part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, EndpointConnectionError

from training.errors import UserError

_MULTIPART = TransferConfig(multipart_threshold=16 * 1024**2, multipart_chunksize=16 * 1024**2,
                            max_concurrency=8, use_threads=True)


@dataclass(frozen=True)
class S3Url:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def join(self, *parts: str) -> S3Url:
        key = "/".join(p.strip("/") for p in (self.key, *parts) if p.strip("/"))
        return S3Url(self.bucket, key)


def is_s3_url(value: str | os.PathLike[str]) -> bool:
    return str(value).startswith("s3://")


def parse_s3_url(url: str) -> S3Url:
    """``s3://bucket/some/key`` -> S3Url; a malformed URL is a UserError naming it."""
    if not is_s3_url(url) or len(url) <= 5 or url[5] == "/":
        raise UserError(f"{url!r} is not an S3 URL; use the form s3://BUCKET/PREFIX")
    bucket, _, key = url[5:].partition("/")
    return S3Url(bucket, key)


def client(endpoint_url: str | None = None, max_attempts: int = 10):
    """A boto3 S3 client with standard-mode retries (backoff on 5xx, throttling, resets)."""
    config = Config(retries={"max_attempts": max_attempts, "mode": "standard"},
                    connect_timeout=10, read_timeout=60, signature_version="s3v4")
    return boto3.client("s3", endpoint_url=endpoint_url or None, config=config)


def _explain(exc: Exception, url: S3Url | str) -> UserError | Exception:
    """Turn the S3 errors a user can fix into one line; leave the rest as they are."""
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket",):
            bucket = url.bucket if isinstance(url, S3Url) else url
            return UserError(f"s3://{bucket}: bucket does not exist; create it or fix the configured S3 path")
        if code in ("NoSuchKey", "404", "NotFound"):
            return UserError(f"{url}: no such object; check the path (and that the upload finished)")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return UserError(f"{url}: access denied ({code}); check the credentials and the bucket policy")
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
        return UserError(f"{url}: cannot reach S3 ({exc}) after retries; check the node's route to S3 "
                         "(NAT or the S3 gateway endpoint) and AWS_ENDPOINT_URL_S3 if set")
    if isinstance(exc, BotoCoreError) and "credentials" in str(exc).lower():
        return UserError(f"{url}: no AWS credentials found; configure them (instance role on the cluster)")
    return exc


def upload_file(path: str | Path, url: str | S3Url, s3=None) -> None:
    """Upload one file (multipart above 16 MiB, each part retried)."""
    dest = parse_s3_url(url) if isinstance(url, str) else url
    s3 = s3 or client()
    try:
        s3.upload_file(str(path), dest.bucket, dest.key, Config=_MULTIPART)
    except (ClientError, BotoCoreError) as exc:
        raise _explain(exc, dest) from exc


def put_bytes(data: bytes, url: str | S3Url, s3=None) -> None:
    dest = parse_s3_url(url) if isinstance(url, str) else url
    s3 = s3 or client()
    try:
        s3.put_object(Bucket=dest.bucket, Key=dest.key, Body=data)
    except (ClientError, BotoCoreError) as exc:
        raise _explain(exc, dest) from exc


def get_bytes(url: str | S3Url, s3=None) -> bytes:
    src = parse_s3_url(url) if isinstance(url, str) else url
    s3 = s3 or client()
    try:
        return s3.get_object(Bucket=src.bucket, Key=src.key)["Body"].read()
    except (ClientError, BotoCoreError) as exc:
        raise _explain(exc, src) from exc


def download_file(url: str | S3Url, path: str | Path, s3=None) -> Path:
    """Download to ``path`` through a temp name, so a crash never leaves a partial file."""
    src = parse_s3_url(url) if isinstance(url, str) else url
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}")
    s3 = s3 or client()
    try:
        s3.download_file(src.bucket, src.key, str(tmp), Config=_MULTIPART)
    except (ClientError, BotoCoreError) as exc:
        tmp.unlink(missing_ok=True)
        raise _explain(exc, src) from exc
    os.replace(tmp, path)
    return path


def list_keys(prefix: str | S3Url, s3=None) -> list[str]:
    """Every key under the prefix (paginated), relative to it, sorted."""
    src = parse_s3_url(prefix) if isinstance(prefix, str) else prefix
    base = src.key.rstrip("/") + "/" if src.key else ""
    s3 = s3 or client()
    keys: list[str] = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=src.bucket, Prefix=base):
            keys.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
    except (ClientError, BotoCoreError) as exc:
        raise _explain(exc, src) from exc
    return sorted(keys)


def sync_down(prefix: str, local_dir: str | Path, s3=None) -> Path:
    """Copy every object under ``prefix`` into ``local_dir`` (skips files of equal size).

    Used for pretrained model directories and feature shards given as s3:// URLs.
    """
    src = parse_s3_url(prefix)
    local_dir = Path(local_dir)
    s3 = s3 or client()
    keys = list_keys(src, s3=s3)
    if not keys:
        raise UserError(f"{prefix}: no objects under this prefix; check the path")
    for rel in keys:
        target = local_dir / rel
        head = s3.head_object(Bucket=src.bucket, Key=src.join(rel).key)
        if target.exists() and target.stat().st_size == head["ContentLength"]:
            continue
        download_file(src.join(rel), target, s3=s3)
    return local_dir
