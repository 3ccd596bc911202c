"""LoRA under real data parallelism on CPU (gloo, torchrun): DDP and FSDP2 with 2 ranks.

As in test_gpu_distributed.py, 2 ranks x batch 2 must end where 1 process x batch 4 ends
(same global batch and noise; only the all-reduce summation order differs). Here only the
adapters train: FSDP2's ``fully_shard`` units hold frozen base weights and trainable adapters
together (https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html: parameters
with and without requires_grad may share a unit), and DDP reduces only the adapter grads.
"""

from __future__ import annotations

import pytest
import torch

from tests.training.backends.test_gpu_distributed import launch
from training.data.shards import write_synthetic_features
from training.model.build import ModelConfig, build_model
from training.model.lora import is_adapter_key

LORA = ("--set", "lora.rank=2", "--set", "lora.alpha=4")
ATOL = 2e-6


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-dist")
    write_synthetic_features(
        tmp / "features",
        num_samples=32,
        latent_shape=(4, 8, 8),
        text_dim=8,
        max_text_tokens=8,
        samples_per_shard=16,
    )
    return tmp, launch(tmp, "single", 1, 4, *LORA)[0]


def check(ranks: list[dict], ref: dict) -> None:
    rank0 = ranks[0]
    torch.manual_seed(0)
    init = build_model(ModelConfig(preset="tiny")).state_dict()
    adapters = [k for k in ref["full"] if is_adapter_key(k)]
    assert adapters
    for key in adapters:
        assert ref["full"][key].abs().max() > 0 or ".lora_A." in key, key  # B moved off zero
        diff = (rank0["full"][key].float() - ref["full"][key].float()).abs().max().item()
        assert diff <= ATOL, (key, diff)
    for key, value in rank0["full"].items():  # frozen: bit-identical to the seeded init
        if not is_adapter_key(key):
            assert torch.equal(value, init[key.replace(".base_layer.", ".")]), key
    # each rank logs the loss of its half of the global batch
    assert sum(r["loss"] for r in ranks) / len(ranks) == pytest.approx(ref["loss"], rel=1e-4)


@pytest.mark.slow
def test_ddp_lora_matches_one_process(single):
    tmp, ref = single
    ranks = launch(tmp, "ddp", 2, 2, *LORA)
    check(ranks, ref)


@pytest.mark.slow
def test_fsdp_lora_matches_one_process(single):
    tmp, ref = single
    ranks = launch(tmp, "fsdp", 2, 2, *LORA, "--set", "gpu.distributed=fsdp")
    assert ranks[0]["describe"]["distributed"] == "fsdp"
    check(ranks, ref)
