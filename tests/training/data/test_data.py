"""Feature shards: the writer -> loader round trip, order, ranks, resume, S3, corruption."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import boto3
import pytest
import torch
from safetensors.torch import load as st_load

from training.data.index import FeatureIndex
from training.data.loader import DataConfig, FeatureLoader
from training.data.shards import INDEX, ShardWriter, encode_sample, write_shard, write_synthetic_features
from training.errors import UserError

SMALL = {"latent_shape": (4, 8, 8), "text_dim": 32, "max_text_tokens": 16, "text_tokens": (1, 16)}


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    """50 samples in 4 shards (13 per shard, the last partial)."""
    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=50, samples_per_shard=13, seed=3, **SMALL)
    return out


def sample_ids(batch) -> list[int]:
    """Which samples a batch holds: write_synthetic_features puts i in latents.flatten()[0]."""
    return [int(x) for x in batch["latents"].flatten(1)[:, 0]]


def stored_samples(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for shard in sorted(root.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                out[int(m.name.split(".")[0])] = st_load(tar.extractfile(m).read())
    return out


def test_round_trip_shapes_masks_values(features: Path):
    index = json.loads((features / INDEX).read_text())
    assert index["format"] == "sana-features/1" and index["num_samples"] == 50
    assert [s["samples"] for s in index["shards"]] == [13, 13, 13, 11]
    assert index["bytes_per_sample"] == pytest.approx(sum(s["bytes"] for s in index["shards"]) / 50, abs=0.1)
    stored = stored_samples(features)
    assert all(t["latents"].dtype == torch.bfloat16 and t["text"].dtype == torch.bfloat16 for t in stored.values())

    loader = FeatureLoader(features, batch_size=4, seed=0)
    seen = []
    for _ in range(loader.steps_per_epoch):
        batch = next(loader)
        assert batch["latents"].shape == (4, 4, 8, 8) and batch["latents"].dtype == torch.float32
        assert batch["text"].shape == (4, 16, 32) and batch["text"].dtype == torch.float32
        assert batch["text_mask"].shape == (4, 16) and batch["text_mask"].dtype == torch.int64
        for row, i in enumerate(sample_ids(batch)):
            n = stored[i]["text"].shape[0]
            assert batch["text_mask"][row].tolist() == [1] * n + [0] * (16 - n)
            assert torch.equal(batch["text"][row, :n], stored[i]["text"].float())
            assert not batch["text"][row, n:].any()
            assert torch.equal(batch["latents"][row], stored[i]["latents"].float())
        seen += sample_ids(batch)
    loader.close()
    # drop_last: 12 steps of 4 = 48 distinct samples of 50, none repeated within the epoch
    assert loader.steps_per_epoch == 12 and len(set(seen)) == 48


def test_null_caption_is_the_full_encoding_with_its_own_mask(features: Path):
    loader = FeatureLoader(features, batch_size=4, prefetch=0)
    text, mask = loader.null_caption()
    assert text.shape == (16, 32) and mask.tolist() == [1] + [0] * 15
    assert text[0].any() and text[1:].any()  # the padding positions' rows are stored too


def test_an_older_real_rows_only_null_caption_is_padded_and_warned_about(features: Path, tmp_path: Path, caplog):
    from safetensors.torch import load_file, save_file

    old = tmp_path / "old"
    shutil.copytree(features, old)
    stored = load_file(old / "null_caption.safetensors")
    save_file({"text": stored["text"][:1]}, old / "null_caption.safetensors")
    with caplog.at_level("WARNING"), FeatureLoader(old, batch_size=4, prefetch=0, verify=False) as loader:
        text, mask = loader.null_caption()
    assert text.shape == (16, 32) and mask.tolist() == [1] + [0] * 15 and not text[1:].any()
    assert "re-run precompute --merge-only" in caplog.text


def test_shuffle_is_deterministic_per_seed_and_epoch(features: Path):
    def order(seed: int, prefetch: int, steps: int = 24) -> list[int]:
        with FeatureLoader(features, batch_size=4, seed=seed, prefetch=prefetch) as loader:
            return [i for _ in range(steps) for i in sample_ids(next(loader))]

    a = order(7, prefetch=4)
    assert a == order(7, prefetch=4) == order(7, prefetch=0)
    assert a != order(8, prefetch=4)
    assert a[:48] != a[48:]  # epoch 1 is a new permutation
    assert len(set(a[48:])) == 48


def test_few_mapped_shards_give_the_same_batches(features: Path, monkeypatch):
    """Only the most recently used shards stay mmapped (file descriptors); results do not change."""
    import training.data.decode

    def batches() -> list[torch.Tensor]:
        with FeatureLoader(features, batch_size=4, seed=4, prefetch=0) as loader:
            out = [next(loader)["text"].clone() for _ in range(12)]
            assert len(loader._decoder._maps) <= training.data.decode.MAX_MAPPED_SHARDS
            return out

    expected = batches()
    monkeypatch.setattr(training.data.decode, "MAX_MAPPED_SHARDS", 1)
    assert all(torch.equal(a, b) for a, b in zip(batches(), expected, strict=True))


def test_ranks_get_disjoint_slices_of_the_same_global_batch(features: Path):
    single = FeatureLoader(features, batch_size=6, world_size=1, seed=1, prefetch=0)
    ranks = [FeatureLoader(features, batch_size=3, rank=r, world_size=2, seed=1, prefetch=0) for r in range(2)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch == 8
    for _ in range(10):  # crosses the epoch boundary
        parts = [sample_ids(next(r)) for r in ranks]
        assert not set(parts[0]) & set(parts[1])
        assert parts[0] + parts[1] == sample_ids(next(single))


@pytest.mark.parametrize("taken", [3, 11, 12, 30])
def test_resume_continues_exactly(features: Path, taken: int):
    reference = FeatureLoader(features, batch_size=4, seed=5)
    for _ in range(taken):
        next(reference)
    state = json.loads(json.dumps(reference.state_dict()))  # survives a JSON checkpoint
    expected = [sample_ids(next(reference)) for _ in range(6)]
    reference.close()

    resumed = FeatureLoader(features, batch_size=4, seed=5)
    next(resumed)  # a started prefetch thread must not leak its batches past the restore
    resumed.load_state_dict(state)
    assert [sample_ids(next(resumed)) for _ in range(6)] == expected
    resumed.close()


def test_resume_on_another_world_size_keeps_the_sample_offset(features: Path):
    before = FeatureLoader(features, batch_size=4, world_size=1, seed=5, prefetch=0)
    for _ in range(5):  # 20 samples of epoch 0 consumed
        next(before)
    state = before.state_dict()
    after = [FeatureLoader(features, batch_size=2, rank=r, world_size=2, seed=5, prefetch=0) for r in range(2)]
    for loader in after:
        loader.load_state_dict(state)
    assert (after[0].epoch, after[0].step) == (0, 5)  # global batch 4 either way
    assert sample_ids(next(after[0])) + sample_ids(next(after[1])) == sample_ids(next(before))
    odd = FeatureLoader(features, batch_size=3, seed=5, prefetch=0)
    odd.load_state_dict(state)
    assert (odd.epoch, odd.step) == (0, 6)  # 20 // 3: rounded down to a whole step


def test_resume_rejects_other_data_or_seed(features: Path):
    state = FeatureLoader(features, batch_size=4, seed=5, prefetch=0).state_dict()
    with pytest.raises(UserError, match="seed"):
        FeatureLoader(features, batch_size=4, seed=6, prefetch=0).load_state_dict(state)


def test_kept_batches_are_not_overwritten(features: Path):
    """The loader recycles batch buffers; one still referenced must never be reused."""
    loader = FeatureLoader(features, batch_size=4, seed=2, prefetch=2)
    kept = [(b := next(loader), {k: v.clone() for k, v in b.items()}) for _ in range(20)]
    view = next(loader)["text"][:, :2]  # only a view of this one survives
    snapshot = view.clone()
    for _ in range(20):
        next(loader)
    loader.close()
    assert all(torch.equal(b[k], c[k]) for b, c in kept for k in b)
    assert torch.equal(view, snapshot)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_consumer_writes_never_leak_into_later_batches(features: Path, prefetch: int):
    """Recycled buffers zero only the rows they must; a consumer writing into a batch
    (e.g. caption dropout in place) makes the next fill of that buffer a full one."""
    with FeatureLoader(features, batch_size=4, seed=6, prefetch=prefetch) as loader:
        for step in range(30):
            batch = next(loader)
            mask = batch["text_mask"].bool()
            assert not batch["text"][~mask].any(), f"step {step}: stale values in the padding"
            if step % 3 == 0:
                batch["text"].fill_(7.0)
                batch["text_mask"].fill_(1)
            del batch, mask


def test_dropped_loader_stops_its_thread(features: Path):
    import gc

    loader = FeatureLoader(features, batch_size=4, prefetch=2)
    next(loader)
    thread = loader._thread
    del loader
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_too_small_dataset_for_global_batch(features: Path):
    with pytest.raises(UserError, match="less than one global batch"):
        FeatureLoader(features, batch_size=26, world_size=2)


def test_missing_directory_and_index_are_one_line(tmp_path: Path):
    with pytest.raises(UserError, match="directory does not exist"):
        FeatureIndex.load(tmp_path / "nope")
    with pytest.raises(UserError, match="no index.json"):
        FeatureIndex.load(tmp_path)
    with pytest.raises(UserError, match="data.path: not set"):
        FeatureIndex.load("")


def test_data_config_validates():
    assert DataConfig(path="s3://b/p", batch_size=2).batch_size == 2
    with pytest.raises(ValueError, match="data.batch_size"):
        DataConfig(batch_size=0)


def test_writer_rejects_bad_samples(tmp_path: Path):
    w = ShardWriter(tmp_path, latent_shape=(4, 8, 8), text_dim=32, max_text_tokens=16,
                    vae_scaling_factor=1.0, null_caption=torch.zeros(1, 32), samples_per_shard=4)
    with pytest.raises(ValueError, match="latents shape"):
        w.add("a", torch.zeros(4, 8, 9), torch.zeros(3, 32))
    with pytest.raises(ValueError, match="text shape"):
        w.add("a", torch.zeros(4, 8, 8), torch.zeros(17, 32))
    w.add("a", torch.zeros(4, 8, 8), torch.zeros(3, 32))
    with pytest.raises(ValueError, match="unique"):
        w.add("a", torch.zeros(4, 8, 8), torch.zeros(3, 32))


# --------------------------------------------------------------------------- corruption
def copy_features(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def set_index_entry(root: Path, shard: str, **entry) -> None:
    index = json.loads((root / INDEX).read_text())
    for s in index["shards"]:
        if s["name"] == shard:
            s.update(entry)
    (root / INDEX).write_text(json.dumps(index))


def read_all(root: Path, verify: bool = True) -> None:
    loader = FeatureLoader(root, batch_size=4, prefetch=2, verify=verify)
    for _ in range(loader.steps_per_epoch):
        next(loader)


def test_sha_mismatch_names_the_shard(features: Path, tmp_path: Path):
    root = copy_features(features, tmp_path / "f")
    data = bytearray((root / "shard-00002.tar").read_bytes())
    data[2000] ^= 0xFF
    (root / "shard-00002.tar").write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"shard-00002\.tar: corrupt feature shard \(sha256"):
        read_all(root)


def test_bad_tar_names_the_shard(features: Path, tmp_path: Path):
    root = copy_features(features, tmp_path / "f")
    from training.data.shards import _sha256

    (root / "shard-00001.tar").write_bytes(b"this is not a tar file" * 100)
    set_index_entry(root, "shard-00001.tar", sha256=_sha256(root / "shard-00001.tar"))
    with pytest.raises(UserError, match=r"shard-00001\.tar: corrupt feature shard \(bad tar"):
        read_all(root)


def test_wrong_shape_names_the_shard(features: Path, tmp_path: Path):
    root = copy_features(features, tmp_path / "f")
    bad = [(f"{i:08d}", encode_sample(torch.zeros(4, 8, 7), torch.zeros(2, 32))) for i in range(11)]
    entry = write_shard(root / "shard-00003.tar", bad)
    set_index_entry(root, "shard-00003.tar", **entry)
    with pytest.raises(UserError, match=r"shard-00003\.tar: corrupt feature shard \(member \d+\.safetensors: latents shape"):
        read_all(root)


def test_truncated_member_names_the_shard(features: Path, tmp_path: Path):
    root = copy_features(features, tmp_path / "f")
    payload = encode_sample(torch.zeros(4, 8, 8), torch.zeros(2, 32))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(11):
            info = tarfile.TarInfo(f"{i:08d}.safetensors")
            info.size = len(payload) - 100
            tar.addfile(info, io.BytesIO(payload[:-100]))
    (root / "shard-00003.tar").write_bytes(buf.getvalue())
    with pytest.raises(UserError, match=r"shard-00003\.tar: corrupt feature shard \(member"):
        read_all(root, verify=False)


# --------------------------------------------------------------------------- S3
def upload_dir(root: Path, bucket: str, prefix: str) -> None:
    s3 = boto3.client("s3")
    for f in root.iterdir():
        s3.upload_file(str(f), bucket, f"{prefix}/{f.name}")


def test_s3_source_matches_local(features: Path, s3_bucket: str, tmp_path: Path):
    upload_dir(features, s3_bucket, "features/v1")
    url = f"s3://{s3_bucket}/features/v1"
    local = FeatureLoader(features, batch_size=4, seed=9, prefetch=0)
    remote = FeatureLoader(url, batch_size=4, seed=9, cache_dir=tmp_path / "cache")
    assert remote.index.num_samples == 50 and sorted(p.name for p in (tmp_path / "cache").glob("*.tar")) == [
        "shard-00000.tar", "shard-00001.tar", "shard-00002.tar", "shard-00003.tar"]
    for _ in range(5):
        a, b = next(local), next(remote)
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(local.null_caption()[0], remote.null_caption()[0])
    remote.close()


def test_s3_corrupt_shard_is_redownloaded_then_reported(features: Path, s3_bucket: str, tmp_path: Path):
    root = copy_features(features, tmp_path / "f")
    (root / "shard-00000.tar").write_bytes(b"\0" * 10240)
    upload_dir(root, s3_bucket, "bad")
    with pytest.raises(UserError, match=r"shard-00000\.tar: corrupt feature shard \(sha256"):
        FeatureLoader(f"s3://{s3_bucket}/bad", batch_size=4, cache_dir=tmp_path / "cache")


def test_s3_missing_index_or_bucket_is_one_line(s3_bucket: str):
    with pytest.raises(UserError, match=r"s3://.*/nothing-here: cannot read index.json .*no such object"):
        FeatureIndex.load(f"s3://{s3_bucket}/nothing-here")
    with pytest.raises(UserError, match="bucket does not exist"):
        FeatureIndex.load("s3://no-such-bucket-for-sure/x")


# --------------------------------------------------------------------------- CLI
def test_cli_info_and_clean_error(features: Path, tmp_path: Path, capsys):
    from training.data.bench import main

    main(["--info", str(features)])
    out = capsys.readouterr().out
    assert "50 samples in 4 shards" in out and "bytes)" in out and "all 4 shards present" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--info", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "does not exist" in err
