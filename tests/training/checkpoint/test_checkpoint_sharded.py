"""Sharded checkpoints (sana-checkpoint/2): shard logic N -> M in one process, the data
position across world sizes, frozen parameters, and real gloo jobs: ranks SIGKILLed inside a
sharded save resume bit-identically; a DDP checkpoint loads exactly under FSDP2 on another
world size and back.

Run as a script (``--worker``) it is the torchrun worker of the resharding tests: restore a
checkpoint under this job's world size and wrapping, dump the full state it now holds, and
save it again (sharded, this world size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training.checkpoint.consolidate import load_full
from training.checkpoint.layout import FAULT_ENV, MANIFEST, find_latest, step_dir_name
from training.checkpoint.sharded import Stager
from training.checkpoint.shards import ShardReader, write_shard
from training.checkpoint.train_state import map_data_position
from training.errors import UserError
from training.optim.sharding import chunk_rows, local_piece, placement_problem, sharded_state

REPO = Path(__file__).resolve().parents[3]


# ----- shard logic, one process -----------------------------------------------------------
def _write_as_ranks(tmp: Path, tensors: dict[str, torch.Tensor], world: int) -> list[Path]:
    """Shard files exactly as ``world`` DDP ranks write them (each its chunk_rows)."""
    files = []
    for rank in range(world):
        pieces = {k: p for k, t in tensors.items() if (p := local_piece(t, rank, world)) is not None}
        files.append(tmp / f"shard-rank-{rank:05d}.safetensors")
        write_shard(files[-1], Stager().stage(pieces))
    return files


@pytest.mark.parametrize(("n", "m"), [(1, 3), (4, 2), (3, 5)])
def test_rows_written_by_n_ranks_read_back_by_m_ranks_exactly(tmp_path, n, m):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 3, generator=gen), "b": torch.randn(2, generator=gen),
               "step": torch.tensor(5.0), "c": torch.randn(11, 2, 2, generator=gen).to(torch.bfloat16),
               "empty": torch.zeros(0, 4)}
    with ShardReader(_write_as_ranks(tmp_path, tensors, n)) as reader:
        assert reader.keys() == set(tensors)
        for key, full in tensors.items():
            assert torch.equal(reader(key), full), key  # consolidated
            if full.dim() == 0:
                continue
            got = [reader(key, *chunk_rows(full.shape[0], r, m)) for r in range(m)]
            assert torch.equal(torch.cat(got), full) and got[0].dtype == full.dtype, key
            assert all(g.shape[0] == len(c) for g, c in zip(got, full.chunk(m) + (full[:0],) * m, strict=False))


def test_zero1_shard_rows_are_chunk_rows_of_the_padded_tensor():
    """torch_xla ZeroRedundancyOptimizer._shard_tensor pads dim 0 to a multiple of the world
    size (F.pad) and takes ``chunk(world)[rank]``: its real rows are ``chunk_rows``."""
    for n in (1, 5, 8, 13):
        for world in (1, 2, 3, 4, 32):
            t = torch.arange(n * 2.0).reshape(n, 2)
            pad = (-n) % world
            shards = F.pad(t, [0, 0, 0, pad]).chunk(world)
            for rank in range(world):
                start, stop = chunk_rows(n, rank, world)
                assert torch.equal(shards[rank][: stop - start], t[start:stop])
                assert not shards[rank][stop - start:].any()  # the rest is padding


def _zero1_rank(full: dict[str, dict[str, torch.Tensor]], params: dict[str, torch.Tensor], rank: int, world: int):
    """(pairs, base optimizer state) of ZeRO-1 rank ``rank``: shards cut as torch_xla's
    ``_shard_tensor`` cuts them (F.pad dim 0 to a multiple of world, ``chunk(world)[rank]``)."""
    def shard(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, [0, 0] * (t.dim() - 1) + [0, (-t.shape[0]) % world]).chunk(world)[rank].clone()

    from training.optim.came import REPLICATED_STATE

    pairs = [(name, p, shard(p)) for name, p in params.items()]
    # CAME's column statistics are whole on every rank (training/optim/came.py); the rest is rows
    state = {s: {k: (shard(v) if v.dim() and k not in REPLICATED_STATE else v.clone()) for k, v in full[name].items()}
             for name, _, s in pairs}
    return pairs, state


def _full_state(p: torch.Tensor, optimizer: str) -> dict[str, torch.Tensor]:
    """An optimizer's state for ``p`` as the portable format holds it (full tensors)."""
    if optimizer == "adamw" or p.dim() == 1:
        return {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
    rows, cols = p.shape
    return {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p), "exp_avg_sq_row": torch.rand(rows),
            "exp_avg_sq_col": torch.rand(cols), "exp_avg_res_row": torch.rand(rows), "exp_avg_res_col": torch.rand(cols)}


@pytest.mark.parametrize("optimizer", ["adamw", "came"])
@pytest.mark.parametrize(("n", "m"), [(3, 2), (2, 5), (1, 4)])
def test_zero1_shards_written_by_n_ranks_load_onto_m_ranks_exactly(tmp_path, n, m, optimizer):
    """The ZeRO-1 checkpoint logic in one process (XLA collectives cannot run across
    processes on PJRT CPU): each of n ranks writes only its own shard's moments; m ranks
    each load exactly the padded shard ``_shard_tensor`` would have given them. For CAME the
    row statistics are rows too and the column statistics whole (a 7x3 weight on 3 ranks has
    3-row shards and 3 columns: told apart by name, not by shape)."""
    from training.optim.sharding import zero1_load_sharded_state, zero1_sharded_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 2))
    params = dict(model.named_parameters())
    full = {name: _full_state(p, optimizer) for name, p in params.items()}
    groups = [{"lr": 0.1, "params": list(model.parameters())}]
    files = []
    for rank in range(n):
        pairs, state = _zero1_rank(full, params, rank, n)
        st = zero1_sharded_state(pairs, state, model, groups, rank, n, master_weights=False)
        assert all(not k.startswith("optim/") or p.lo is None or p.src.data_ptr() in
                   {v.data_ptr() for e in state.values() for v in e.values()} for k, p in st.pieces.items())
        files.append(tmp_path / f"shard-rank-{rank:05d}.safetensors")
        write_shard(files[-1], Stager().stage(st.pieces))
    with ShardReader(files) as reader:
        for name, p in params.items():
            assert torch.equal(reader(f"model/{name}"), p.detach())
            for key, value in full[name].items():
                assert torch.equal(reader(f"optim/{name}/{key}"), value), (name, key)  # consolidated
        for rank in range(m):
            want_pairs, want_state = _zero1_rank(full, params, rank, m)
            got_pairs = [(name, p, torch.full_like(s, float("nan"))) for name, p, s in want_pairs]
            got_state: dict = {}
            zero1_load_sharded_state(got_pairs, got_state, model, reader, rank, m, keys=reader.keys(), values={},
                                     device=torch.device("cpu"))
            for (name, _, want), (_, _, got) in zip(want_pairs, got_pairs, strict=True):
                assert torch.equal(got, want), name  # master shard = the weights' rows + padding
                for key, value in want_state[want].items():
                    assert torch.equal(got_state[got][key], value), (rank, name, key)


def test_ranks_write_disjoint_rows_that_cover_every_tensor():
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    world = 4
    states = [sharded_state(model, opt, r, world) for r in range(world)]
    for key in set().union(*(s.pieces for s in states)):
        owners = [s.pieces[key] for s in states if key in s.pieces]
        shape = owners[0].shape
        if not shape:
            assert len(owners) == 1  # a 0-dim value (AdamW's step): rank 0 only
            continue
        rows = sorted((p.row0, p.row0 + p.hi - p.lo) for p in owners)
        assert rows[0][0] == 0 and rows[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False)), key  # no overlap, no gap
    # each rank stages about 1/world of the bytes, not the full state
    sizes = [sum(p.src[p.lo:p.hi].numel() if p.lo is not None else 1 for p in s.pieces.values()) for s in states]
    total = sum(p.numel() for p in model.parameters()) * 3
    assert max(sizes) < total / world + 4 * 16


# ----- placements ---------------------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    """A real 1-rank gloo process group (DTensors need one) for this test only."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _placements():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import Partial, _StridedShard

    return Replicate, Shard, Partial, _StridedShard


def test_placement_check_takes_shard0_and_replicate_only():
    Replicate, Shard, Partial, StridedShard = _placements()
    assert placement_problem((Shard(0),)) is None
    assert placement_problem((Replicate(), Shard(0))) is None  # HSDP
    assert placement_problem((Replicate(), Replicate())) is None
    assert "more than one mesh dim" in placement_problem((Shard(0), Shard(0)))
    for bad in (Shard(1), Partial(), StridedShard(0, split_factor=2)):
        assert "is not Shard(0) or Replicate()" in placement_problem((Replicate(), bad)), bad


@pytest.mark.parametrize("kind", ["Shard(1)", "_StridedShard", "Partial"])
def test_a_layout_the_sharded_format_cannot_store_is_refused_at_start_in_one_line(tmp_path, one_rank_group, kind):
    """A weight laid out as ``kind`` fails at restore, before step 0, in one line naming the
    parameter, its placement and the fix (it used to fail at the first save, hours in, or
    with ``_StridedShard`` under torch 2.9, be written with the wrong rows)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from training.backends.gpu import GpuBackend, GpuConfig
    from training.checkpoint.checkpointer import Checkpointer
    from training.checkpoint.config import CheckpointConfig
    from training.checkpoint.train_state import TrainState

    Replicate, Shard, Partial, StridedShard = _placements()
    placement = {"Shard(1)": Shard(1), "_StridedShard": StridedShard(0, split_factor=2), "Partial": Partial()}[kind]
    mesh = init_device_mesh("cpu", (1,))
    backend = GpuBackend(GpuConfig(), precision="fp32")
    backend.init()

    def model_with(weight_placement) -> nn.Module:
        model = nn.Linear(6, 4)
        model.weight = nn.Parameter(DTensor.from_local(torch.randn(4, 6), mesh, [weight_placement]))
        model.bias = nn.Parameter(DTensor.from_local(torch.randn(4), mesh, [Shard(0)]))
        return model

    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "c")), backend, output_dir=tmp_path)
    model = model_with(placement)
    with pytest.raises(UserError) as err:
        ckpt.restore(model=model, optimizer=torch.optim.AdamW(model.parameters()), state=TrainState())
    message = str(err.value)
    assert "\n" not in message and message.startswith("checkpoint.format: ")
    assert f"weight: placement {placement!r} is not Shard(0) or Replicate()" in message
    assert "checkpoint.format=full" in message
    good = model_with(Shard(0))  # FSDP2's layout passes
    assert ckpt.restore(model=good, optimizer=torch.optim.AdamW(good.parameters()), state=TrainState()) is None
    ckpt.close()


# ----- data position ------------------------------------------------------------------------
def _loaders(features: Path, world: int, batch: int):
    from training.data.loader import FeatureLoader

    return [FeatureLoader(features, batch_size=batch, rank=r, world_size=world, seed=3, prefetch=0)
            for r in range(world)]


def test_data_position_maps_to_a_new_world_size_without_skipping_or_repeating(tmp_path):
    from training.data.shards import write_synthetic_features

    write_synthetic_features(tmp_path, num_samples=40, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8,
                             text_tokens=(1, 8))
    old = _loaders(tmp_path, world=2, batch=2)  # global batch 4
    seen = []
    for _ in range(4):  # 16 samples
        for loader in old:
            seen += loader.indices(loader.epoch, loader.step)
            next(loader)
    saved = old[0].state_dict()
    new = _loaders(tmp_path, world=4, batch=2)  # global batch 8: 16 = 2 steps of it
    for loader in new:
        loader.load_state_dict(map_data_position(saved, loader.state_dict()))
    while new[0].epoch == 0:
        for loader in new:
            seen += loader.indices(loader.epoch, loader.step)
            next(loader)
    perm = old[0].permutation(0).tolist()
    assert seen == perm[:len(seen)] and len(set(seen)) == len(seen) == 40  # every sample once, in order
    # 3 steps of 4 = 12 samples: not a whole number of steps of 8 -> refused, naming both batch sizes
    with pytest.raises(UserError, match=r"checkpoint.resume: .*12 samples.*global batch 4.*new global batch 8"):
        map_data_position({**saved, "step": 3}, new[0].state_dict())


# ----- frozen parameters --------------------------------------------------------------------
def test_frozen_parameters_are_not_saved_and_restore_is_strict_on_the_trainable_set(tmp_path):
    from training.backends.gpu import GpuBackend, GpuConfig
    from training.checkpoint.checkpointer import Checkpointer
    from training.checkpoint.config import CheckpointConfig
    from training.checkpoint.train_state import TrainState
    from training.optim.ema import EMA, EmaConfig

    def build(frozen: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        for p in getattr(model, frozen).parameters():
            p.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
        return model, opt, EMA(model, EmaConfig(decay=0.5))

    backend = GpuBackend(GpuConfig(), precision="fp32")
    backend.init()
    model, opt, ema = build("0")
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ema.update(model, 1)
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"), every_steps=0), backend, output_dir=tmp_path,
                        frozen_from="s3://models/base")
    path = ckpt.save(step=1, model=model, optimizer=opt, ema=ema, state=TrainState(step=1))
    ckpt.close()
    full = load_full(path)
    assert set(full["model"]) == {"1.weight", "1.bias"} == set(full["ema"]) == set(full["optimizer"]["state"])
    assert json.loads((path / MANIFEST).read_text())["frozen_from"] == "s3://models/base"

    model2, opt2, ema2 = build("0")
    with torch.no_grad():
        model2[1].weight.zero_()
    ckpt = Checkpointer(CheckpointConfig(dir=str(tmp_path / "c"), resume="auto"), backend, output_dir=tmp_path)
    assert ckpt.restore(model=model2, optimizer=opt2, ema=ema2, state=TrainState()) == path
    assert torch.equal(model2[1].weight, model[1].weight)
    assert torch.equal(opt2.state[model2[1].weight]["exp_avg"], opt.state[model[1].weight]["exp_avg"])
    assert torch.equal(ema2.shadow["1.bias"], ema.shadow["1.bias"])
    # another trainable set (layer 1 frozen, layer 0 trained) does not match: one clear line
    model3, opt3, ema3 = build("1")
    with pytest.raises(UserError, match=r"checkpoint.resume: .*does not match this model"):
        ckpt.restore(model=model3, optimizer=opt3, ema=None, state=TrainState())
    backend.close()


# ----- real gloo jobs -------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def _train_args(features: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO / "training/configs/tiny-cpu.yaml"), "--set", f"data.path={features}",
            "--set", "checkpoint.every_steps=4", "--set", "checkpoint.keep_last=0", "--set", "ema.decay=0.9",
            "--set", "tensorboard=false", "--set", "data.prefetch=1", "--set", "data.batch_size=2",
            "--set", "objective.caption_dropout=0.3", "--max-steps", "8", "--output-dir", str(out), *extra]


def _torchrun(nproc: int, args: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(**extra_env), capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Path:
    from training.data.shards import write_synthetic_features

    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(out, num_samples=32, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8,
                             text_tokens=(1, 8))
    return out


def _assert_states_equal(got: dict, want: dict) -> None:
    for part in ("model", "ema"):
        assert got[part].keys() == want[part].keys(), part
        for key in want[part]:
            assert torch.equal(got[part][key], want[part][key]), f"{part}: {key} differs"
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    for name, entry in want["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][name][key]), torch.as_tensor(value)), \
                f"optimizer {name}.{key} differs"


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "wrap", "fault", "left"), [
    # rank 1 dies with its shard written; rank 0's done record is there, rank 1's is not
    (2, "ddp", "8:after-shard:1", {"rank-00000.done.json", "shard-rank-00001.safetensors"}),
    # rank 2 dies before its done record; ranks 0, 1, 3 finish or are stopped by torchrun.
    # FSDP2, not DDP: DDP rebuilds its gradient buckets after the first backward of every
    # process (torch/csrc/distributed/c10d/reducer.cpp, Reducer::rebuild_buckets), so the first
    # step after a resume all-reduces with another bucket layout; with more than 2 ranks a ring
    # all-reduce then adds some elements in another order (not bit-identical; 2 ranks commute).
    (4, "fsdp", "8:after-shard:2", {"shard-rank-00002.safetensors"}),
])
def test_ranks_killed_mid_sharded_save_resume_bit_identical(features, tmp_path, nproc, wrap, fault, left):
    def args(out: Path) -> list[str]:
        return ["-m", "training.gpu", *_train_args(features, out, "--set", f"gpu.distributed={wrap}")]

    ref = _torchrun(nproc, args(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "run"
    done = _torchrun(nproc, args(out), **{FAULT_ENV: fault})
    assert done.returncode != 0 and "SIGKILL at step 8" in done.stderr, done.stderr[-3000:]
    tmp = out / "checkpoints" / ".tmp-step-00000008"
    assert left <= {p.name for p in tmp.iterdir()} and not (tmp / MANIFEST).exists()
    assert find_latest(out / "checkpoints") == out / "checkpoints" / step_dir_name(4)
    done = _torchrun(nproc, args(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / step_dir_name(4)}" in done.stderr
    _assert_states_equal(load_full(out / "checkpoints" / step_dir_name(8)),
                         load_full(tmp_path / "ref" / "checkpoints" / step_dir_name(8)))
    assert not tmp.exists()


@pytest.mark.slow
@pytest.mark.cpu_stress
def test_ddp_checkpoint_reshards_onto_fsdp2_and_hsdp_with_other_world_sizes_and_back(features, tmp_path,
                                                                                      cpu_stress):
    """2-rank DDP writes step 6 (24 samples: 8 steps of 3 ranks x 1); 3-rank FSDP2 (uneven
    dim-0 chunks) restores it exactly and saves its own shards; 4-rank HSDP (2 x 2) restores
    that and saves again; 1 process (plain) restores the HSDP one exactly. Under CPU
    contention (tests/stress.py): every rank of every hop exits 0 (it once aborted at exit
    with "terminate called without an active exception", training/failure/leave.py)."""
    src = tmp_path / "ddp"
    done = _torchrun(2, ["-m", "training.gpu", *_train_args(features, src, "--max-steps", "6")])
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = src / "checkpoints" / step_dir_name(6)
    want = load_full(ckpt)
    hops = [(3, "fsdp", ckpt, tmp_path / "fsdp3"),
            # HSDP: 2 replicas x 2 shards; the replicas split each shard's rows (state.py local_piece)
            (4, "hsdp", tmp_path / "fsdp3" / step_dir_name(6), tmp_path / "hsdp4"),
            (1, "ddp", tmp_path / "hsdp4" / step_dir_name(6), tmp_path / "one")]
    for nproc, wrap, source, dest in hops:
        dump = dest / "dump.pt"
        args = [str(Path(__file__)), "--worker", str(source), str(dest), str(dump),
                *_train_args(features, tmp_path / f"w-{nproc}", "--set", f"gpu.distributed={wrap}",
                             "--set", "gpu.shard_group_size=2" if wrap == "hsdp" else "gpu.shard_group_size=0",
                             "--set", f"checkpoint.resume={source}", "--set", "data.batch_size=1")]
        done = _torchrun(nproc, args)
        assert done.returncode == 0, done.stderr[-3000:]
        got = torch.load(dump, weights_only=True)
        _assert_states_equal(got, want)  # what the ranks hold after restore, gathered
        assert got["step"] == 6 and got["loader"]["step"] * 1 * nproc == 6 * 2 * 2  # same sample offset
        manifest = json.loads((dest / step_dir_name(6) / MANIFEST).read_text())
        assert manifest["world_size"] == nproc
        _assert_states_equal(load_full(dest / step_dir_name(6)), want)  # what it saved, consolidated
        if wrap == "hsdp":
            # Both replicas write: ranks 2 and 3 (replica 1) about half of the bytes, not none.
            sizes = [_tensor_bytes(dest / step_dir_name(6) / f"shard-rank-{r:05d}.safetensors") for r in range(4)]
            print("HSDP tensor bytes per rank:", sizes)
            assert min(sizes) > 0.15 * sum(sizes) and sum(sizes[2:]) > 0.35 * sum(sizes), sizes
    assert cpu_stress.busy_seconds() > 10  # the contention was real: the busy processes ran


def _tensor_bytes(shard: Path) -> int:
    """Bytes of tensor data in a shard file (safetensors: the data after the 8-byte header length
    and the JSON header)."""
    import struct

    with open(shard, "rb") as fh:
        header = struct.unpack("<Q", fh.read(8))[0]
    return shard.stat().st_size - 8 - header


@pytest.mark.slow
def test_a_rank_failing_to_create_the_save_dir_fails_the_job_in_seconds_with_its_error(features, tmp_path):
    """torchrun, 2 ranks: rank 1 cannot create the checkpoint's temp dir (ENOSPC at the save of
    step 4). Its failure record reaches rank 0's commit at the next poll and both ranks exit
    non-zero with rank 1's error, instead of rank 0 waiting 30 minutes for a done record."""
    t0 = time.monotonic()
    done = _torchrun(2, ["-m", "training.gpu", *_train_args(features, tmp_path / "run", "--max-steps", "4")],
                     **{FAULT_ENV: "4:mkdir:1:enospc"})
    elapsed = time.monotonic() - t0
    assert done.returncode != 0, done.stderr[-3000:]
    assert "failed: rank 1: No space left on device" in done.stderr, done.stderr[-3000:]
    assert elapsed < 120, elapsed  # training and start-up included; the wait itself is one poll
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))  # discarded, record included


def _worker(argv: list[str]) -> None:
    """Restore ``source`` under this torchrun job, dump the full state, save it to ``dest``."""
    from training.backends.gpu import GpuBackend
    from training.checkpoint.checkpointer import Checkpointer
    from training.checkpoint.config import CheckpointConfig
    from training.checkpoint.train_state import TrainState
    from training.config import load_config
    from training.data.loader import FeatureLoader
    from training.model.build import build_model
    from training.optim.ema import EMA
    from training.optim.factory import build_scheduler, optimizer_factory

    _source, dest, dump = argv[:3]
    cfg = load_config(argv[3:])
    backend = GpuBackend(cfg.gpu, precision=cfg.precision)
    backend.init()
    try:
        loader = FeatureLoader.from_config(cfg.data, rank=backend.rank, world_size=backend.world_size)
        model = backend.prepare_model(build_model(cfg.model))
        inner = backend.unwrap(model)
        optimizer = backend.build_optimizer(model, optimizer_factory(cfg.optim, inner))
        scheduler = build_scheduler(optimizer, cfg.optim, max_steps=cfg.max_steps)
        ema = EMA(inner, cfg.ema)
        state = TrainState()
        ckpt = Checkpointer(cfg.checkpoint, backend, output_dir=cfg.output_dir)
        ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler, ema=ema, loader=loader, state=state)
        full = {"model": backend.model_state_dict(model), "ema": ema.state_dict(),
                "optimizer": backend.optimizer_state_dict(model, optimizer),
                "loader": loader.state_dict(), "step": state.step}
        if backend.is_main:
            Path(dump).parent.mkdir(parents=True, exist_ok=True)
            torch.save(full, dump)
        out = Checkpointer(CheckpointConfig(dir=dest, every_steps=0), backend, output_dir=dest)
        out.save(step=state.step, model=model, optimizer=optimizer, scheduler=scheduler, ema=ema, loader=loader,
                 state=state)
        out.close()
        loader.close()
    finally:
        backend.close()


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(sys.argv[sys.argv.index("--worker") + 1:])
