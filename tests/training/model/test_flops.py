"""The analytic FLOP model (training/model/flops.py) against torch's FlopCounterMode on real models."""

from __future__ import annotations

import pytest

from training.model import flops
from training.model.build import PRESETS

# A mid-size config: every component at non-trivial width, patch 2, a few seconds on CPU.
MID = dict(in_channels=16, out_channels=16, num_layers=2, num_attention_heads=8, attention_head_dim=32,
           num_cross_attention_heads=4, cross_attention_head_dim=64, cross_attention_dim=256,
           caption_channels=128, patch_size=2, sample_size=16)


@pytest.mark.parametrize(("name", "kwargs", "text_tokens", "hw"), [
    ("tiny", PRESETS["tiny"], 16, (32, 32)),
    ("mid", MID, 40, (16, 16)),
])
def test_matches_flop_counter_on_cpu(name, kwargs, text_tokens, hw):
    counted = flops.counted_train_flops_per_sample(kwargs, text_tokens, hw, batch=2)
    analytic = flops.train_flops_per_sample(kwargs, text_tokens, hw)
    ratio = analytic / counted
    print(f"{name}: analytic {analytic:.4g} counted {counted:.4g} ratio {ratio:.4f}")
    assert abs(ratio - 1) <= 0.05


@pytest.mark.parametrize(("preset", "text_tokens", "hw"), [
    ("sana-600m-512", 300, (16, 16)),
    ("sana-1600m-1024", 300, (32, 32)),
])
def test_full_presets_on_meta_device(preset, text_tokens, hw):
    counted = flops.counted_train_flops_per_sample(PRESETS[preset], text_tokens, hw, device="meta", batch=1)
    analytic = flops.train_flops_per_sample(PRESETS[preset], text_tokens, hw)
    assert abs(analytic / counted - 1) <= 0.05


def test_forward_is_exact_and_600m_is_about_095_tflop():
    kw = PRESETS["sana-600m-512"]
    total = flops.train_flops_per_sample(kw, 300, (16, 16))
    assert total == pytest.approx(0.95e12, rel=0.01)
    parts = flops.forward_flops_breakdown(kw, 300, (16, 16))
    # hand computation of the largest term: Mix-FFN, 28 x (2*256*1152*5760 + 2*256*5760*9 + 2*256*2880*1152)
    assert parts["mix_ffn"] == 28 * (2 * 256 * 1152 * 5760 + 2 * 256 * 5760 * 9 + 2 * 256 * 2880 * 1152)
    assert total == 3 * sum(parts.values())


def test_peaks_and_mfu():
    assert flops.PEAK_TFLOPS["H100-SXM"] == 989.0
    assert flops.PEAK_TFLOPS["H200-SXM"] == 989.0
    assert flops.PEAK_TFLOPS["A100-SXM"] == 312.0
    assert flops.PEAK_TFLOPS["Trainium1-chip"] == 190.0
    assert flops.PEAK_TFLOPS["NeuronCore-v2"] == 95.0
    assert all(a.source.count("https://") == 1 for a in flops.ACCELERATORS.values())
    assert flops.accelerator_for_instance("ml.p5.48xlarge") == "H100-SXM"
    assert flops.accelerator_for_instance("trn1.32xlarge") == "NeuronCore-v2"
    assert flops.accelerator_for_instance("ml.c5.xlarge") is None
    # 0.95 TFLOP/sample at 520.6 samples/s on one H100 in bf16 = 50% MFU
    assert flops.mfu(0.95e12, 520.6, "H100-SXM", "bf16-mixed") == pytest.approx(0.95 * 520.6 / 989, rel=1e-9)
    assert flops.mfu(1e9, 10.0, None, "fp32") is None
    assert flops.peak_tflops("NeuronCore-v2", "fp32") == 23.75


def test_generic_neuroncore_name_resolves_by_host_instance_type(monkeypatch, tmp_path):
    assert flops.resolve_accelerator("H100-SXM") == "H100-SXM"
    assert flops.resolve_accelerator("cpu") is None
    dmi = tmp_path / "product_name"
    dmi.write_text("trn1.32xlarge\n")
    monkeypatch.setattr(flops, "_DMI_PRODUCT", str(dmi))
    assert flops.resolve_accelerator("neuroncore") == "NeuronCore-v2"
    assert flops.peak_tflops("neuroncore", "bf16-mixed") == 95.0
    dmi.write_text("trn2.48xlarge\n")
    assert flops.resolve_accelerator("neuroncore") == "NeuronCore-v3-LNC2"


def test_real_text_tokens_count_only_real_caption_tokens():
    """``real_text_tokens`` drops the padding from the text terms, by hand; default unchanged."""
    kw = PRESETS["sana-600m-512"]
    padded = flops.train_flops_per_sample(kw, 300, (16, 16))
    assert flops.train_flops_per_sample(kw, 300, (16, 16), real_text_tokens=None) == padded
    assert flops.train_flops_per_sample(kw, 300, (16, 16), real_text_tokens=300) == padded
    real = flops.train_flops_per_sample(kw, 300, (16, 16), real_text_tokens=80)
    pad, d, dc, dx, cap, tokens, layers = 300 - 80, 1152, 16 * 72, 1152, 2304, 256, 28
    text_terms = 2 * pad * (cap * d + d * d) + layers * (2 * 2 * pad * dx * dc + 2 * 2 * tokens * pad * dc)
    assert padded - real == pytest.approx(3 * text_terms, rel=1e-12)
    with pytest.raises(ValueError, match="real_text_tokens 301"):
        flops.train_flops_per_sample(kw, 300, (16, 16), real_text_tokens=301)


# tiny, sana-600m-512 and sana-1600m-1024 are checked above; this covers the rest (presets added later too)
@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"tiny", "sana-600m-512", "sana-1600m-1024"}))
def test_every_preset_matches_the_counter_at_its_own_resolution(preset):
    """Every preset in training/model/build.py (new ones included), at its sample size and 300 tokens."""
    kw = PRESETS[preset]
    size = int(kw.get("sample_size", 32))
    counted = flops.counted_train_flops_per_sample(kw, 300, (size, size), device="meta", batch=1)
    useful, computed = flops.batch_train_flops(kw, (size, size), 300)
    assert useful == computed and abs(computed / counted - 1) <= 0.05


def test_batch_flops_split_useful_from_computed_for_a_trimmed_batch():
    kw = PRESETS["sana-600m-512"]
    useful, computed = flops.batch_train_flops(kw, (16, 16), 128, real_text_tokens=80)
    assert useful == flops.train_flops_per_sample(kw, 300, (16, 16), real_text_tokens=80)  # padding-free
    assert computed == flops.train_flops_per_sample(kw, 128, (16, 16))
    padded = flops.train_flops_per_sample(kw, 300, (16, 16))
    assert useful < computed < padded
    assert 0.08 < 1 - computed / padded < 0.15  # trimming 300 -> 128 saves ~11% of a 600M-512 step's FLOPs


def test_the_exact_cuda_device_name_picks_the_peak():
    """PCIe and NVL parts are slower than SXM; an MFU against the wrong peak would read high.
    Names as CUDA reports them (nvidia-smi's product name)."""
    cases = {"NVIDIA H100 80GB HBM3": ("H100-SXM", 989.0), "NVIDIA H100 PCIe": ("H100-PCIe", 756.5),
             "NVIDIA H100 NVL": ("H100-NVL", 835.5), "NVIDIA H200": ("H200-SXM", 989.0),
             "NVIDIA H200 NVL": ("H200-NVL", 835.5)}
    for name, (key, peak) in cases.items():
        assert flops.accelerator_for_device(name) == key, name
        assert flops.peak_tflops(flops.accelerator_for_device(name), "bf16-mixed") == peak
    assert flops.accelerator_for_device("NVIDIA A100-SXM4-80GB", 80 * 2**30) == "A100-SXM-80GB"
    # an unknown part gets no peak (hence no MFU), not a neighbour's
    assert flops.accelerator_for_device("NVIDIA GH200 480GB") == "NVIDIA GH200 480GB"
    assert flops.peak_tflops("NVIDIA GH200 480GB", "bf16-mixed") is None
