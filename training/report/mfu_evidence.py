"""What the assumed MFU bands rest on: published diffusion-transformer training MFU, per platform.

MFU = achieved model FLOP/s per device / the device's dense peak (989 bf16 TFLOP/s for an
H100 SXM, training/model/flops.py). Published figures for diffusion transformers, converted:

- NVIDIA NeMo DFM performance summary (NVIDIA-NeMo/DFM docs/performance-summary.md at
  0c23efefb818bb2f289b0e3081250518defdd0d8), Wan 2.1 14B pre-training on DGX-H100, BF16:
  Megatron-Core on 128 GPUs (TP 2, SP, CP 4) 325.77 model TFLOP/s per GPU = 32.9%;
  the NeMo Automodel (FSDP) backend 175.88 on 8 GPUs = 17.8% and 228.85 on 64 GPUs = 23.1%.
- For scale (an LLM, not a diffusion model): Llama 3 405B reached 38-43% BF16 MFU on 8K-16K
  H100s ("The Llama 3 Herd of Models", arXiv:2407.21783, Table 4).

No MFU has been published for Sana training on any platform, nor for any diffusion
transformer on Trainium (the Neuron documentation publishes LLM throughput, not DiT MFU), so
the Trainium band is a pure assumption: as wide as the evidence's spread, centred where the
GPU band is, so that the band itself favours neither side. Sana (0.6B/1.6B, linear attention,
depthwise 3x3 convolutions, narrow widths) is far smaller and less matmul-dense than Wan 14B,
which pulls its MFU down; the GPU band therefore starts below the lowest Wan figure.

A measured bench run replaces the band for its instance type (training/report/measured_points.py).
"""

from __future__ import annotations

DFM_SUMMARY = ("https://github.com/NVIDIA-NeMo/DFM/blob/0c23efefb818bb2f289b0e3081250518defdd0d8/"
               "docs/performance-summary.md")
#: (what, model TFLOP/s per GPU, GPUs, peak TFLOP/s) as published; MFU = tflops / peak
PUBLISHED = (
    ("Wan 2.1 14B, NeMo DFM Megatron-Core, DGX-H100", 325.77, 128, 989.0),
    ("Wan 2.1 14B, NeMo DFM Automodel, DGX-H100", 175.88, 8, 989.0),
    ("Wan 2.1 14B, NeMo DFM Automodel, DGX-H100", 228.85, 64, 989.0),
)
GPU_BAND = (0.15, 0.35)
TRN_BAND = (0.10, 0.40)


def published_mfu() -> list[tuple[str, int, float]]:
    """(what, GPUs, MFU) of each published figure."""
    return [(what, gpus, tflops / peak) for what, tflops, gpus, peak in PUBLISHED]


def gpu_source() -> str:
    spread = ", ".join(f"{m:.1%} ({what.split(', ')[1]}, {gpus} GPUs)" for what, gpus, m in published_mfu())
    return (f"published diffusion-transformer MFU on H100: Wan 2.1 14B {spread} (NeMo DFM performance "
            f"summary, {DFM_SUMMARY}); Sana is smaller and less matmul-dense, so the band starts lower. "
            "For scale, Llama 3 405B reached 38-43% (arXiv:2407.21783, Table 4)")


TRN_SOURCE = ("ASSUMPTION: no MFU has been published for a diffusion transformer on Trainium; the band is "
              "as wide as the GPU evidence's spread and centred on the GPU band's mid, so it favours neither side")
SAME_SOURCE = "ASSUMPTION, the same band for every platform (--mfu-band)"
