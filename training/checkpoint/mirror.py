"""Mirror completed checkpoints to S3 in the background, and fetch them back for a restore.

The S3 copy follows the same rule as the local one: ``manifest.json`` is the commit record.
For each checkpoint the uploader (1) deletes any older manifest for that step, (2) uploads
every file the manifest lists (multipart through ``training.s3.upload_file``), (3) checks
each object's size with HEAD, and only then (4) puts the manifest. A crash, a dead node or
an S3 outage at any point therefore leaves at worst objects without a manifest, never a
manifest naming an object that is missing. Old checkpoints are deleted manifest first for
the same reason.

Failures are retried twice over: botocore's standard mode retries each request (5xx,
throttling, dropped connections), and every file/manifest operation here is retried with
exponential backoff and jitter on top, because a multipart upload that botocore gave up on
(``S3UploadFailedError``) is not retried by botocore itself. A checkpoint that still fails
is logged and skipped; training never stops for the mirror (the local copy is complete).

Uploads run on one daemon thread so the training step does not wait for S3. If checkpoints
arrive faster than they upload, only the newest queued one is uploaded (older ones are
superseded: resume wants the newest). ``close()`` waits for the queue to drain.

Branches (training/checkpoint/branch.py): S3 keeps every trajectory's checkpoints under the
same ``step-*`` keys, so resuming from an older step would leave the abandoned later ones
looking newest. The run's branch is therefore published as ``branch.json`` (the head)
before any manifest naming it is uploaded (``announce``, retried before every upload until
it lands; a manifest is never uploaded while its head is not in place), and:

- ``fetch_latest`` takes the newest checkpoint on the head's lineage, never one of an
  abandoned branch, even one whose manifest arrived after the head (an older run's mirror
  still draining);
- ``prune`` counts and deletes only checkpoints on the live lineage (the abandoned ones are
  left, like local ``abandoned-step-*`` directories), and does nothing once a run that
  started later owns the head (an older run never prunes a newer run's ancestors);
- a run whose head was replaced by a later run's uploads nothing more (two runs on one
  prefix: the later start wins).

If the head cannot be published at all (S3 down from the resume until the run dies), S3 still
names the previous branch; nothing of the new one is on S3 then, and a restore from S3
follows the previous head.

NOTE: backoff jitter uses a private ``random.Random``: the global ``random`` stream belongs
to the training run and must not depend on how often S3 failed (bit-identical resume).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from training import s3 as s3lib
from training.checkpoint.branch import HEAD_KEY, Branch
from training.checkpoint.layout import MANIFEST, commit_dir, read_manifest, sha256_file, step_dir_name, verify
from training.errors import UserError

log = logging.getLogger(__name__)
T = TypeVar("T")
_STEP_KEY = re.compile(r"^(step-(\d{8}))/(.+)$")


class MirrorError(RuntimeError):
    """An upload that still failed after every retry."""


def _retry(fn: Callable[[], T], what: str, *, attempts: int, backoff_s: float, max_backoff_s: float,
           rng: random.Random) -> T:
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except UserError:
            raise  # no bucket, access denied: waiting will not fix it
        except Exception as exc:  # noqa: BLE001 - S3UploadFailedError, ClientError, BotoCoreError, OSError
            if attempt == attempts:
                raise MirrorError(f"{what}: failed after {attempts} attempts: {exc}") from exc
            delay = min(max_backoff_s, backoff_s * 2 ** (attempt - 1)) * rng.uniform(0.5, 1.0)
            log.warning("%s: attempt %d/%d failed (%s); retrying in %.1f s", what, attempt, attempts, exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class S3Mirror:
    """Background uploader of complete checkpoint directories to ``url/step-XXXXXXXX/``."""

    def __init__(self, url: str, *, keep_last: int = 0, attempts: int = 6, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, endpoint_url: str | None = None, botocore_attempts: int = 10
                 ) -> None:
        self.dest = s3lib.parse_s3_url(url)
        self.keep_last = keep_last
        self._retry_kw = {"attempts": attempts, "backoff_s": backoff_s, "max_backoff_s": max_backoff_s,
                          "rng": random.Random()}
        self._endpoint_url = endpoint_url
        self._botocore_attempts = botocore_attempts
        self._queue: list[Path] = []
        self._active: Path | None = None
        #: the branch to publish as head before the next upload; the one known to be there
        self._announce: Branch | None = None
        self._head: Branch | None = None
        self._closing = False
        self._cond = threading.Condition()
        self.uploaded: list[int] = []
        self.failed: list[int] = []
        self.skipped: list[int] = []
        self._thread = threading.Thread(target=self._run, name="s3-mirror", daemon=True)
        self._thread.start()

    # ----- API used by the Checkpointer --------------------------------------------------
    def submit(self, ckpt_dir: str | Path) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("S3Mirror.submit after close()")
            self._queue.append(Path(ckpt_dir).resolve())
            self._cond.notify_all()

    def announce(self, branch: Branch) -> None:
        """Publish ``branch`` as the head now (in the background), so that a restore from S3
        stops following the branch this run left as soon as possible, not only at its first
        upload. Failures are retried before every upload."""
        with self._cond:
            self._announce = branch
            self._cond.notify_all()

    def pending(self) -> set[Path]:
        """Checkpoint dirs queued or uploading: the local pruner must not delete these."""
        with self._cond:
            return set(self._queue) | ({self._active} if self._active else set())

    def wait(self) -> None:
        """Block until every submitted checkpoint is uploaded (or has failed)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and self._active is None and self._announce is None)

    def close(self, timeout_s: float | None = None) -> None:
        """Drain the queue, then stop the thread. Failures are logged, not raised.

        After ``timeout_s`` the upload in flight is abandoned (the daemon thread dies with the
        process; its manifest was not uploaded, so S3 holds no checkpoint that looks complete).
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("S3 mirror %s: still uploading %s after %.0f s; giving up on it", self.dest,
                      self._active, timeout_s)
        if self.failed:
            log.error("S3 mirror %s: steps %s did not upload; their local copies are complete",
                      self.dest, self.failed)

    # ----- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        s3 = s3lib.client(self._endpoint_url, self._botocore_attempts)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing or self._announce is not None)
                announce = self._announce
                if not self._queue and announce is None:
                    return
                if not self._queue:  # only the head to publish
                    self._active = None
                    newest = None
                else:
                    *older, newest = sorted(self._queue, key=lambda p: p.name)
                    self._queue.clear()
                    self._active = newest
            if newest is None:
                try:
                    self.publish_head(announce, s3=s3)
                except Exception as exc:  # noqa: BLE001 - every upload publishes its own head first
                    log.error("S3 mirror: could not publish %s/%s: %s; retrying before the next upload",
                              self.dest, HEAD_KEY, exc)
                finally:
                    with self._cond:
                        if self._announce is announce:
                            self._announce = None
                        self._cond.notify_all()
                continue
            for path in older:
                log.info("S3 mirror: %s superseded by %s before its upload started", path.name, newest.name)
                self.skipped.append(_dir_step(path))
            try:
                step = self.upload(newest, s3=s3)
                self.uploaded.append(step)
                if self.keep_last:
                    self.prune(s3=s3)
            except Exception as exc:  # noqa: BLE001 - never kill training for the mirror
                log.error("S3 mirror: %s not mirrored: %s", newest, exc)
                self.failed.append(_dir_step(newest))
            finally:
                with self._cond:
                    self._active = None
                    if self._announce is not None and self._head == self._announce:
                        self._announce = None  # the upload published it
                    self._cond.notify_all()

    def head(self, *, s3=None) -> Branch | None:
        """The branch ``branch.json`` names now (None: no head, e.g. mirrored before branches)."""
        return read_head(str(self.dest), s3=s3 or s3lib.client(self._endpoint_url, self._botocore_attempts))

    def publish_head(self, branch: Branch, *, s3=None) -> None:
        """Make ``branch`` the head, unless a run that started later already is (then raise
        MirrorError: this run must not upload over a newer one)."""
        s3 = s3 or s3lib.client(self._endpoint_url, self._botocore_attempts)
        current = self._do(lambda: read_head(str(self.dest), s3=s3), f"read {self.dest}/{HEAD_KEY}")
        if current is not None and current.id != branch.id and current.started_ns > branch.started_ns:
            raise MirrorError(f"{self.dest}/{HEAD_KEY} names branch {current.id}, started after this run "
                              f"(branch {branch.id}): another run owns this prefix; not uploading")
        if current != branch:
            body = json.dumps(branch.to_json(), sort_keys=True).encode()
            self._do(lambda: s3lib.put_bytes(body, self.dest.join(HEAD_KEY), s3=s3), f"upload {self.dest}/{HEAD_KEY}")
            log.info("S3 mirror: %s/%s -> branch %s (lineage %s)", self.dest, HEAD_KEY, branch.id,
                     list(branch.lineage))
        self._head = branch

    def upload(self, ckpt_dir: Path, *, s3=None) -> int:
        """Upload one complete checkpoint dir, manifest last. Returns its step."""
        s3 = s3 or s3lib.client(self._endpoint_url, self._botocore_attempts)
        manifest = read_manifest(ckpt_dir)
        if manifest is None:
            raise MirrorError(f"{ckpt_dir}: no valid manifest; only complete checkpoints are mirrored")
        step = int(manifest["step"])
        prefix = self.dest.join(step_dir_name(step))
        bucket = self.dest.bucket
        manifest_key = prefix.join(MANIFEST).key
        # (0) the head names this checkpoint's branch (or a newer run owns the prefix: stop here)
        branch = Branch.from_json(manifest.get("branch"))
        if branch is not None:
            self.publish_head(branch, s3=s3)
        # (1) an older manifest for this step must not describe the objects we are replacing
        self._do(lambda: s3.delete_object(Bucket=bucket, Key=manifest_key), f"delete {prefix}/{MANIFEST}")
        # (2) + (3) data files, each checked to be there with the right size
        for name, meta in manifest["files"].items():
            url = prefix.join(name)

            def put_and_check(name=name, url=url, size=meta["size"]) -> None:
                s3lib.upload_file(ckpt_dir / name, url, s3=s3)
                got = s3.head_object(Bucket=bucket, Key=url.key)["ContentLength"]
                if got != size:
                    raise MirrorError(f"{url}: {got} bytes on S3, {size} expected")

            self._do(put_and_check, f"upload {url}")
        # (4) the commit record, after one more look at the head: a run that started meanwhile
        # owns the prefix now (its manifests are the live ones; ours would be off its lineage)
        if branch is not None:
            self.publish_head(branch, s3=s3)
        body = (ckpt_dir / MANIFEST).read_bytes()
        self._do(lambda: s3lib.put_bytes(body, prefix.join(MANIFEST), s3=s3), f"upload {prefix}/{MANIFEST}")
        log.info("S3 mirror: %s -> %s", ckpt_dir, prefix)
        return step

    def prune(self, *, s3=None) -> None:
        """Keep the newest ``keep_last`` checkpoints of the live branch on S3; delete its older
        ones (and older incomplete leftovers), manifest first. Checkpoints of abandoned branches
        are neither counted nor deleted, and nothing is deleted once another run owns the head."""
        s3 = s3 or s3lib.client(self._endpoint_url, self._botocore_attempts)
        live_branch = self._head
        head = self._do(lambda: read_head(str(self.dest), s3=s3), f"read {self.dest}/{HEAD_KEY}")
        if live_branch is not None and head is not None and head.id != live_branch.id:
            log.warning("S3 mirror: %s/%s names branch %s, not this run's %s; not pruning", self.dest, HEAD_KEY,
                        head.id, live_branch.id)
            return
        live_branch = live_branch or head
        by_step = _group_keys(s3lib.list_keys(self.dest, s3=s3))
        complete = sorted(step for step, names in by_step.items() if MANIFEST in names)
        live = [step for step in complete
                if live_branch is None or live_branch.holds(self._remote_manifest(step, s3) or {})]
        if len(live) <= self.keep_last:
            return
        keep_from = live[-self.keep_last]
        for step in sorted(by_step):
            if step >= keep_from or (step in complete and step not in live):
                continue  # kept, or another branch's
            names = sorted(by_step[step], key=lambda n: n != MANIFEST)  # manifest first
            for name in names:
                key = self.dest.join(step_dir_name(step), name).key
                self._do(lambda key=key: s3.delete_object(Bucket=self.dest.bucket, Key=key), f"delete {key}")
            log.info("S3 mirror: removed %s (keep_last=%d)", step_dir_name(step), self.keep_last)

    def _remote_manifest(self, step: int, s3) -> dict | None:
        url = self.dest.join(step_dir_name(step), MANIFEST)
        try:
            return _parse_manifest(self._do(lambda: s3lib.get_bytes(url, s3=s3), f"read {url}"))
        except MirrorError:
            return None

    def _do(self, fn: Callable[[], T], what: str) -> T:
        return _retry(fn, what, **self._retry_kw)


def _dir_step(path: Path) -> int:
    """The step in a checkpoint dir's name (``step-00000010``, ``abandoned-step-00000010``)."""
    match = re.search(r"step-(\d{8})", path.name)
    return int(match.group(1)) if match else -1


def _group_keys(keys: list[str]) -> dict[int, set[str]]:
    by_step: dict[int, set[str]] = {}
    for key in keys:
        match = _STEP_KEY.match(key)
        if match:
            by_step.setdefault(int(match.group(2)), set()).add(match.group(3))
    return by_step


# ----- restore side -----------------------------------------------------------------------
def read_head(url: str, s3=None) -> Branch | None:
    """The branch ``<url>/branch.json`` names; None when there is none (a prefix mirrored
    before branches existed: every complete checkpoint counts as live then)."""
    try:
        body = s3lib.get_bytes(s3lib.parse_s3_url(url).join(HEAD_KEY), s3=s3)
    except UserError as exc:
        if "no such object" not in str(exc):
            raise
        return None
    try:
        return Branch.from_json(json.loads(body))
    except ValueError:
        log.warning("%s/%s is not a branch record; treating every checkpoint as live", url, HEAD_KEY)
        return None


def remote_checkpoints(url: str, s3=None) -> list[int]:
    """Steps under ``url`` that have a manifest on S3 (of any branch), oldest first."""
    by_step = _group_keys(s3lib.list_keys(url, s3=s3))
    return sorted(step for step, names in by_step.items() if MANIFEST in names)


def live_checkpoints(url: str, s3=None) -> list[int]:
    """Steps under ``url`` with a manifest on the head's lineage, oldest first."""
    s3 = s3 or s3lib.client()
    head = read_head(url, s3=s3)
    base = s3lib.parse_s3_url(url)
    steps = []
    for step in remote_checkpoints(url, s3=s3):
        got = _get_manifest(base.join(step_dir_name(step)), s3)
        if got is not None and (head is None or head.holds(got[0])):
            steps.append(step)
    return steps


def _parse_manifest(body: bytes) -> dict | None:
    try:
        manifest = json.loads(body)
    except ValueError:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "step" not in manifest:
        return None
    return manifest


def _get_manifest(src: s3lib.S3Url, s3) -> tuple[dict, bytes] | None:
    """(parsed manifest, its bytes) of the checkpoint at ``src``; None when it has none."""
    try:
        body = s3lib.get_bytes(src.join(MANIFEST), s3=s3)
    except UserError as exc:
        if "no such object" not in str(exc):
            raise  # access denied, no bucket: say so rather than "no checkpoint"
        log.warning("%s: no manifest on S3; not a complete checkpoint", src)
        return None
    manifest = _parse_manifest(body)
    if manifest is None:
        log.warning("%s: manifest.json is not a checkpoint manifest; skipping", src)
        return None
    return manifest, body


def fetch_checkpoint(url: str, local_root: str | Path, s3=None) -> Path | None:
    """Download the checkpoint at ``url`` (``s3://.../step-XXXXXXXX``) into ``local_root``.

    Files go to a temp dir, are checked against the manifest's sha256, and the dir is renamed
    into place, so a failed download never looks like a complete local checkpoint. Returns
    the local path, or None when the S3 copy is incomplete or corrupt.
    """
    s3 = s3 or s3lib.client()
    src = s3lib.parse_s3_url(url.rstrip("/"))
    got = _get_manifest(src, s3)
    return None if got is None else _download(src, *got, Path(local_root), s3)


def _download(src: s3lib.S3Url, manifest: dict, manifest_bytes: bytes, local_root: Path, s3) -> Path | None:
    name = src.key.rsplit("/", 1)[-1]
    files = dict(manifest["files"])
    if any("/" in f or "\\" in f or f.startswith(".") for f in files):
        log.warning("%s: manifest.json names files outside the checkpoint directory; skipping", src)
        return None
    local_root.mkdir(parents=True, exist_ok=True)
    tmp = local_root / f".tmp-fetch-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for fname, meta in files.items():
        s3lib.download_file(src.join(fname), tmp / fname, s3=s3)
        if sha256_file(tmp / fname) != meta["sha256"]:
            log.warning("%s/%s: sha256 differs from its manifest; not using this checkpoint", src, fname)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
    (tmp / MANIFEST).write_bytes(manifest_bytes)
    if verify(tmp) is None:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    final = local_root / name
    commit_dir(tmp, final)
    log.info("fetched %s -> %s", src, final)
    return final


def fetch_latest(url: str, local_root: str | Path, s3=None) -> Path | None:
    """Download the newest complete checkpoint of the live branch under the mirror prefix
    ``url`` (the head's lineage; every checkpoint when there is no head); None if none."""
    s3 = s3 or s3lib.client()
    base = s3lib.parse_s3_url(url)
    head = read_head(url, s3=s3)
    for step in reversed(remote_checkpoints(url, s3=s3)):
        src = base.join(step_dir_name(step))
        got = _get_manifest(src, s3)
        if got is None:
            continue
        if head is not None and not head.holds(got[0]):
            log.warning("%s: not on the live branch %s of %s/%s (an abandoned trajectory); skipping", src,
                        head.id, url.rstrip("/"), HEAD_KEY)
            continue
        found = _download(src, *got, Path(local_root), s3)
        if found is not None:
            return found
    return None
