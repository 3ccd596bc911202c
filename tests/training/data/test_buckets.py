"""Aspect-ratio buckets in the loader: one bucket per step on every rank, disjoint samples,
seeded order, exact resume (loader and training), dropped buckets, precompile order."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.training.cpu_run import train_on_cpu
from training.config import config_from_dict
from training.data.buckets import plan_epoch
from training.data.index import FeatureIndex
from training.data.loader import FeatureLoader
from training.data.shards import write_synthetic_features

#: three buckets (tall, square, wide latents) plus one too small for a global batch of 8
SHAPES = {"0.5": (4, 6, 12), "1.0": (4, 8, 8), "2.0": (4, 12, 6), "4.0": (4, 16, 4)}
WEIGHTS = (0.3, 0.4, 0.28, 0.02)
SMALL = {"text_dim": 8, "max_text_tokens": 8, "text_tokens": (1, 8)}


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bucketed")
    write_synthetic_features(out, num_samples=200, buckets=SHAPES, bucket_weights=WEIGHTS, samples_per_shard=37,
                             seed=5, **SMALL)
    return out


def sample_ids(batch) -> list[int]:
    """write_synthetic_features puts the sample number in latents.flatten()[0]."""
    return [int(x) for x in batch["latents"].flatten(1)[:, 0]]


def test_index_lists_buckets_and_members(bucketed: Path):
    index = FeatureIndex.load(bucketed)
    counts = {name: b.samples for name, b in index.buckets.items()}
    assert list(counts) == ["0.5", "1.0", "2.0", "4.0"] and sum(counts.values()) == 200  # fixed order: h/w
    assert 0 < counts["4.0"] < 8 and {n: b.latent_shape for n, b in index.buckets.items()} == SHAPES
    assert index.latent_shape == SHAPES[max(counts, key=counts.get)]  # the most populous bucket
    members = index.bucket_members()
    assert sorted(torch.cat(list(members.values())).tolist()) == list(range(200))
    ids = ids_by_index(bucketed)
    assert sorted(ids.values()) == list(range(200))  # every sample, each once, at its bucket's shape


def ids_by_index(features: Path) -> dict[int, int]:
    """Global sample index -> the sample number write_synthetic_features stored in it (shards
    store their members grouped by bucket, so the two differ); decodes every sample at its
    bucket's shape, which fails on a wrong shape."""
    index = FeatureIndex.load(features)
    with FeatureLoader(features, batch_size=1, prefetch=0) as loader:
        return {g: int(loader._decoder.batch([g], latent_shape=index.buckets[name].latent_shape)["latents"]
                       .flatten()[0])
                for name, members in index.bucket_members().items() for g in members.tolist()}


def test_every_rank_same_bucket_disjoint_samples_union_is_the_epoch(bucketed: Path):
    world, batch = 4, 2
    loaders = [FeatureLoader(bucketed, batch_size=batch, rank=r, world_size=world, seed=9, prefetch=0)
               for r in range(world)]
    members = {n: set(m.tolist()) for n, m in loaders[0].index.bucket_members().items()}
    kept = [b.name for b in loaders[0].buckets]
    assert kept == ["0.5", "1.0", "2.0"]
    steps = loaders[0].steps_per_epoch
    assert steps == sum(len(members[n]) // (world * batch) for n in kept)
    union: dict[str, list[int]] = {n: [] for n in kept}
    for step in range(steps):
        names = {loader.bucket_at(0, step).name for loader in loaders}
        assert len(names) == 1, f"step {step}: ranks disagree on the bucket: {names}"
        name = names.pop()
        slices = [loader.indices(0, step) for loader in loaders]
        flat = [g for s in slices for g in s]
        assert len(set(flat)) == world * batch and set(flat) <= members[name]
        union[name] += flat
    for name in kept:
        assert len(union[name]) == len(set(union[name])) == len(members[name]) // (world * batch) * world * batch
    # the buckets are interleaved, not served one after another
    order = [loaders[0].bucket_at(0, s).name for s in range(steps)]
    assert sum(a != b for a, b in zip(order, order[1:], strict=False)) > len(kept)
    # real batches: each rank's batch has its bucket's shape and exactly its samples
    ids = ids_by_index(bucketed)
    for loader in loaders:
        for step in range(4):
            got = next(loader)
            assert tuple(got["latents"].shape[1:]) == SHAPES[order[step]]
            assert sample_ids(got) == [ids[g] for g in loader.indices(0, step)]


def test_order_is_a_function_of_seed_and_epoch(bucketed: Path):
    def order(seed: int, epoch: int) -> list[tuple[str, tuple[int, ...]]]:
        loader = FeatureLoader(bucketed, batch_size=4, seed=seed, prefetch=0)
        return [(loader.bucket_at(epoch, s).name, tuple(loader.indices(epoch, s)))
                for s in range(loader.steps_per_epoch)]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)


def test_small_bucket_dropped_with_one_warning(bucketed: Path, caplog):
    with caplog.at_level(logging.WARNING, logger="training.data.loader"):
        loader = FeatureLoader(bucketed, batch_size=8, prefetch=0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "4.0" in lines[0] and "not trained on" in lines[0], lines
    assert [b.name for b in loader.dropped_buckets] == ["4.0"]
    assert all(loader.bucket_at(e, s).name != "4.0" for e in range(3) for s in range(loader.steps_per_epoch))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training.data.loader"):
        FeatureLoader(bucketed, batch_size=4, rank=1, world_size=2, prefetch=0)  # not rank 0: silent
    assert not caplog.records


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_is_exact_across_bucket_switches_and_epochs(bucketed: Path, prefetch: int):
    with FeatureLoader(bucketed, batch_size=4, seed=3, prefetch=prefetch) as straight:
        spe = straight.steps_per_epoch
        expected = [next(straight) for _ in range(spe + 5)]
        expected = [{k: v.clone() for k, v in b.items()} for b in expected]
    cut = spe - 3  # resume 3 steps before the epoch ends: the next epoch's plan follows
    with FeatureLoader(bucketed, batch_size=4, seed=3, prefetch=prefetch) as first:
        for _ in range(cut):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    with FeatureLoader(bucketed, batch_size=4, seed=3, prefetch=prefetch) as resumed:
        resumed.load_state_dict(state)
        for want in expected[cut:]:
            got = next(resumed)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_grad_accumulation_micro_batches_share_a_bucket(bucketed: Path):
    loader = FeatureLoader(bucketed, batch_size=2, seed=0, prefetch=0, bucket_run=3)
    names = [loader.bucket_at(0, s).name for s in range(loader.steps_per_epoch)]
    assert loader.steps_per_epoch % 3 == 0
    assert all(len(set(names[i:i + 3])) == 1 for i in range(0, len(names), 3))
    assert len(set(names)) == 3


def test_fixed_order_for_precompile_visits_every_bucket(bucketed: Path):
    loader = FeatureLoader(bucketed, batch_size=4, prefetch=0, fixed_bucket_steps=2)
    names = [loader.bucket_at(0, s).name for s in range(loader.steps_per_epoch)]
    assert names == ["0.5", "0.5", "1.0", "1.0", "2.0", "2.0"]  # 4.0 (< one batch) is not trained on

    from training.config import load_config
    from training.trainium import apply_precompile

    cfg = load_config(["--config", str(Path(__file__).resolve().parents[3] / "training/configs/tiny-cpu.yaml"),
                       "--set", f"data.path={bucketed}", "--set", "data.batch_size=4"])
    apply_precompile(cfg, world_size=2)  # global batch 8: the 4.0 bucket is dropped
    assert cfg.max_steps == 3 * cfg.trainium.precompile_steps and cfg.data.fixed_bucket_steps == 3


def test_buffer_pool_stays_bounded_and_kept_batches_stay_intact(bucketed: Path):
    ids = ids_by_index(bucketed)
    with FeatureLoader(bucketed, batch_size=4, seed=1, prefetch=2) as loader:
        kept, shapes = [], set()
        for step in range(40):
            batch = next(loader)
            shapes.add(tuple(batch["latents"].shape))
            kept = [*kept[-2:], ([ids[g] for g in loader.indices(*divmod(step, loader.steps_per_epoch))], batch)]
        pool = loader._reader._pool
        assert len(shapes) == 3 and len(pool.items) <= pool.capacity == 6
        for want, batch in kept:  # the consumer's last batches were not overwritten by later buckets
            assert sample_ids(batch) == want


def test_pin_memory_is_a_no_op_without_cuda(bucketed: Path):
    with FeatureLoader(bucketed, batch_size=4, prefetch=0, pin_memory=True) as loader:
        batch = next(loader)
    assert batch["text"].is_pinned() == torch.cuda.is_available()


def test_square_mode_keeps_the_pre_bucket_order(tmp_path: Path):
    """One bucket: the epoch permutation is still randperm(n) seeded by seed*1_000_003 + epoch,
    so runs and checkpoints from before buckets resume in the same order."""
    write_synthetic_features(tmp_path, num_samples=30, latent_shape=(4, 8, 8), **SMALL)
    loader = FeatureLoader(tmp_path, batch_size=4, seed=7, prefetch=0)
    for epoch in (0, 3):
        old = torch.randperm(30, generator=torch.Generator().manual_seed(7 * 1_000_003 + epoch))
        assert torch.equal(loader.permutation(epoch), old)
        assert loader.indices(epoch, 2) == old[8:12].tolist()


def test_plan_does_not_depend_on_the_rank():
    members = [torch.arange(0, 40), torch.arange(40, 70)]
    a = plan_epoch(members, global_batch=8, seed=1, epoch=2)
    b = plan_epoch(members, global_batch=8, seed=1, epoch=2)
    assert a.order == b.order and all(torch.equal(x, y) for x, y in zip(a.perms, b.perms, strict=True))
    assert sorted(a.order) == [0] * 5 + [1] * 3


# ---------------------------------------------------------------------------- real ranks
def _rank_worker(rank: int, world: int, init: str, features: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        with FeatureLoader(features, batch_size=3, rank=rank, world_size=world, seed=4, prefetch=2) as loader:
            mine = []
            for _ in range(loader.steps_per_epoch):
                batch = next(loader)
                mine.append((list(batch["latents"].shape[1:]), sample_ids(batch)))  # sample numbers
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_the_same_bucket_each_step_on_disjoint_samples(bucketed: Path, tmp_path: Path,
                                                                           monkeypatch):
    import torch.multiprocessing as mp

    out = tmp_path / "gathered.json"
    # The spawned ranks inherit it; monkeypatch takes it back (left set, it told every later
    # GpuBackend in this process to keep torch's default thread count: test_lora's resume).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.spawn(_rank_worker, args=(2, f"file://{tmp_path / 'store'}", str(bucketed), str(out)), nprocs=2)
    rank0, rank1 = json.loads(out.read_text())
    ids = ids_by_index(bucketed)
    members = {n: {ids[g] for g in m.tolist()} for n, m in FeatureIndex.load(bucketed).bucket_members().items()}
    by_shape = {tuple(s): n for n, s in SHAPES.items()}
    assert len(rank0) == len(rank1) > 0
    seen: list[int] = []
    for (shape0, ids0), (shape1, ids1) in zip(rank0, rank1, strict=True):
        assert shape0 == shape1
        assert not set(ids0) & set(ids1) and set(ids0 + ids1) <= members[by_shape[tuple(shape0)]]
        seen += ids0 + ids1
    kept = [n for n in SHAPES if len(members[n]) >= 6]
    assert len(seen) == len(set(seen)) == sum(len(members[n]) // 6 * 6 for n in kept)


# ---------------------------------------------------------------------------- training
def _train_cfg(features: Path, out: Path, max_steps: int, resume: str):
    return config_from_dict({
        "model": {"preset": "tiny"},
        "data": {"path": str(features), "batch_size": 2, "prefetch": 1},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "constant", "grad_accum_steps": 2},
        "ema": {"decay": 0.9},
        "objective": {"caption_dropout": 0.3},
        "checkpoint": {"every_steps": 4, "keep_last": 2, "resume": resume},
        "precision": "fp32", "max_steps": max_steps, "output_dir": str(out), "log_every": 2, "tensorboard": False,
    })


@pytest.mark.cpu_stress
def test_training_on_buckets_resumes_bit_identically(tmp_path: Path, monkeypatch):
    features = tmp_path / "features"
    write_synthetic_features(features, num_samples=48, buckets={"0.75": (4, 6, 8), "1.0": (4, 8, 8)},
                             samples_per_shard=16, seed=2, **SMALL)
    torch.set_num_threads(1)
    straight = train_on_cpu(_train_cfg(features, tmp_path / "a", 10, "none"))
    train_on_cpu(_train_cfg(features, tmp_path / "b", 4, "none"))
    resumed = train_on_cpu(_train_cfg(features, tmp_path / "b", 10, "auto"))
    assert resumed.steps == 6  # steps 5..10, after the checkpoint at step 4
    want, got = straight.model.state_dict(), resumed.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_index_whose_bucket_counts_disagree_with_the_shards_is_refused(bucketed: Path, tmp_path: Path):
    import shutil

    from training.errors import UserError

    copy = tmp_path / "copy"
    shutil.copytree(bucketed, copy)
    raw = json.loads((copy / "index.json").read_text())
    raw["buckets"]["1.0"]["samples"] += 1
    (copy / "index.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="not a valid feature index .*bucket '1.0'"):
        FeatureIndex.load(copy)
    raw["buckets"]["1.0"]["samples"] -= 1
    raw["shards"][0]["buckets"][0][1] += 1
    (copy / "index.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="bucket runs cover"):
        FeatureIndex.load(copy)


#: NVlabs Sana diffusion/data/datasets/utils.py, the training tables its configs name in
#: ``model.aspect_ratio_type`` (configs/sana_config/512ms/Sana_600M_img512.yaml: ASPECT_RATIO_512,
#: 1024ms/*: ASPECT_RATIO_1024, 2048ms/*: ASPECT_RATIO_2048), transcribed entry for entry.
SANA_ASPECT_RATIO_512 = {
    "0.25": [256.0, 1024.0], "0.26": [256.0, 992.0], "0.27": [256.0, 960.0], "0.28": [256.0, 928.0],
    "0.32": [288.0, 896.0], "0.33": [288.0, 864.0], "0.35": [288.0, 832.0], "0.4": [320.0, 800.0],
    "0.42": [320.0, 768.0], "0.48": [352.0, 736.0], "0.5": [352.0, 704.0], "0.52": [352.0, 672.0],
    "0.57": [384.0, 672.0], "0.6": [384.0, 640.0], "0.68": [416.0, 608.0], "0.72": [416.0, 576.0],
    "0.78": [448.0, 576.0], "0.82": [448.0, 544.0], "0.88": [480.0, 544.0], "0.94": [480.0, 512.0],
    "1.0": [512.0, 512.0], "1.07": [512.0, 480.0], "1.13": [544.0, 480.0], "1.21": [544.0, 448.0],
    "1.29": [576.0, 448.0], "1.38": [576.0, 416.0], "1.46": [608.0, 416.0], "1.67": [640.0, 384.0],
    "1.75": [672.0, 384.0], "2.0": [704.0, 352.0], "2.09": [736.0, 352.0], "2.4": [768.0, 320.0],
    "2.5": [800.0, 320.0], "2.89": [832.0, 288.0], "3.0": [864.0, 288.0], "3.11": [896.0, 288.0],
    "3.62": [928.0, 256.0], "3.75": [960.0, 256.0], "3.88": [992.0, 256.0], "4.0": [1024.0, 256.0],
}
SANA_ASPECT_RATIO_1024 = {
    "0.25": [512.0, 2048.0], "0.26": [512.0, 1984.0], "0.27": [512.0, 1920.0], "0.28": [512.0, 1856.0],
    "0.32": [576.0, 1792.0], "0.33": [576.0, 1728.0], "0.35": [576.0, 1664.0], "0.4": [640.0, 1600.0],
    "0.42": [640.0, 1536.0], "0.48": [704.0, 1472.0], "0.5": [704.0, 1408.0], "0.52": [704.0, 1344.0],
    "0.57": [768.0, 1344.0], "0.6": [768.0, 1280.0], "0.68": [832.0, 1216.0], "0.72": [832.0, 1152.0],
    "0.78": [896.0, 1152.0], "0.82": [896.0, 1088.0], "0.88": [960.0, 1088.0], "0.94": [960.0, 1024.0],
    "1.0": [1024.0, 1024.0], "1.07": [1024.0, 960.0], "1.13": [1088.0, 960.0], "1.21": [1088.0, 896.0],
    "1.29": [1152.0, 896.0], "1.38": [1152.0, 832.0], "1.46": [1216.0, 832.0], "1.67": [1280.0, 768.0],
    "1.75": [1344.0, 768.0], "2.0": [1408.0, 704.0], "2.09": [1472.0, 704.0], "2.4": [1536.0, 640.0],
    "2.5": [1600.0, 640.0], "2.89": [1664.0, 576.0], "3.0": [1728.0, 576.0], "3.11": [1792.0, 576.0],
    "3.62": [1856.0, 512.0], "3.75": [1920.0, 512.0], "3.88": [1984.0, 512.0], "4.0": [2048.0, 512.0],
}
SANA_ASPECT_RATIO_2048 = {
    "0.25": [1024.0, 4096.0], "0.26": [1024.0, 3968.0], "0.27": [1024.0, 3840.0], "0.28": [1024.0, 3712.0],
    "0.32": [1152.0, 3584.0], "0.33": [1152.0, 3456.0], "0.35": [1152.0, 3328.0], "0.4": [1280.0, 3200.0],
    "0.42": [1280.0, 3072.0], "0.48": [1408.0, 2944.0], "0.5": [1408.0, 2816.0], "0.52": [1408.0, 2688.0],
    "0.57": [1536.0, 2688.0], "0.6": [1536.0, 2560.0], "0.68": [1664.0, 2432.0], "0.72": [1664.0, 2304.0],
    "0.78": [1792.0, 2304.0], "0.82": [1792.0, 2176.0], "0.88": [1920.0, 2176.0], "0.94": [1920.0, 2048.0],
    "1.0": [2048.0, 2048.0], "1.07": [2048.0, 1920.0], "1.13": [2176.0, 1920.0], "1.21": [2176.0, 1792.0],
    "1.29": [2304.0, 1792.0], "1.38": [2304.0, 1664.0], "1.46": [2432.0, 1664.0], "1.67": [2560.0, 1536.0],
    "1.75": [2688.0, 1536.0], "2.0": [2816.0, 1408.0], "2.09": [2944.0, 1408.0], "2.4": [3072.0, 1280.0],
    "2.5": [3200.0, 1280.0], "2.89": [3328.0, 1152.0], "3.0": [3456.0, 1152.0], "3.11": [3584.0, 1152.0],
    "3.62": [3712.0, 1024.0], "3.75": [3840.0, 1024.0], "3.88": [3968.0, 1024.0], "4.0": [4096.0, 1024.0],
}
SANA_TABLES = {"512": SANA_ASPECT_RATIO_512, "1024": SANA_ASPECT_RATIO_1024, "2048": SANA_ASPECT_RATIO_2048}


@pytest.mark.parametrize("table", ["512", "1024", "2048"])
def test_training_tables_are_sanas_40_entry_tables(table: str):
    from training.data.buckets import aspect_ratio_table

    ours = aspect_ratio_table(table)
    assert len(ours) == 40 and list(ours) == list(SANA_TABLES[table])  # same keys, same order
    assert ours == {k: (int(h), int(w)) for k, (h, w) in SANA_TABLES[table].items()}
    for missing_at_inference in ("0.26", "0.27", "2.89", "3.11", "3.62", "3.75", "3.88"):
        assert missing_at_inference in ours


def sana_get_closest_ratio(height: float, width: float, ratios: dict) -> str:
    """NVlabs Sana diffusion/data/transforms.py ``get_closest_ratio``: the key nearest h/w."""
    aspect_ratio = height / width
    return min(ratios.keys(), key=lambda ratio: abs(float(ratio) - aspect_ratio))


@pytest.mark.parametrize("table", ["512", "1024", "2048"])
def test_images_go_to_sanas_training_bucket_and_every_inference_bin_is_trained(table: str):
    """An image of h x w trains in the bucket Sana's get_closest_ratio picks from its 40-entry
    table, and every size SanaPipeline snaps a request to (diffusers' *_BIN tables: 33 entries at
    512 and 1024, all 40 at 2048; PixArtImageProcessor.classify_height_width_bin) is one of
    those training buckets."""
    from diffusers.image_processor import PixArtImageProcessor
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import (
        ASPECT_RATIO_512_BIN,
        ASPECT_RATIO_1024_BIN,
    )
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN

    from training.data.buckets import aspect_ratio_table, nearest_bucket

    ours = aspect_ratio_table(table)
    bins = {"512": ASPECT_RATIO_512_BIN, "1024": ASPECT_RATIO_1024_BIN, "2048": ASPECT_RATIO_2048_BIN}[table]
    assert len(bins) == (40 if table == "2048" else 33) and set(bins) <= set(ours)
    trained = set(ours.values())
    for h in range(64, 4097, 61):
        for w in (100, 333, 512, 777, 1024, 2000, 4096):
            assert nearest_bucket(h, w, ours) == sana_get_closest_ratio(h, w, SANA_TABLES[table])
            assert PixArtImageProcessor.classify_height_width_bin(h, w, bins) in trained


def test_resize_is_sanas_cover_then_crop_with_its_filter():
    """sana_data_multi_scale.py getdata: scale by the larger factor, ``int()`` the other side;
    BICUBIC, LANCZOS for the 2048 table (``interpolate_model``)."""
    from training.data.buckets import cover_resize, resample_filter

    for (h, w), target in [((1000, 777), (544, 448)), ((333, 1000), (256, 992)), ((4096, 100), (1024, 256))]:
        th, tw = target
        want = (th, int(w * th / h)) if th / h > tw / w else (int(h * tw / w), tw)
        assert cover_resize(h, w, target) == want and want[0] >= th and want[1] >= tw
    assert [resample_filter(t) for t in ("512", "1024", "2048", "square")] == ["BICUBIC", "BICUBIC", "LANCZOS",
                                                                             "BICUBIC"]
