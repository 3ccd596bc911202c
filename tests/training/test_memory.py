"""The per-NeuronCore HBM estimate (training/memory.py): numbers, the refusal and its knob,
and where it runs (``bench --dry-run`` and the Trainium entrypoint, before any device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from training.config import load_config
from training.errors import UserError
from training.memory import GIB, check_fits, estimate, measure_activations

REPO = Path(__file__).resolve().parents[2]
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
    plain = estimate(cfg_of("trn-sana-600m-512.yaml"), world_size=32, activations=act600)
    p = plain.parameters
    assert 590e6 < p < 593e6  # sana-600m-512, as tests/training/test_model.py counts it
    assert (plain.weights, plain.gradients, plain.optimizer) == (4 * p, 4 * p, 8 * p)  # fp32 masters + AdamW
    zero = estimate(cfg_of("trn-sana-600m-512.yaml", "trainium.zero1=true"), world_size=32, activations=act600)
    assert zero.optimizer == 16 * p // 32  # fp32 master + 2 moments + grad shard, over 32 ranks
    bf16 = estimate(cfg_of("trn-sana-600m-512.yaml", "precision=bf16"), world_size=32, activations=act600)
    assert (bf16.weights, bf16.optimizer) == (2 * p, 4 * p)


def test_activations_scale_with_batch_and_checkpointing_cuts_them(act600) -> None:
    one = estimate(cfg_of("trn-sana-600m-512.yaml", "data.batch_size=1"), world_size=32, activations=act600)
    four = estimate(cfg_of("trn-sana-600m-512.yaml", "data.batch_size=4"), world_size=32, activations=act600)
    assert four.activations == 4 * one.activations
    assert act600.per_block > act600.block_input > 0 and act600.base > 0
    assert one.activations_checkpointing * 5 < one.activations_no_checkpointing


def test_gpu_config_on_a_neuroncore_fails_naming_checkpointing(act600) -> None:
    est = estimate(cfg_of("sana-600m-512.yaml"), world_size=32, activations=act600)
    assert est.total > 16 * GIB  # batch 32, no checkpointing (the case)
    with pytest.raises(UserError, match=r"exceeds its 16 GiB.*set model.gradient_checkpointing: true"):
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
    from training.bench import main

    main(["--dry-run", "--backend", "trainium", "--config", str(CONFIGS / "trn-sana-1600m-1024.yaml")])
    out = capsys.readouterr().out
    assert "HBM estimate per NeuronCore-v2" in out and "of 16 GiB" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["hbm_gib"]["zero1"] is True and summary["hbm_gib"]["total"] < 16
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--backend", "trainium", "--config", str(CONFIGS / "sana-600m-512.yaml")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.gradient_checkpointing" in err[0]


def test_trainium_entrypoint_refuses_before_creating_a_device(capsys, monkeypatch, tmp_path) -> None:
    """No torch_xla in this environment: reaching the backend would fail differently."""
    from training.trainium import main

    monkeypatch.setitem(sys.modules, "torch_xla", None)  # any import of it raises ImportError
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(CONFIGS / "sana-600m-512.yaml"), "--output-dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "memory estimate: " in capsys.readouterr().err
