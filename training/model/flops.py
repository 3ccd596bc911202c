"""Analytic FLOP model of diffusers' ``SanaTransformer2DModel`` and accelerator peaks, for MFU.

MFU = achieved model FLOP/s / peak FLOP/s. Both halves live here so the loop's logging and
``training.bench`` report the same number.

The FLOP model counts what ``torch.utils.flop_counter.FlopCounterMode`` counts: matrix
multiplies, convolutions and attention (2 FLOPs per multiply-accumulate). Element-wise work
(norms, SiLU/GELU, modulation, residual adds, the linear-attention normaliser) is left out,
as in every MFU convention (PaLM appendix B; Megatron-LM "Efficient Large-Scale Language
Model Training", sec. 5.1); it is < 1% of the matmul FLOPs at these widths. A training step
is counted as 3x the forward (backward = grad-input + grad-weight = 2x forward); the exact
backward is a little cheaper because the patch embedding and the first caption projection
need no grad-input, which the counter sees and which is < 1% at 512 px
(tests/training/model/test_flops.py measures the difference against the counter).

Per sample, with L = (H/p)*(W/p) image tokens, T = text tokens (padded length: shapes are
static), D = heads*head_dim, Dc = cross_heads*cross_head_dim, Dx = cross_attention_dim,
F = int(mlp_ratio*D), d = head_dim, the forward FLOPs are:

  patch embed (conv k=p, s=p)      2 L (C_in p^2) D
  timestep embed (adaLN-single)    2 (256 D + D D + 6 D D)            (per sample, not per token)
  caption projection (2 linears)   2 T (C_cap D + D D)
  per block, x num_layers:
    self-attn q, k, v, out         4 * 2 L D D
    linear attention (ReLU kernel) 2 * 2 L D (d + 1)   (V_pad K^T, then (V_pad K^T) Q; +1 = pad row)
    cross-attn q, out              2 L D Dc + 2 L Dc D
    cross-attn k, v on text        2 * 2 T Dx Dc
    cross-attn QK^T and AV         2 * 2 L T Dc
    Mix-FFN (GLUMBConv)            2 L D (2F) + 2 L (2F) 9 + 2 L F D  (1x1 expand, 3x3 depthwise,
                                                                       1x1 project after the GLU)
  final proj_out                   2 L D (p^2 C_out)

For sana-600m-512 (L = 16*16, T = 300) this gives 0.316 TFLOP forward, 0.947 TFLOP per
training sample.

Per batch (issue 17): ``batch_train_flops`` gives the useful FLOPs (real caption tokens) and
the computed ones (the padded or trimmed caption length the step ran on, training/data/text_trim.py);
the loop and bench report MFU on the first and ``mfu_padded`` on the second.

``real_text_tokens`` (keyword, default None) replaces T in the three text terms (caption
projection, cross-attn k/v, cross-attn scores) by the mean real caption length: the useful
FLOPs, without the caption padding the static-shape step still computes. Callers that pass
nothing (the loop, the bench) get the padded count exactly as before; the projection
(``training/report/projection.py``) passes the data's mean so its MFU counts useful work only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# diffusers SanaTransformer2DModel.__init__ defaults: a preset may leave any of these out.
_SANA_DEFAULTS: dict[str, Any] = {
    "in_channels": 32,
    "out_channels": 32,
    "num_attention_heads": 70,
    "attention_head_dim": 32,
    "num_layers": 20,
    "num_cross_attention_heads": 20,
    "cross_attention_head_dim": 112,
    "cross_attention_dim": 2240,
    "caption_channels": 2304,
    "mlp_ratio": 2.5,
    "patch_size": 1,
    "guidance_embeds": False,
}

# Timesteps() sinusoid width inside diffusers' AdaLayerNormSingle / TimestepEmbedding.
_TIMESTEP_PROJ_DIM = 256


def forward_flops_breakdown(model_kwargs: Mapping[str, Any], text_tokens: int,
                            latent_hw: tuple[int, int], *,
                            real_text_tokens: float | None = None) -> dict[str, float]:
    """Forward FLOPs per sample, by component (see the module docstring for the formulas).

    Args:
        model_kwargs: ``SanaTransformer2DModel`` constructor kwargs (e.g. ``model.PRESETS[name]``);
            missing keys take diffusers' defaults.
        text_tokens: caption length the model sees (the padded ``max_text_tokens``).
        latent_hw: latent height and width (512 px with DC-AE f32 -> (16, 16)).
        real_text_tokens: mean real (unpadded) caption length. Given, the text terms (caption
            projection, cross-attention k/v and scores) count only real tokens: the *useful*
            FLOPs, as MFU conventions count them (no padding). The device still computes the
            padded length (static shapes), so step time follows the padded count; the gap is
            the padding waste. None (default): every padded token counts, as before.
    """
    c = {**_SANA_DEFAULTS, **dict(model_kwargs)}
    h, w = (int(v) for v in latent_hw)
    p = int(c["patch_size"])
    if h % p or w % p:
        raise ValueError(f"latent_hw {latent_hw} is not divisible by patch_size {p}")
    tokens = (h // p) * (w // p)
    t: float = int(text_tokens)
    if real_text_tokens is not None:
        if not 0 < real_text_tokens <= t:
            raise ValueError(f"real_text_tokens {real_text_tokens} must be in (0, text_tokens={t}]")
        t = float(real_text_tokens)
    d_head = int(c["attention_head_dim"])
    dim = int(c["num_attention_heads"]) * d_head
    c_in = int(c["in_channels"])
    c_out = int(c["out_channels"] or c_in)
    ffn = int(float(c["mlp_ratio"]) * dim)  # GLUMBConv: hidden_channels = int(expand_ratio * in)
    layers = int(c["num_layers"])
    parts: dict[str, float] = {
        "patch_embed": 2.0 * tokens * c_in * p * p * dim,
        "timestep_embed": 2.0 * (_TIMESTEP_PROJ_DIM * dim + dim * dim + 6 * dim * dim),
        "caption_projection": 2.0 * t * (int(c["caption_channels"]) * dim + dim * dim),
        "proj_out": 2.0 * tokens * dim * p * p * c_out,
    }
    if c.get("guidance_embeds"):
        # SanaCombinedTimestepGuidanceEmbeddings: a second TimestepEmbedding for guidance.
        parts["timestep_embed"] += 2.0 * (_TIMESTEP_PROJ_DIM * dim + dim * dim)
    per_block = {
        "self_attn_proj": 4 * 2.0 * tokens * dim * dim,
        "linear_attention": 2 * 2.0 * tokens * dim * (d_head + 1),
        "mix_ffn": 2.0 * tokens * dim * 2 * ffn + 2.0 * tokens * 2 * ffn * 9 + 2.0 * tokens * ffn * dim,
    }
    if c.get("cross_attention_dim") is not None:
        dc = int(c["num_cross_attention_heads"]) * int(c["cross_attention_head_dim"])
        dx = int(c["cross_attention_dim"])
        per_block["cross_attn_proj"] = 2.0 * tokens * dim * dc * 2 + 2 * 2.0 * t * dx * dc
        per_block["cross_attention"] = 2 * 2.0 * tokens * t * dc
    for name, value in per_block.items():
        parts[name] = layers * value
    return parts


def forward_flops_per_sample(model_kwargs: Mapping[str, Any], text_tokens: int,
                             latent_hw: tuple[int, int], *, real_text_tokens: float | None = None) -> float:
    """Forward FLOPs for one sample (sum of ``forward_flops_breakdown``)."""
    return float(sum(forward_flops_breakdown(model_kwargs, text_tokens, latent_hw,
                                             real_text_tokens=real_text_tokens).values()))


def train_flops_per_sample(model_kwargs: Mapping[str, Any], text_tokens: int,
                           latent_hw: tuple[int, int], *, real_text_tokens: float | None = None) -> float:
    """Training FLOPs (forward + backward = 3x forward) for one sample; the MFU numerator.

    Gradient checkpointing re-runs the forward but is *not* counted: MFU measures useful
    model FLOPs (the recompute shows up as a lower MFU, which is the honest reading).
    """
    return 3.0 * forward_flops_per_sample(model_kwargs, text_tokens, latent_hw, real_text_tokens=real_text_tokens)


def batch_train_flops(model_kwargs: Mapping[str, Any], latent_hw: tuple[int, int], text_tokens: int,
                      real_text_tokens: float | None = None) -> tuple[float, float]:
    """(useful, computed) training FLOPs per sample of one batch: ``latent_hw`` of this batch
    (buckets change it per step), ``text_tokens`` the caption length the step computes
    (padded, or trimmed by training/data/text_trim.py), ``real_text_tokens`` the batch's mean real
    caption length (mask sum / samples; None = all real). Useful FLOPs divide into MFU
    (``mfu``), computed ones into ``mfu_padded``."""
    computed = train_flops_per_sample(model_kwargs, text_tokens, latent_hw)
    if real_text_tokens is None:
        return computed, computed
    return train_flops_per_sample(model_kwargs, text_tokens, latent_hw, real_text_tokens=real_text_tokens), computed


# ----- accelerator peaks -------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One device a training rank drives, with its published dense peaks (TFLOP/s).

    ``peak_fp32_tflops`` is what fp32 matmuls run at under our backends' defaults: TF32
    tensor cores on NVIDIA (GpuConfig.tf32 is on by default), the FP32 rate on Trainium.
    """

    name: str
    peak_bf16_tflops: float
    peak_fp32_tflops: float
    memory_gib: float
    source: str


# NVIDIA peaks, dense (the datasheets' headline figures are "with sparsity", 2x dense, which
# dense training does not use); TF32 is what fp32 matmuls run at (GpuConfig.tf32 is on):
# - H100 datasheet (https://www.nvidia.com/en-us/data-center/h100/, "H100 SXM / H100 NVL"):
#   BF16 1,979* / 1,671* TFLOP/s, TF32 989* / 835*, 80 / 94 GB -> dense 989.4 / 835.5 BF16,
#   494.7 / 417.5 TF32. H100 PCIe (product brief PB-11133-001, and the datasheet's earlier
#   "H100 PCIe" column): BF16 1,513*, TF32 756*, 80 GB -> dense 756.5 / 378.
# - H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/, "H200 SXM / H200 NVL"):
#   BF16 1,979* / 1,671*, TF32 989* / 835*, 141 GB each -> the H100 SXM / NVL compute with
#   more and faster HBM.
# - A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/): BF16 312, TF32 156 dense
#   (SXM and PCIe alike).
_NVIDIA_H100 = ("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 TFLOP/s with sparsity = 989.4 "
                "dense, TF32 494.7 dense, https://www.nvidia.com/en-us/data-center/h100/")
_NVIDIA_H100_NVL = ("NVIDIA H100 Tensor Core GPU datasheet, H100 NVL: BF16 1,671 TFLOP/s with sparsity = 835.5 "
                    "dense, TF32 417.5 dense, https://www.nvidia.com/en-us/data-center/h100/")
_NVIDIA_H100_PCIE = ("NVIDIA H100 PCIe product brief (PB-11133-001) / H100 datasheet, H100 PCIe: BF16 1,513 "
                     "TFLOP/s with sparsity = 756.5 dense, TF32 378 dense, https://www.nvidia.com/en-us/data-center/h100/")
_NVIDIA_H200 = ("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 1,979 TFLOP/s with sparsity = 989.4 dense "
                "(H100 SXM compute, 141 GB HBM3e), https://www.nvidia.com/en-us/data-center/h200/")
_NVIDIA_H200_NVL = ("NVIDIA H200 Tensor Core GPU datasheet, H200 NVL: BF16 1,671 TFLOP/s with sparsity = 835.5 "
                    "dense, TF32 417.5 dense, https://www.nvidia.com/en-us/data-center/h200/")
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet (312 TFLOP/s BF16 dense, TF32 156 dense), https://www.nvidia.com/en-us/data-center/a100/"
# Peak sources (each string below is printed in reports next to the MFU it divides):
# - H100 / H200: NVIDIA datasheets, above; the variant is told apart by the exact device
#   name CUDA reports (``accelerator_for_device``), never assumed SXM.
# - Trainium1: AWS Neuron docs "Trainium Architecture" (about-neuron/arch/neuron-hardware/
#   trainium.rst, SDK 2.28): each chip = 2 x NeuronCore-v2 delivering 190 FP16/BF16/cFP8/TF32
#   and 47.5 FP32 TFLOP/s; a trn1.32xlarge has 16 chips, so 95 BF16 TFLOP/s per NeuronCore-v2.
_TRN1 = "AWS Neuron docs, Trainium architecture: per chip 2 x NeuronCore-v2, 190 BF16 / 47.5 FP32 TFLOP/s, https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium.html"
_TRN2 = "AWS Neuron docs, Trainium2 architecture: per chip 8 x NeuronCore-v3, 667 BF16 dense / 181 FP32 TFLOP/s, 96 GiB, https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium2.html"

ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator(name="H100-SXM", peak_bf16_tflops=989.0, peak_fp32_tflops=494.7, memory_gib=80,
                source=_NVIDIA_H100),
    Accelerator(name="H100-NVL", peak_bf16_tflops=835.5, peak_fp32_tflops=417.5, memory_gib=94,
                source=_NVIDIA_H100_NVL),
    Accelerator(name="H100-PCIe", peak_bf16_tflops=756.5, peak_fp32_tflops=378.0, memory_gib=80,
                source=_NVIDIA_H100_PCIE),
    Accelerator(name="H200-SXM", peak_bf16_tflops=989.0, peak_fp32_tflops=494.7, memory_gib=141,
                source=_NVIDIA_H200),
    Accelerator(name="H200-NVL", peak_bf16_tflops=835.5, peak_fp32_tflops=417.5, memory_gib=141,
                source=_NVIDIA_H200_NVL),
    Accelerator(name="A100-SXM", peak_bf16_tflops=312.0, peak_fp32_tflops=156.0, memory_gib=40,
                source=_NVIDIA_A100),
    Accelerator(name="A100-SXM-80GB", peak_bf16_tflops=312.0, peak_fp32_tflops=156.0, memory_gib=80,
                source=_NVIDIA_A100),
    # A Trainium1 chip = 2 NeuronCore-v2; torch-neuronx runs one rank per NeuronCore.
    Accelerator(name="Trainium1-chip", peak_bf16_tflops=190.0, peak_fp32_tflops=47.5, memory_gib=32,
                source=_TRN1),
    Accelerator(name="NeuronCore-v2", peak_bf16_tflops=95.0, peak_fp32_tflops=23.75, memory_gib=16,
                source=_TRN1 + " (chip / 2)"),
    # A Trainium2 chip = 8 NeuronCore-v3; the default Logical NeuronCore config (LNC=2) gives
    # a rank 2 physical cores, i.e. a quarter chip.
    Accelerator(name="Trainium2-chip", peak_bf16_tflops=667.0, peak_fp32_tflops=181.0, memory_gib=96,
                source=_TRN2),
    Accelerator(name="NeuronCore-v3-LNC2", peak_bf16_tflops=667.0 / 4, peak_fp32_tflops=181.0 / 4,
                memory_gib=24, source=_TRN2 + " (chip / 4 at LNC=2)"),
)}

#: CUDA device names (``torch.cuda.get_device_name``, = nvidia-smi's product name) -> key above,
#: first match wins: the NVL / PCIe names contain "H100"/"H200" too, so they come first; the
#: H100 SXM5 reports its memory ("NVIDIA H100 80GB HBM3"), the H200 SXM just "NVIDIA H200".
#: A name matching none of these gets no peak (no MFU), never a neighbour's.
DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    ("H200 NVL", "H200-NVL"),
    ("H200", "H200-SXM"),
    ("H100 NVL", "H100-NVL"),
    ("H100 PCIe", "H100-PCIe"),
    ("H100 80GB HBM3", "H100-SXM"),
    ("H100 SXM", "H100-SXM"),
)


def accelerator_for_device(device_name: str, memory_bytes: int = 0) -> str:
    """The ``ACCELERATORS`` key for a CUDA device name, else the name itself (no peak)."""
    import re

    for pattern, key in DEVICE_NAMES:
        # whole-word start: "GH200" (Grace Hopper) is not an H200
        if re.search(r"(?<![A-Za-z0-9])" + re.escape(pattern), device_name):
            return key
    if "A100" in device_name:  # SXM and PCIe share the peaks; the memory picks the entry
        return "A100-SXM-80GB" if memory_bytes > 60 * 2**30 else "A100-SXM"
    return device_name


#: Dense bf16 peak TFLOP/s per accelerator name (the MFU denominator for bf16 runs).
PEAK_TFLOPS: dict[str, float] = {n: a.peak_bf16_tflops for n, a in ACCELERATORS.items()}
#: fp32 peak TFLOP/s (TF32 tensor cores on NVIDIA) for fp32 runs.
PEAK_FP32_TFLOPS: dict[str, float] = {n: a.peak_fp32_tflops for n, a in ACCELERATORS.items()}


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """What one instance type holds: the per-rank device and how many of them."""

    accelerator: str
    devices: int  # ranks (GPUs / NeuronCores a rank drives) per instance
    chips: int


INSTANCE_TYPES: dict[str, InstanceSpec] = {
    "ml.p5.48xlarge": InstanceSpec(accelerator="H100-SXM", devices=8, chips=8),
    "ml.p5e.48xlarge": InstanceSpec(accelerator="H200-SXM", devices=8, chips=8),
    "ml.p5en.48xlarge": InstanceSpec(accelerator="H200-SXM", devices=8, chips=8),
    "ml.p4d.24xlarge": InstanceSpec(accelerator="A100-SXM", devices=8, chips=8),
    "ml.p4de.24xlarge": InstanceSpec(accelerator="A100-SXM-80GB", devices=8, chips=8),
    "ml.trn1.32xlarge": InstanceSpec(accelerator="NeuronCore-v2", devices=32, chips=16),
    "ml.trn1n.32xlarge": InstanceSpec(accelerator="NeuronCore-v2", devices=32, chips=16),
    "ml.trn2.48xlarge": InstanceSpec(accelerator="NeuronCore-v3-LNC2", devices=64, chips=16),
}


def instance_spec(instance_type: str) -> InstanceSpec | None:
    """The accelerator layout of a SageMaker instance type (``ml.`` prefix optional), or None."""
    key = instance_type if instance_type.startswith("ml.") else f"ml.{instance_type}"
    return INSTANCE_TYPES.get(key)


def accelerator_for_instance(instance_type: str) -> str | None:
    """Accelerator name (a key of ``PEAK_TFLOPS``) a rank drives on this instance type, or None."""
    spec = instance_spec(instance_type)
    return spec.accelerator if spec else None


#: Nitro instances report their EC2 type as the DMI product name (e.g. "trn1.32xlarge")
_DMI_PRODUCT = "/sys/devices/virtual/dmi/id/product_name"


def host_instance_type() -> str | None:
    """This host's instance type ("ml." + the EC2 type from DMI on Nitro), or None elsewhere."""
    try:
        with open(_DMI_PRODUCT) as fh:
            product = fh.read().strip()
    except OSError:
        return None
    return f"ml.{product}" if "." in product else None


def resolve_accelerator(accelerator: str | None) -> str | None:
    """A backend's device name -> a key of ``ACCELERATORS``, or None. Generic names that do
    not say which generation (torch-xla's "neuroncore") are resolved by this host's
    instance type."""
    if accelerator in ACCELERATORS:
        return accelerator
    if accelerator and accelerator.lower() == "neuroncore":
        instance = host_instance_type()
        return accelerator_for_instance(instance) if instance else None
    return None


def peak_tflops(accelerator: str | None, precision: str) -> float | None:
    """Dense peak for ``precision`` ("bf16", "bf16-mixed" -> bf16; "fp32" -> fp32/TF32), or None
    for an unknown accelerator (a CPU: no meaningful published peak, so no MFU)."""
    accelerator = resolve_accelerator(accelerator)
    if accelerator is None:
        return None
    table = PEAK_FP32_TFLOPS if precision == "fp32" else PEAK_TFLOPS
    return table[accelerator]


def mfu(flops_per_sample: float, samples_per_s_per_device: float, accelerator: str | None,
        precision: str) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None where the peak is unknown)."""
    peak = peak_tflops(accelerator, precision)
    if peak is None or samples_per_s_per_device <= 0:
        return None
    return flops_per_sample * samples_per_s_per_device / (peak * 1e12)


# ----- cross-check against torch's FLOP counter ---------------------------------------------

def counted_train_flops_per_sample(model_kwargs: Mapping[str, Any], text_tokens: int,
                                   latent_hw: tuple[int, int], *, device: str = "cpu",
                                   batch: int = 1) -> float:
    """fwd+bwd FLOPs per sample of a real ``SanaTransformer2DModel`` as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them (the check on the analytic model).

    ``device="meta"`` counts full-size presets without allocating memory or computing.

    NOTE: two corrections make the counter see what the GPU runs:
    - SDPA is forced to the math backend: on CPU, SDPA dispatches to
      ``_scaled_dot_product_flash_attention_for_cpu``, which the counter has no formula for
      (the cross-attention scores would count as 0); the math path decomposes into counted bmms.
    - ``convolution_backward`` gets a groups-aware formula: torch's ``conv_backward_flop``
      computes grad-weight as a dense conv over all input channels, ignoring ``groups``, so
      the 3x3 depthwise conv of Mix-FFN is over-counted by a factor of its channel count
      (~5,760x at 600M). Grad-input and grad-weight each cost one forward conv.
    """
    import torch
    from diffusers import SanaTransformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

    def conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation,
                      _transposed, _output_padding, _groups, output_mask, out_shape=None, **_kw) -> int:
        return conv_flop_count(x_shape, w_shape, grad_out_shape) * (int(output_mask[0]) + int(output_mask[1]))

    kw = {**_SANA_DEFAULTS, **dict(model_kwargs)}
    torch.manual_seed(0)
    with torch.device(device):
        model = SanaTransformer2DModel(**dict(model_kwargs))
        latents = torch.randn(batch, int(kw["in_channels"]), *latent_hw)
        text = torch.randn(batch, text_tokens, int(kw["caption_channels"]))
        mask = torch.ones(batch, text_tokens, dtype=torch.long)
        timestep = torch.rand(batch) * 1000
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: conv_backward})
    with sdpa_kernel(SDPBackend.MATH), counter:
        out = model(latents, text, timestep, encoder_attention_mask=mask).sample
        out.float().pow(2).mean().backward()
    return counter.get_total_flops() / batch
