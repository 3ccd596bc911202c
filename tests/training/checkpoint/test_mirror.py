"""S3 mirror against the real loopback S3 server, directly and through the fault proxy."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import boto3
import pytest
from faultproxy import FaultProxy

from training import s3 as s3lib
from training.checkpoint.layout import FORMAT, MANIFEST, find_latest, sha256_file, step_dir_name, verify
from training.checkpoint.mirror import S3Mirror, fetch_latest, remote_checkpoints


def make_checkpoint(root: Path, step: int, *, sizes: dict[str, int]) -> Path:
    """A complete checkpoint directory in the on-disk format (random payloads, real manifest)."""
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    files = {}
    for name, size in sizes.items():
        (path / name).write_bytes(os.urandom(size))
        files[name] = {"size": size, "sha256": sha256_file(path / name)}
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}))
    assert verify(path) is not None
    return path


def dangling_manifests(bucket: str, prefix: str, endpoint: str) -> list[str]:
    """Every (manifest, file) pair where the manifest names an object missing or of the wrong size."""
    s3 = boto3.client("s3", endpoint_url=endpoint)
    url = f"s3://{bucket}/{prefix}"
    keys = s3lib.list_keys(url, s3=s3)
    bad = []
    for key in keys:
        if not key.endswith("/" + MANIFEST):
            continue
        step_dir = key.rsplit("/", 1)[0]
        try:
            manifest = json.loads(s3lib.get_bytes(f"{url}/{key}", s3=s3))
        except Exception:  # noqa: BLE001 - deleted between list and get: not dangling
            continue
        for name, meta in manifest["files"].items():
            try:
                head = s3.head_object(Bucket=bucket, Key=f"{prefix}/{step_dir}/{name}")
            except s3.exceptions.ClientError:
                if _exists(s3, bucket, f"{prefix}/{key}"):  # manifest still there: dangling
                    bad.append(f"{key} -> {name} missing")
                continue
            if head["ContentLength"] != meta["size"]:
                bad.append(f"{key} -> {name} has {head['ContentLength']} bytes, manifest says {meta['size']}")
    return bad


def _exists(s3, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except s3.exceptions.ClientError:
        return False


class Watcher:
    """Polls the bucket the whole time the mirror runs and records any dangling manifest."""

    def __init__(self, bucket: str, prefix: str, endpoint: str) -> None:
        self.args = (bucket, prefix, endpoint)
        self.problems: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.problems += dangling_manifests(*self.args)
            self.polls += 1
            self._stop.wait(0.05)  # keep the shared CPUs for the code under test

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_mirror_uploads_manifest_last_prunes_and_fetches_back(tmp_path, s3_endpoint, s3_bucket):
    root = tmp_path / "ckpt"
    url = f"s3://{s3_bucket}/runs/a"
    with FaultProxy(s3_endpoint) as proxy:  # no faults: used here to record the request order
        mirror = S3Mirror(url, keep_last=2, endpoint_url=proxy.url)
        for step in (10, 20, 30):
            mirror.submit(make_checkpoint(root, step, sizes={"model.safetensors": 3000, "rng.pt": 100}))
            mirror.wait()
        mirror.close()
    assert mirror.uploaded == [10, 20, 30] and not mirror.failed
    assert remote_checkpoints(url) == [20, 30]
    keys = s3lib.list_keys(url)
    assert not any(k.startswith("step-00000010/") for k in keys), keys  # pruned completely
    # Per step: the manifest PUT comes after every data PUT (and the old manifest is deleted first).
    for step in (10, 20, 30):
        puts = [path for method, path, _ in proxy.log if method == "PUT" and step_dir_name(step) in path]
        assert puts[-1].endswith("/" + MANIFEST) and len(puts) == 3, puts
    # Old checkpoints go manifest first, so a half-finished prune is never "complete".
    deletes = [path for method, path, _ in proxy.log if method == "DELETE" and "step-00000010" in path]
    assert deletes[1].endswith(MANIFEST), deletes  # [0] is the pre-upload delete of step 10's own manifest

    restored = fetch_latest(url, tmp_path / "restore")
    assert restored is not None and restored.name == "step-00000030"
    assert verify(restored) is not None
    assert find_latest(tmp_path / "restore") == restored
    for name in ("model.safetensors", "rng.pt"):
        assert (restored / name).read_bytes() == (root / "step-00000030" / name).read_bytes()


def test_fetch_skips_a_checkpoint_without_its_manifest_or_with_corrupt_files(tmp_path, s3_endpoint, s3_bucket):
    url = f"s3://{s3_bucket}/runs/b"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    mirror = S3Mirror(url)
    for step in (1, 2):
        mirror.upload(make_checkpoint(tmp_path / "src", step, sizes={"model.safetensors": 500}))
    # step 3: files uploaded but the manifest never made it (killed mid-upload)
    (tmp_path / "x").write_bytes(b"partial")
    s3.upload_file(str(tmp_path / "x"), s3_bucket, "runs/b/step-00000003/model.safetensors")
    # step 2: manifest there but an object was corrupted afterwards (same size, other bytes)
    s3.put_object(Bucket=s3_bucket, Key="runs/b/step-00000002/model.safetensors", Body=b"\0" * 500)
    mirror.close()
    assert remote_checkpoints(url) == [1, 2]
    restored = fetch_latest(url, tmp_path / "restore")
    assert restored is not None and restored.name == "step-00000001"
    assert sorted(p.name for p in (tmp_path / "restore").iterdir()) == ["step-00000001"]  # no temp left


def test_mirror_survives_injected_5xx_and_dropped_connections(tmp_path, s3_endpoint, s3_bucket):
    """Faults on every kind of request, a multipart file among them; the uploads finish and no
    manifest ever points at a missing object (polled throughout and checked at the end)."""
    root = tmp_path / "ckpt"
    url = f"s3://{s3_bucket}/runs/c"
    sizes = {"model.safetensors": 17 * 1024**2 + 5,  # > 16 MiB: multipart through the proxy
             "optimizer.pt": 2000, "train_state.json": 300, "rng.pt": 100}
    force = [("PUT", "partNumber=2", "drop-after"),  # a part that S3 stored but the client never heard of
             ("POST", "uploadId=", "drop-after")]  # CompleteMultipartUpload done, reply lost
    with FaultProxy(s3_endpoint, error_rate=0.2, drop_rate=0.15, max_faults=40, seed=7, force=force) as proxy, \
            Watcher(s3_bucket, "runs/c", s3_endpoint) as watcher:
        mirror = S3Mirror(url, keep_last=2, backoff_s=0.05, max_backoff_s=0.2, endpoint_url=proxy.url)
        for step in (5, 10, 15):
            path = make_checkpoint(root, step, sizes=sizes if step == 10 else {**sizes, "model.safetensors": 4000})
            mirror.submit(path)
            mirror.wait()
        mirror.close()
    print("faults injected:", dict(proxy.stats), "watcher polls:", watcher.polls)
    assert proxy.faults >= 10, proxy.stats
    assert {"500", "503", "drop-before", "drop-after"} <= set(proxy.stats), proxy.stats
    assert ("PUT", "drop-after") in {(m, o) for m, p, o in proxy.log if "partNumber=2" in p}
    assert ("POST", "drop-after") in {(m, o) for m, p, o in proxy.log if "uploadId=" in p}
    assert mirror.uploaded == [5, 10, 15] and not mirror.failed
    assert watcher.polls > 0 and watcher.problems == []
    assert dangling_manifests(s3_bucket, "runs/c", s3_endpoint) == []
    assert remote_checkpoints(url) == [10, 15]
    restored = fetch_latest(url, tmp_path / "restore")
    assert restored is not None and restored.name == "step-00000015" and verify(restored) is not None


def test_mirror_gives_up_cleanly_when_s3_is_unreachable(tmp_path, s3_bucket):
    """S3 down for good: the step is recorded as failed, close() returns, nothing is raised into
    training and the local checkpoint stays complete."""
    import socket

    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = make_checkpoint(tmp_path, 1, sizes={"model.safetensors": 10})
    mirror = S3Mirror(f"s3://{s3_bucket}/runs/d", attempts=2, backoff_s=0.01, botocore_attempts=1,
                      endpoint_url=f"http://127.0.0.1:{port}")
    mirror.submit(path)
    mirror.close()
    assert mirror.failed == [1] and mirror.uploaded == []
    assert remote_checkpoints(f"s3://{s3_bucket}/runs/d") == []
    assert verify(path) is not None


def test_fault_proxy_is_bounded_and_loopback_only(s3_endpoint, s3_bucket):
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("http://s3.amazonaws.com")
    with pytest.raises(ValueError, match="must be in"):
        FaultProxy(s3_endpoint, error_rate=0.6, drop_rate=0.4)
    with FaultProxy(s3_endpoint, error_rate=0.9, max_faults=3, seed=1) as proxy:
        assert proxy.url.startswith("http://127.0.0.1:")
        s3 = s3lib.client(proxy.url)  # botocore retries through the injected 5xx
        for i in range(10):
            s3.put_object(Bucket=s3_bucket, Key=f"k{i}", Body=b"x")
    assert proxy.faults == 3 and proxy.stats["requests"] == 13
    assert s3lib.list_keys(f"s3://{s3_bucket}/") == [f"k{i}" for i in range(10)]
