"""The per-NeuronCore HBM estimate (training/perf/memory.py): numbers, the refusal and its knob,
and where it runs (``bench --dry-run`` and the Trainium entrypoint, before any device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from training.config import load_config
from training.errors import UserError
from training.perf.memory import GIB, check_fits, estimate, measure_activations

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "training/configs"


def cfg_of(name: str, *sets: str):
    argv = ["--config", str(CONFIGS / name)]
    for item in sets:
        argv += ["--set", item]
    return load_config(argv, prog="test")


@pytest.fixture(scope="module")
def act600():
    return measure_activations(cfg_of("trn-sana-600m-512.yaml").model.model_kwargs(), text_tokens=300, bf16=False)


def test_state_bytes_follow_precision_and_zero1(act600) -> None:
    adamw = ("optim.name=adamw", "optim.betas=null", "optim.eps=null")  # AdamW's own defaults
    plain = estimate(cfg_of("trn-sana-600m-512.yaml", *adamw), world_size=32, activations=act600)
    p = plain.parameters
    assert 590e6 < p < 593e6  # sana-600m-512, as tests/training/model/test_model.py counts it
    assert (plain.weights, plain.gradients, plain.optimizer) == (4 * p, 4 * p, 8 * p)  # fp32 masters + AdamW
    zero = estimate(cfg_of("trn-sana-600m-512.yaml", *adamw, "trainium.zero1=true"), world_size=32, activations=act600)
    assert zero.optimizer == 16 * p // 32  # fp32 master + 2 moments + grad shard, over 32 ranks
    bf16 = estimate(cfg_of("trn-sana-600m-512.yaml", *adamw, "precision=bf16"), world_size=32, activations=act600)
    assert (bf16.weights, bf16.optimizer) == (2 * p, 4 * p)


def test_came_state_is_counted_as_came_keeps_it(act600) -> None:
    """The preset's CAME: fp32 state whatever the weights' dtype, exp_avg in full, factored
    second moments (row + column statistics) for the linears and 1x1 convs. The count of
    ``optimizer_state_elements`` is what a real CAME holds after a step."""
    import torch

    from training.model.build import ModelConfig, build_model
    from training.optim.came import CAME
    from training.perf.memory import optimizer_state_elements

    model = build_model(ModelConfig(preset="tiny"))
    opt = CAME(model.parameters())
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    opt.step()
    held = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")
    rows, whole = optimizer_state_elements([tuple(q.shape) for q in model.parameters()], "came")
    assert rows + whole == held and whole == sum(v.numel() for st in opt.state.values()
                                                 for k, v in st.items() if k.endswith("_col"))

    came = estimate(cfg_of("trn-sana-600m-512.yaml"), world_size=32, activations=act600)
    p = came.parameters
    assert 4 * p < came.optimizer < 4.2 * p  # vs AdamW's 8p in bf16-mixed
    rows, whole = optimizer_state_elements([tuple(s) for s in _shapes_of("trn-sana-600m-512.yaml")], "came")
    assert came.optimizer == (rows + whole) * 4
    bf16 = estimate(cfg_of("trn-sana-600m-512.yaml", "precision=bf16"), world_size=32, activations=act600)
    assert bf16.optimizer == came.optimizer  # CAME computes in fp32 from bf16 gradients too
    zero = estimate(cfg_of("trn-sana-600m-512.yaml", "trainium.zero1=true"), world_size=32, activations=act600)
    assert zero.optimizer == (8 * p + 4 * rows) // 32 + 4 * whole  # master + grad + state rows, columns whole


def _shapes_of(name: str):
    from training.perf.memory import trainable_shapes

    return trainable_shapes(cfg_of(name))


def test_activations_scale_with_batch_and_checkpointing_cuts_them(act600) -> None:
    one = estimate(cfg_of("trn-sana-600m-512.yaml", "data.batch_size=1"), world_size=32, activations=act600)
    four = estimate(cfg_of("trn-sana-600m-512.yaml", "data.batch_size=4"), world_size=32, activations=act600)
    assert four.activations == 4 * one.activations
    assert act600.per_block > act600.block_input > 0 and act600.base > 0
    assert one.activations_checkpointing * 5 < one.activations_no_checkpointing


def test_gpu_config_on_a_neuroncore_fails_naming_checkpointing(act600) -> None:
    est = estimate(cfg_of("sana-600m-512.yaml"), world_size=32, activations=act600)
    assert est.total > 16 * GIB  # batch 32, no checkpointing (the case)
    with pytest.raises(UserError, match=r"exceeds its 16 GiB.*set model.activation_checkpointing: full"):
        check_fits(est, limit_gib=16, device="NeuronCore-v2")


def test_trn_configs_fit_a_neuroncore_v2() -> None:
    for name in ("trn-sana-600m-512.yaml", "trn-sana-1600m-1024.yaml"):
        est = estimate(cfg_of(name), world_size=32)
        check_fits(est, limit_gib=16, device="NeuronCore-v2")
        assert est.total < 12 * GIB, (name, est.as_gib())  # headroom for compiler scratch/buffers


def test_1600m_without_zero1_names_zero1() -> None:
    est = estimate(cfg_of("trn-sana-1600m-1024.yaml", "trainium.zero1=false", "precision=bf16-mixed"),
                   world_size=32)
    with pytest.raises(UserError, match=r"set trainium.zero1: true"):
        check_fits(est, limit_gib=16, device="NeuronCore-v2")


def test_bench_dry_run_prints_the_table_and_refuses_what_cannot_fit(capsys) -> None:
    from training.perf.bench import main

    main(["--dry-run", "--backend", "trainium", "--config", str(CONFIGS / "trn-sana-1600m-1024.yaml")])
    out = capsys.readouterr().out
    assert "HBM estimate per NeuronCore-v2" in out and "of 16 GiB" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["hbm_gib"]["zero1"] is True and summary["hbm_gib"]["total"] < 16
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--backend", "trainium", "--config", str(CONFIGS / "sana-600m-512.yaml")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.activation_checkpointing" in err[0]


def test_trainium_entrypoint_refuses_before_creating_a_device(capsys, monkeypatch, tmp_path) -> None:
    """No torch_xla in this environment: reaching the backend would fail differently."""
    from training.trainium import main

    monkeypatch.setitem(sys.modules, "torch_xla", None)  # any import of it raises ImportError
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(CONFIGS / "sana-600m-512.yaml"), "--output-dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "memory estimate: " in capsys.readouterr().err


# ----- GPU: per-GPU estimate by mesh and activation checkpointing ---------------------------

def test_gpu_state_bytes_follow_the_mesh() -> None:
    from training.perf.memory import estimate_gpu

    cfg = cfg_of("sana-1600m-1024.yaml", "optim.name=adamw", "optim.betas=null", "optim.eps=null")
    ddp = estimate_gpu(cfg, world_size=16, mesh="ddp")
    p = ddp.parameters
    # DDP: the gradients are views into the all-reduce buckets (gradient_as_bucket_view): one copy
    assert (ddp.weights, ddp.gradients, ddp.optimizer) == (4 * p, 4 * p, 8 * p)
    came = estimate_gpu(cfg_of("sana-1600m-1024.yaml"), world_size=16, mesh="fsdp")
    assert 4 * p // 16 < came.optimizer < 4.3 * p // 16  # the preset's CAME: about half of AdamW's
    assert estimate_gpu(cfg, world_size=1, mesh="ddp").gradients == 4 * p
    fsdp = estimate_gpu(cfg, world_size=16, mesh="fsdp")
    hsdp = estimate_gpu(cfg, world_size=16, mesh="hsdp", shard_group_size=8)
    assert (fsdp.shard, hsdp.shard) == (16, 8)
    assert fsdp.optimizer == 8 * p // 16 and hsdp.optimizer == 8 * p // 8
    assert 4 * p // 16 < fsdp.weights < hsdp.weights < ddp.weights  # shards + the gathered units
    assert fsdp.activations == ddp.activations  # sharding the state does not touch activations


def test_gpu_activations_order_by_checkpointing_mode() -> None:
    from training.perf.memory import estimate_gpu

    cfg = cfg_of("sana-600m-512.yaml")
    act = {m: estimate_gpu(cfg, world_size=8, ac=m).activations for m in ("none", "full", "every_n", "selective")}
    assert act["full"] < act["selective"] < act["none"] and act["full"] < act["every_n"] < act["none"]
    two = estimate_gpu(cfg_of("sana-600m-512.yaml", "data.batch_size=64"), world_size=8, ac="none")
    assert two.activations == 2 * act["none"]


def test_fake_tensor_measurement_counts_what_a_real_forward_saves() -> None:
    """The estimate runs the forward on fake tensors (no memory); the same forward on real CPU
    tensors saves the same bytes, in fp32 and under bf16 autocast."""
    import torch
    from diffusers import SanaTransformer2DModel

    from training.model.attention import use_fp32_linear_attention
    from training.perf.memory import _fake_saved_bytes

    kw = dict(in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=16,
              num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
              caption_channels=24, sample_size=8)
    for autocast in (False, True):
        model = SanaTransformer2DModel(**kw)
        use_fp32_linear_attention(model)
        by_storage: dict[int, int] = {}
        keep = []

        def pack(t, by_storage=by_storage, keep=keep):
            keep.append(t)
            key = t.untyped_storage()._cdata
            by_storage[key] = max(by_storage.get(key, 0), t.numel() * t.element_size())
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(hidden_states=torch.randn(1, 4, 8, 8), encoder_hidden_states=torch.randn(1, 10, 24),
                  timestep=torch.ones(1), encoder_attention_mask=torch.ones(1, 10), return_dict=False)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        real = sum(v for k, v in by_storage.items() if k not in params)
        assert _fake_saved_bytes(kw, 2, 10, autocast)[0] == real, autocast


def test_gpu_config_that_cannot_fit_names_the_cheapest_knob() -> None:
    from training.perf.memory import check_gpu_fits, estimate_gpu

    big_batch = cfg_of("sana-600m-512.yaml", "data.batch_size=64")
    est = estimate_gpu(big_batch, world_size=8)
    with pytest.raises(UserError, match=r"exceeds its 80 GiB.*set model.activation_checkpointing: selective"):
        check_gpu_fits(est, big_batch, limit_gib=80, device="H100")
    cfg = cfg_of("sana-1600m-1024.yaml", "gpu.distributed=ddp")  # already fully checkpointed
    est = estimate_gpu(cfg, world_size=16)
    with pytest.raises(UserError, match=r"set gpu.distributed: hsdp"):
        check_gpu_fits(est, cfg, limit_gib=20, device="A100-40GB")
    fsdp = estimate_gpu(cfg_of("sana-1600m-1024.yaml"), world_size=16)
    with pytest.raises(UserError, match=r"lower data.batch_size to [1-7] "):
        check_gpu_fits(fsdp, cfg_of("sana-1600m-1024.yaml"), limit_gib=fsdp.total / GIB - 1, device="x")


def test_gpu_entrypoint_refuses_a_config_that_cannot_fit_before_step_0(capsys, tmp_path) -> None:
    """gpu.memory_check=on (what "auto" does on CUDA): the refusal comes before the backend,
    the data or the model exist (the data path does not even need to exist)."""
    from training.gpu import main

    with pytest.raises(SystemExit) as exc:
        main(["--config", str(CONFIGS / "sana-600m-512.yaml"), "--set", "gpu.memory_check=on",
              "--set", "data.batch_size=64", "--set", f"data.path={tmp_path / 'missing'}",
              "--output-dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds its 80 GiB" in err[0] and "model.activation_checkpointing" in err[0]
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.slow
def test_shipped_gpu_configs_fit_an_80gb_gpu() -> None:
    from training.perf.memory import check_gpu_fits, estimate_gpu

    names = sorted(p.name for p in CONFIGS.glob("sana-*.yaml"))  # every GPU config, later ones included
    assert {"sana-600m-512.yaml", "sana-1600m-1024.yaml"} <= set(names)
    for name in names:
        cfg = cfg_of(name)
        check_gpu_fits(estimate_gpu(cfg, world_size=8), cfg, limit_gib=80, device="H100")


def test_runbook_memory_table_is_the_commands_output() -> None:
    """runbooks/train-gpu.md pastes `python -m training.bench --memory-table`: it must match."""
    from training.perf.memory_table import memory_tables

    text = (REPO / "runbooks/train-gpu.md").read_text()
    start, end = "<!-- memory-table: start -->\n", "<!-- memory-table: end -->"
    assert start in text and end in text, "memory table markers missing from runbooks/train-gpu.md"
    pasted = text.split(start, 1)[1].split(end, 1)[0]
    configs = [CONFIGS / "sana-600m-512.yaml", CONFIGS / "sana-1600m-1024.yaml"]
    assert pasted == memory_tables(configs, world_size=16), "re-paste the output of the command in the runbook"


def test_lora_keeps_optimizer_state_for_the_adapters_only() -> None:
    from training.perf.memory import estimate_gpu

    full = estimate_gpu(cfg_of("sana-600m-512.yaml"), world_size=8)
    lora = estimate_gpu(cfg_of("sana-600m-512.yaml", "lora.rank=16"), world_size=8)
    assert lora.weights == full.weights and lora.activations == full.activations
    assert 0 < lora.optimizer < full.optimizer / 50 and 0 < lora.gradients < full.gradients / 50


def test_trainium_lora_estimate_counts_gradients_optimizer_and_ema_for_the_adapters_only() -> None:
    from training.perf.memory import estimate

    full = estimate(cfg_of("trn-sana-600m-512.yaml"), world_size=32)
    lora = estimate(cfg_of("trn-sana-600m-512.yaml", "lora.rank=16"), world_size=32)
    assert lora.weights == full.weights and lora.activations == full.activations
    assert 0 < lora.gradients < full.gradients / 50 and 0 < lora.optimizer < full.optimizer / 50
    assert lora.ema < full.ema / 50 or full.ema == 0
