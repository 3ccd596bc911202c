"""The one-step-ahead input path (training/data/input_pipeline.py): the loader position a checkpoint
saves is "after the last batch the step used" although the loader has been read one batch
further, so a resumed run is bit-identical to an uninterrupted one; captions travel in their
stored dtype and reach the step as fp32 with the same values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_loop import run, tiny_config

from training.backends.gpu import GpuBackend, GpuConfig
from training.checkpoint.layout import step_dir_name
from training.data.input_pipeline import LoaderPosition, cast_text, read_ahead
from training.data.loader import FeatureLoader
from training.data.shards import write_synthetic_features


@pytest.fixture(scope="module")
def features(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("features")
    write_synthetic_features(
        out,
        num_samples=16,
        latent_shape=(4, 8, 8),
        text_dim=8,
        max_text_tokens=6,
        text_tokens=(1, 6),
        samples_per_shard=8,
    )
    return out


def _loader(features: Path) -> FeatureLoader:
    return FeatureLoader(str(features), batch_size=2, seed=0, prefetch=0)


def test_position_is_after_the_last_batch_used_not_the_last_read(features: Path) -> None:
    loader, twin = _loader(features), _loader(features)
    position = LoaderPosition(loader)
    backend = GpuBackend(GpuConfig(device_prefetch="on"), precision="fp32")
    used = position.delivered(backend.device_batches(position.pulled(loader)))
    assert position.state_dict() == twin.state_dict()  # nothing pulled yet
    for k in range(1, 4):
        got = next(used)
        want = next(twin)
        assert position.ahead == 1  # the backend holds the next batch already
        assert loader.state_dict() != twin.state_dict()  # ... so the loader itself is past it
        assert position.state_dict() == twin.state_dict(), k
        for key in want:
            assert torch.equal(got[key], want[key]), (k, key)
    # resuming from the tracked position continues with the batch after the last one used
    resumed = _loader(features)
    LoaderPosition(resumed).load_state_dict(position.state_dict())
    nxt, want = next(used), next(twin)
    assert all(torch.equal(a, b) for a, b in zip(next(resumed).values(), want.values(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(nxt.values(), want.values(), strict=True))


def test_read_ahead_starts_the_next_batch_before_yielding_the_current() -> None:
    events: list[str] = []

    def start(b: int) -> int:
        events.append(f"start {b}")
        return b

    out = []
    for b in read_ahead(iter([1, 2, 3]), start, lambda b: b):
        events.append(f"step {b}")
        out.append(b)
    assert out == [1, 2, 3]
    assert events == ["start 1", "start 2", "step 1", "start 3", "step 2", "step 3"]


def test_bf16_captions_reach_the_step_as_the_same_fp32_values() -> None:
    text = torch.randn(2, 3, 4).bfloat16()
    batch = cast_text({"text": text, "text_mask": torch.ones(2, 3, dtype=torch.int64)}, torch.float32)
    assert batch["text"].dtype == torch.float32 and batch["text_mask"].dtype == torch.int64
    assert torch.equal(batch["text"].bfloat16(), text)


def _final(out: Path, step: int) -> dict:
    """Every tensor a checkpoint holds (whatever its file layout) and its data position."""
    path = out / "checkpoints" / step_dir_name(step)
    tensors = {
        f"{f.name}/{k}": v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()
    }
    for f in sorted(path.glob("*.pt")):
        if not f.name.startswith("rng"):
            tensors.update({f"{f.name}/{k}": v for k, v in _flat(torch.load(f, weights_only=True))})
    return {
        "tensors": tensors,
        "dataloader": json.loads((path / "train_state.json").read_text())["dataloader"],
    }


def _flat(tree, prefix: str = ""):
    if torch.is_tensor(tree):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}/{k}")


@pytest.mark.parametrize("prefetch", ["on"])
def test_resume_with_read_ahead_is_bit_identical(features: Path, tmp_path: Path, prefetch: str) -> None:
    """6 steps straight vs 3 steps, stop, resume to 6: the same weights, optimizer state and
    data position (with the loader read one batch ahead at every checkpoint)."""
    # constant schedule: a cosine one depends on max_steps, which differs between the runs
    over = dict(
        gpu__device_prefetch=prefetch,
        optim__schedule="constant",
        checkpoint__every_steps=3,
        tensorboard=False,
    )
    run(tiny_config(features, tmp_path / "straight", max_steps=6, **over))
    run(tiny_config(features, tmp_path / "split", max_steps=3, **over))
    run(tiny_config(features, tmp_path / "split", max_steps=6, **over))
    want, got = _final(tmp_path / "straight", 6), _final(tmp_path / "split", 6)
    assert got["dataloader"] == want["dataloader"]
    assert got["tensors"].keys() == want["tensors"].keys() and len(want["tensors"]) > 10
    for key, value in want["tensors"].items():
        assert torch.equal(got["tensors"][key], value), f"{key} differs"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy needs CUDA")
def test_side_stream_copies_arrive_intact_on_the_compute_stream(features: Path) -> None:
    """CUDA: batches copied on the side stream one ahead equal the host batches (read after
    the compute stream waited for the copy), captions as fp32 from a bf16 wire."""
    backend = GpuBackend(GpuConfig(), precision="bf16-mixed")
    backend.init()
    loader = _loader(features)
    host = [{**b, "text": b["text"].bfloat16()} for b in (next(loader) for _ in range(3))]
    got = list(backend.device_batches(iter(host)))
    assert len(got) == 3
    for h, d in zip(host, got, strict=True):
        assert d["text"].device.type == "cuda" and d["text"].dtype == torch.float32
        torch.cuda.current_stream().synchronize()
        assert torch.equal(d["text"].cpu(), h["text"].float())
        assert torch.equal(d["latents"].cpu(), h["latents"])


def test_loader_keeps_captions_bf16_on_the_wire_when_asked(features: Path) -> None:
    """data.text_dtype=bf16: host batches carry the stored bf16 captions (half the bytes to pin
    and copy), with exactly the values the fp32 loader gives."""
    with FeatureLoader(str(features), batch_size=2, seed=0, prefetch=0, text_dtype="bf16") as wire, \
            _loader(features) as plain:
        for _ in range(3):
            got, want = next(wire), next(plain)
            assert got["text"].dtype == torch.bfloat16 and want["text"].dtype == torch.float32
            assert torch.equal(got["text"].float(), want["text"])
            assert torch.equal(got["latents"], want["latents"])


def test_training_on_a_bf16_caption_wire_is_bit_identical_to_fp32(features: Path, tmp_path: Path) -> None:
    over = dict(optim__schedule="constant", checkpoint__every_steps=4, tensorboard=False)
    run(tiny_config(features, tmp_path / "fp32", max_steps=4, **over))
    run(tiny_config(features, tmp_path / "bf16", max_steps=4, data__text_dtype="bf16", **over))
    want, got = _final(tmp_path / "fp32", 4), _final(tmp_path / "bf16", 4)
    assert got["tensors"].keys() == want["tensors"].keys() and len(want["tensors"]) > 10
    for key, value in want["tensors"].items():
        assert torch.equal(got["tensors"][key], value), f"{key} differs"
