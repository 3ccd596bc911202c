"""Checkpointer in-process, with the real GpuBackend (CPU, one process), the tiny preset, the
real feature loader, AdamW + LR schedule, EMA and the loop's own ``train_step``."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch
from faultproxy import FaultProxy
from safetensors.torch import load_file

from training.backends.gpu import GpuBackend, GpuConfig
from training.checkpoint.checkpointer import Checkpointer
from training.checkpoint.config import CheckpointConfig
from training.checkpoint.consolidate import load_full
from training.checkpoint.layout import MANIFEST, find_latest, list_complete, sha256_file, verify
from training.checkpoint.mirror import S3Mirror, live_checkpoints, read_head, remote_checkpoints
from training.checkpoint.train_state import TrainState, capture_rng, restore_rng
from training.data.loader import FeatureLoader
from training.data.shards import write_synthetic_features
from training.errors import UserError
from training.loop import train_step
from training.model.build import ModelConfig, build_model
from training.objective import ObjectiveConfig, RectifiedFlow
from training.optim.ema import EMA, EmaConfig
from training.optim.factory import OptimConfig, build_scheduler, optimizer_factory

BATCH = 2


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=12, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8,
                             text_tokens=(1, 8))
    return out


class Run:
    """The loop's components, built the way training/loop.py builds them."""

    def __init__(self, features: Path, root: Path, **ckpt_kw) -> None:
        torch.manual_seed(0)
        self.backend = GpuBackend(GpuConfig(), precision="fp32")
        self.backend.init()
        self.loader = FeatureLoader(features, batch_size=BATCH, seed=3, prefetch=1)
        self.model = self.backend.prepare_model(build_model(ModelConfig(preset="tiny")))
        self.optim_cfg = OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", max_grad_norm=1.0)
        self.optimizer = self.backend.build_optimizer(self.model, optimizer_factory(self.optim_cfg))
        self.scheduler = build_scheduler(self.optimizer, self.optim_cfg, max_steps=20)
        self.ema = EMA(self.backend.unwrap(self.model), EmaConfig(decay=0.9))
        null_text, null_mask = self.loader.null_caption()
        self.objective = RectifiedFlow(ObjectiveConfig(caption_dropout=0.3),
                                       vae_scaling_factor=self.loader.index.vae_scaling_factor,
                                       null_text=null_text, null_mask=null_mask)
        cfg = CheckpointConfig(dir=str(root), **{"every_steps": 0, "keep_last": 0, **ckpt_kw})
        self.ckpt = Checkpointer(cfg, self.backend, output_dir=root.parent, run_config={"note": "test"})
        self.state = TrainState()
        self._batches = None

    @property
    def parts(self) -> dict:
        return dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, ema=self.ema,
                    loader=self.loader, state=self.state)

    def restore(self) -> Path | None:
        return self.ckpt.restore(**self.parts)

    def steps(self, n: int) -> list[Path]:
        self._batches = self._batches or self.backend.device_batches(self.loader)
        saved = []
        for _ in range(n):
            train_step(self.model, self.optimizer, self.scheduler, self.objective, self._batches, self.backend,
                       self.optim_cfg)
            self.state.step += 1
            self.ema.update(self.backend.unwrap(self.model), self.state.step)
            self.state.samples_seen += BATCH
            path = self.ckpt.maybe_save(step=self.state.step, **self.parts)
            if path:
                saved.append(path)
        return saved

    def save(self) -> Path | None:
        return self.ckpt.maybe_save(step=self.state.step, force=True, **self.parts)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.backend.unwrap(self.model).state_dict().items()}

    def close(self) -> None:
        self.loader.close()
        self.ckpt.close()
        self.backend.close()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def test_sharded_layout_manifest_and_train_state(features, tmp_path):
    run = Run(features, tmp_path / "ckpt")
    run.steps(3)
    path = run.save()
    run.close()
    assert path == tmp_path / "ckpt" / "step-00000003"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000003"]  # no temp dir left
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([MANIFEST, "shard-rank-00000.safetensors", "rng-rank-00000.pt", "train_state.json",
                            "rank-00000.done.json"])
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["format"] == "sana-checkpoint/2" and manifest["world_size"] == 1
    assert sorted(manifest["files"]) == sorted(set(names) - {MANIFEST})
    # the sha256 taken while writing is the sha256 of the bytes on disk
    assert all(manifest["files"][n]["sha256"] == sha256_file(path / n) for n in manifest["files"])
    state = json.loads((path / "train_state.json").read_text())
    assert state["step"] == 3 and state["dataloader"] == run.loader.state_dict()
    assert state["config"] == {"note": "test"} and state["model_config"]["num_layers"] == 1
    full = load_full(path)
    assert_same(full["model"], run.weights())
    assert_same(full["ema"], run.ema.state_dict())
    want_opt = run.backend.optimizer_state_dict(run.model, run.optimizer)
    assert full["optimizer"]["param_groups"] == json.loads(json.dumps(want_opt["param_groups"]))  # JSON: lists
    for name, entry in want_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(full["optimizer"]["state"][name][key], value), (name, key)


def test_full_format_layout_manifest_and_train_state(features, tmp_path):
    """checkpoint.format: full is the old single-writer format (sana-checkpoint/1)."""
    run = Run(features, tmp_path / "ckpt", format="full")
    run.steps(3)
    path = run.save()
    run.close()
    assert path == tmp_path / "ckpt" / "step-00000003"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000003"]  # no temp dir left
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([MANIFEST, "model.safetensors", "optimizer.pt", "ema.safetensors",
                            "train_state.json", "rng.pt"])
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["format"] == "sana-checkpoint/1"
    assert sorted(manifest["files"]) == sorted(set(names) - {MANIFEST})
    assert all(manifest["files"][n]["size"] == (path / n).stat().st_size for n in manifest["files"])
    assert verify(path) == manifest
    state = json.loads((path / "train_state.json").read_text())
    assert state["step"] == 3 and state["samples_seen"] == 3 * BATCH
    assert state["dataloader"] == run.loader.state_dict()
    assert state["lr_scheduler"]["last_epoch"] == 3
    assert state["config"] == {"note": "test"}
    assert state["model_config"]["num_layers"] == 1  # what export rebuilds the model from
    assert_same(load_file(path / "model.safetensors"), run.weights())
    optim = torch.load(path / "optimizer.pt", weights_only=True)
    assert "patch_embed.proj.weight" in optim["state"]  # keyed by parameter name, not index


def test_resume_continues_bit_identically(features, tmp_path):
    """3 steps, save, 4 more == restore in a fresh process-like setup, 4 more: every bit."""
    ref = Run(features, tmp_path / "a")
    ref.steps(3)
    ref.save()
    ref.steps(4)
    expected, expected_ema = ref.weights(), ref.ema.state_dict()
    expected_opt = ref.backend.optimizer_state_dict(ref.model, ref.optimizer)
    ref.close()

    # Disturb every RNG stream before resuming: restore must put them all back.
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    run = Run(features, tmp_path / "a")
    assert run.restore() == tmp_path / "a" / "step-00000003"
    assert run.state.step == 3 and run.state.samples_seen == 3 * BATCH
    assert run.scheduler.last_epoch == 3
    run.steps(4)
    assert_same(run.weights(), expected)
    assert_same(run.ema.state_dict(), expected_ema)
    got_opt = run.backend.optimizer_state_dict(run.model, run.optimizer)
    for name, st in expected_opt["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got_opt["state"][name][key])), (name, key)
    run.close()


def test_resume_from_the_old_format_is_bit_identical_and_the_next_save_is_sharded(features, tmp_path):
    ref = Run(features, tmp_path / "o", format="full")
    ref.steps(3)
    ref.save()
    ref.steps(2)
    expected, expected_ema = ref.weights(), ref.ema.state_dict()
    ref.close()
    run = Run(features, tmp_path / "o")  # format: sharded (the default)
    assert run.restore() == tmp_path / "o" / "step-00000003"
    assert json.loads((tmp_path / "o" / "step-00000003" / MANIFEST).read_text())["format"] == "sana-checkpoint/1"
    run.steps(2)
    assert_same(run.weights(), expected)
    assert_same(run.ema.state_dict(), expected_ema)
    path = run.save()
    run.close()
    assert json.loads((path / MANIFEST).read_text())["format"] == "sana-checkpoint/2"
    assert_same(load_full(path)["model"], expected)


def test_every_steps_keep_last_and_no_double_save(features, tmp_path):
    run = Run(features, tmp_path / "c", every_steps=2, keep_last=2)
    saved = run.steps(7)
    assert [p.name for p in saved] == ["step-00000002", "step-00000004", "step-00000006"]
    assert run.save().name == "step-00000007"  # forced at the end
    assert [p.name for p in run.steps(1)] == ["step-00000008"]  # periodic at 8 ...
    assert run.ckpt.maybe_save(step=8, force=True, **run.parts) is None  # ... not again when forced
    run.close()
    assert [p.name for _, p in list_complete(tmp_path / "c")] == ["step-00000007", "step-00000008"]


def test_find_latest_skips_partial_and_corrupt_checkpoints(features, tmp_path):
    root = tmp_path / "d"
    run = Run(features, root, every_steps=2)
    run.steps(10)
    run.close()
    # step 10: a file flipped in place (same size): only the sha256 check catches it
    with open(root / "step-00000010" / "shard-rank-00000.safetensors", "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    # step 8: truncated file (size differs from the manifest)
    with open(root / "step-00000008" / "shard-rank-00000.safetensors", "r+b") as fh:
        fh.truncate(10)
    # step 6: no manifest (as if the manifest write never happened)
    (root / "step-00000006" / MANIFEST).unlink()
    # step 12: a temp dir whose manifest is complete but names another step (never finished)
    shutil.copytree(root / "step-00000004", root / ".tmp-step-00000012")
    assert find_latest(root) == root / "step-00000004"
    assert find_latest(root, full=False) == root / "step-00000010"  # the cheap scan trusts sizes

    run = Run(features, root, resume="auto")
    assert not (root / ".tmp-step-00000012").exists()  # stale temp dirs are cleared at start
    assert run.restore() == root / "step-00000004" and run.state.step == 4
    run.close()


def test_resume_none_explicit_path_and_bad_paths(features, tmp_path):
    root = tmp_path / "e"
    run = Run(features, root, every_steps=2)
    run.steps(4)
    run.close()
    assert Run(features, root, resume="none").restore() is None
    run = Run(features, root, resume=str(root))  # a root: its newest complete checkpoint
    assert run.restore() == root / "step-00000004"
    # Going back to step 2 abandons step 4: set aside, so a crash + auto never returns to it.
    run = Run(features, root, resume=str(root / "step-00000002"))
    assert run.restore() == root / "step-00000002" and run.state.step == 2
    assert (root / "abandoned-step-00000004" / MANIFEST).exists()
    assert find_latest(root) == root / "step-00000002"
    with pytest.raises(UserError, match="checkpoint.resume: .*nowhere"):
        Run(features, root, resume=str(tmp_path / "nowhere")).restore()
    (root / "step-00000002" / "rng-rank-00000.pt").write_bytes(b"garbage")
    with pytest.raises(UserError, match="checkpoint.resume: .*step-00000002 is incomplete or corrupt"):
        Run(features, root, resume=str(root / "step-00000002")).restore()


def test_restore_from_s3_mirror_when_local_is_empty(features, tmp_path, s3_bucket):
    url = f"s3://{s3_bucket}/runs/x"
    run = Run(features, tmp_path / "f", every_steps=2, keep_last=1, s3_mirror=url)
    run.steps(5)
    run.save()
    expected = run.weights()
    run.close()  # waits for the uploads
    assert remote_checkpoints(url)[-1] == 5
    assert [p.name for _, p in list_complete(tmp_path / "f")] == ["step-00000005"]  # local keep_last=1

    shutil.rmtree(tmp_path / "f")  # the node (and its local disk) is gone
    run = Run(features, tmp_path / "f", s3_mirror=url)
    assert run.restore() == tmp_path / "f" / "step-00000005"
    assert run.state.step == 5
    assert_same(run.weights(), expected)
    run.close()
    # An explicit s3:// checkpoint URL works too (e.g. another run's checkpoint). Which older
    # steps made it to S3 depends on timing: a step still queued when a newer one arrives is
    # superseded.
    first = remote_checkpoints(url)[0]
    run = Run(features, tmp_path / "g", resume=f"{url}/step-{first:08d}")
    assert run.restore() == tmp_path / "g" / f"step-{first:08d}" and run.state.step == first
    run.close()


def test_start_finishes_a_commit_whose_manifest_is_complete_and_deletes_incomplete_temp_dirs(features, tmp_path):
    root = tmp_path / "m"
    run = Run(features, root, every_steps=2)
    run.steps(8)  # steps 2, 4, 6, 8
    run.close()
    # step 6: killed between the manifest and the rename (every rank's files, the manifest last)
    os.replace(root / "step-00000006", root / ".tmp-step-00000006")
    # step 8: the same, but a file is short of its manifest size
    os.replace(root / "step-00000008", root / ".tmp-step-00000008")
    with open(root / ".tmp-step-00000008" / "shard-rank-00000.safetensors", "r+b") as fh:
        fh.truncate(100)
    shutil.copytree(root / "step-00000004", root / ".tmp-step-00000010")  # killed before the manifest
    (root / ".tmp-step-00000010" / MANIFEST).unlink()
    shutil.copytree(root / "step-00000004", root / ".tmp-step-00000012")  # a manifest of another step
    shutil.copytree(root / "step-00000002", root / ".tmp-fetch-step-00000014")  # an S3 fetch cut short
    (root / ".tmp-fetch-step-00000014" / MANIFEST).unlink()
    (root / ".tmp-step-00000016.rank-00001.failed.json").write_text("{}")  # a failure record beside
    run = Run(features, root, resume="auto")
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    assert run.restore() == root / "step-00000006" and run.state.step == 6
    run.close()


def test_a_commit_interrupted_between_its_renames_loses_neither_copy(features, tmp_path, monkeypatch):
    """A fresh run (``resume: none``) saves step 2 over the old run's step 2. Its writer stops
    for good right where it renames the new copy into place (as a process killed there
    would), and the next start still finds a complete step 2: the new one."""
    root = tmp_path / "k"
    old = Run(features, root, every_steps=2)
    old.steps(2)
    old.close()
    frozen, release = threading.Event(), threading.Event()
    real_replace = os.replace

    def replace(src, dst) -> None:
        if Path(dst).name == "step-00000002" and threading.current_thread() is not threading.main_thread():
            frozen.set()
            release.wait(120)
            raise OSError("the process died here")  # a killed process never comes back
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    new = Run(features, root, every_steps=2, resume="none")
    assert new.restore() is None
    new.steps(2)  # the save of step 2 runs in the background and stops in its commit
    assert frozen.wait(120)
    try:
        restarted = Run(features, root, resume="auto")  # the next start, the old process "dead"
        step2 = root / "step-00000002"
        assert verify(step2) is not None, sorted(p.name for p in root.iterdir())
        assert json.loads((step2 / MANIFEST).read_text())["branch"]["id"] == new.ckpt.branch.id
        assert not list(root.glob(".tmp-*"))
        assert restarted.restore() == step2
        restarted.close()
    finally:
        release.set()
        new.ckpt._job.wait()
        new.loader.close()
        new.backend.close()


@pytest.mark.parametrize("first", ["failing rank", "rank 0"])
def test_a_rank_that_cannot_create_the_save_dir_fails_the_commit_within_a_poll(tmp_path, monkeypatch, first):
    """Rank 1's mkdir of the temp dir fails (before or after rank 0 created it on the shared
    filesystem). Its failure record is written (inside the temp dir, or beside it when there
    is none), so rank 0's commit fails at its next poll with rank 1's own error instead of
    waiting out the timeout; discarding the save removes the record too."""
    from training.checkpoint import sharded
    from training.optim.sharding import Piece

    root = tmp_path / "ckpt"
    root.mkdir()
    tmp = root / ".tmp-step-00000004"
    staged = sharded.Stager().stage({"model/w": Piece(torch.arange(8.0).reshape(4, 2), 0, 2, 0, (4, 2))})
    real_mkdir = Path.mkdir

    def rank1(**_) -> None:
        def mkdir(self, *args, **kw):
            if self == tmp:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
            return real_mkdir(self, *args, **kw)

        with monkeypatch.context() as m:
            m.setattr(Path, "mkdir", mkdir)
            with pytest.raises(OSError, match="Input/output error"):
                sharded.write_rank(tmp, step=4, rank=1, staged={}, rng={}, train_state=None)

    if first == "failing rank":
        rank1()
    sharded.write_rank(tmp, step=4, rank=0, staged=staged, rng={}, train_state={"step": 4})
    if first == "rank 0":
        rank1()
    t0 = time.monotonic()
    with pytest.raises(OSError, match=rf"^rank 1: Input/output error \({tmp}\)$"):
        sharded.commit(tmp, root / "step-00000004", step=4, world_size=2, extra={}, timeout_s=30)
    assert time.monotonic() - t0 < 10  # one poll, not the 30 s timeout
    sharded.discard(tmp)
    assert list(root.iterdir()) == []


def test_a_rank_that_fails_while_staging_leaves_its_failure_record(features, tmp_path, monkeypatch):
    """Out of host memory while copying its rows (on the training thread, before any writer
    starts): the rank still tells rank 0, whose commit would otherwise wait for it; the next
    start removes the record."""
    run = Run(features, tmp_path / "s", every_steps=2)
    run.steps(1)

    def no_memory(pieces):
        raise MemoryError("host out of memory")

    monkeypatch.setattr(run.ckpt._stager, "stage", no_memory)
    with pytest.raises(MemoryError):
        run.steps(1)
    record = tmp_path / "s" / ".tmp-step-00000002.rank-00000.failed.json"
    assert json.loads(record.read_text()) == {"rank": 0, "error": "staging failed: MemoryError: host out of memory"}
    run.close()
    Run(features, tmp_path / "s").close()
    assert not record.exists()


def _mirrored_steps(run: Run, n: int) -> None:
    """``n`` steps, each save committed and uploaded before the next (no upload superseded)."""
    for _ in range(n):
        run.steps(1)
        run.ckpt.wait()
        run.ckpt.mirror.wait()


def test_s3_restore_and_prune_follow_the_live_branch_after_resuming_an_older_step(
        features, tmp_path, s3_endpoint, s3_bucket, monkeypatch):
    """Run A mirrors to step 12; run B goes back to step 4 (through a faulty network) and
    saves 6 and 8. On S3, A's 10 and 12 keep their manifests (nothing can be renamed there),
    but they are off the live lineage: B's prune neither counts them nor deletes B's own
    checkpoints for them, a late upload from A's mirror is refused (or, if it lands, ignored),
    and after losing the local disk ``resume: auto`` takes B's step 8, not A's newer steps."""
    url = f"s3://{s3_bucket}/runs/branches"
    root = tmp_path / "ckpt"
    a = Run(features, root, every_steps=2, s3_mirror=url, s3_keep_last=3)
    assert a.restore() is None
    _mirrored_steps(a, 12)
    a.close()
    assert remote_checkpoints(url) == [8, 10, 12]

    force = [("PUT", "branch.json", "drop-after"), ("PUT", "branch.json", "503")]
    with FaultProxy(s3_endpoint, error_rate=0.1, drop_rate=0.1, max_faults=20, seed=11, force=force) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        b = Run(features, root, every_steps=2, s3_mirror=url, s3_keep_last=3, resume=str(root / "step-00000004"))
        assert b.restore() == root / "step-00000004"
        _mirrored_steps(b, 4)  # saves 6 and 8 (8 replaces A's 8 on S3)
        want = b.weights()
        b.close()
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_endpoint)
    assert {"drop-after", "503"} <= set(proxy.stats), proxy.stats
    # B's head was on S3 before any manifest of B (a PUT that S3 executed: 200, or dropped after)
    stored = [path for method, path, outcome in proxy.log if method == "PUT" and outcome in ("200", "drop-after")]
    first_manifest = next(i for i, path in enumerate(stored) if path.endswith("/" + MANIFEST))
    assert any(path.endswith("/branch.json") for path in stored[:first_manifest]), stored
    assert read_head(url).id == b.ckpt.branch.id
    # Nothing of B was pruned for A's newer (abandoned) steps, which stay on S3 but not live.
    assert remote_checkpoints(url) == [6, 8, 10, 12]
    assert live_checkpoints(url) == [6, 8]

    # A's mirror, still draining (e.g. a cancelled job's close()), tries to upload A's step 10
    # again: refused, since a run that started later owns the head.
    late = S3Mirror(url)
    late.submit(root / "abandoned-step-00000010")
    late.close()
    assert late.failed == [10] and live_checkpoints(url) == [6, 8]
    # Even a manifest of A that lands after the head (the race the check cannot close) is ignored.
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for obj in s3.list_objects_v2(Bucket=s3_bucket, Prefix="runs/branches/step-00000012/")["Contents"]:
        key = obj["Key"].replace("step-00000012", "step-00000014")
        body = s3.get_object(Bucket=s3_bucket, Key=obj["Key"])["Body"].read()
        if key.endswith(MANIFEST):
            body = json.dumps({**json.loads(body), "step": 14}).encode()
        s3.put_object(Bucket=s3_bucket, Key=key, Body=body)
    assert remote_checkpoints(url)[-1] == 14 and live_checkpoints(url) == [6, 8]

    shutil.rmtree(root)  # the local checkpoints are gone (lost FSx, a new cluster)
    c = Run(features, root, every_steps=2, s3_mirror=url, s3_keep_last=3)
    assert c.restore() == root / "step-00000008" and c.state.step == 8
    assert_same(c.weights(), want)
    _mirrored_steps(c, 4)  # 10 and 12 replace A's; then B's 6 is the oldest live one: pruned
    c.close()
    assert live_checkpoints(url) == [8, 10, 12]
    assert remote_checkpoints(url) == [8, 10, 12, 14]  # A's late 14 is left, never resumed


def test_branch_lineage_across_forks_and_checkpoints_from_before_branches():
    from training.checkpoint.branch import Branch

    def manifest(branch: Branch | None, step: int) -> dict:
        return {"step": step, "files": {}, **({"branch": branch.to_json()} if branch else {})}

    a = Branch.fresh()
    b = Branch.fork(manifest(a, 4))  # back to A's step 4
    c = Branch.fork(manifest(b, 6))  # back to B's step 6
    assert b.holds(manifest(a, 4)) and b.holds(manifest(a, 2)) and not b.holds(manifest(a, 6))
    assert b.holds(manifest(b, 8)) and not b.holds(manifest(c, 8))
    assert c.holds(manifest(a, 4)) and c.holds(manifest(b, 6)) and not c.holds(manifest(b, 8))
    assert not c.holds(manifest(a, 6)) and c.lineage == ((None, 4), (a.id, 4), (b.id, 6))[1:]
    legacy = Branch.fork(manifest(None, 3))  # resumed from a checkpoint written before branches
    assert legacy.holds(manifest(None, 3)) and not legacy.holds(manifest(None, 5))
    assert not Branch.fresh().holds(manifest(None, 1)) and not a.holds(manifest(b, 8))
    assert Branch.from_json(c.to_json()) == c and Branch.from_json({"id": 3}) is None


def test_rng_capture_and_restore_covers_python_numpy_torch():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = capture_rng()
    expected = (random.random(), np.random.randn(3).tolist(), torch.rand(3))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    restore_rng(state)
    assert (random.random(), np.random.randn(3).tolist()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


@pytest.mark.parametrize(("kw", "key"), [
    ({"every_steps": -1}, "checkpoint.every_steps"),
    ({"keep_last": 1.5}, "checkpoint.keep_last"),
    ({"s3_mirror": "bucket/prefix"}, "checkpoint.s3_mirror"),
    ({"resume": ""}, "checkpoint.resume"),
    ({"dir": ""}, "checkpoint.dir"),
])
def test_config_errors_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        CheckpointConfig(**kw)


def test_fault_hook_is_inert_without_the_env_var(features, tmp_path, monkeypatch):
    monkeypatch.setenv("SANA_CHECKPOINT_FAULT", "999:after-shard")  # another step: no effect
    run = Run(features, tmp_path / "h")
    run.steps(1)
    assert run.save() is not None
    run.close()
    assert os.environ["SANA_CHECKPOINT_FAULT"] == "999:after-shard"


def test_resume_with_a_changed_config_says_what_changed(features, tmp_path, caplog):
    run = Run(features, tmp_path / "i")
    run.steps(1)
    run.save()
    run.close()
    run = Run(features, tmp_path / "i")
    run.ckpt.run_config = {"note": "changed", "checkpoint": {"resume": "auto"}}
    with caplog.at_level("WARNING", logger="training.checkpoint"):
        assert run.restore() is not None
    assert "resuming with a changed config: note: 'test' -> 'changed'" in caplog.text
    assert "checkpoint.resume" not in caplog.text
    run.close()


def test_a_failed_write_is_one_clear_error_and_leaves_no_partial_checkpoint(features, tmp_path, monkeypatch):
    run = Run(features, tmp_path / "j", every_steps=2)
    run.steps(2)
    monkeypatch.setenv("SANA_CHECKPOINT_FAULT", "4:after-shard:enospc")  # the disk fills up at step 4
    with pytest.raises(UserError, match=r"checkpoint.dir: writing .*step-00000004 failed: No space left on device"):
        run.steps(2)
        run.ckpt.wait()  # an asynchronous save reports at the next save or wait()
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == ["step-00000002"]
    assert find_latest(tmp_path / "j") == tmp_path / "j" / "step-00000002"
    run.close()
