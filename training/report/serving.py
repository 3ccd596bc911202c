"""The "Serving" section of the decision report: cost per 1,000 images on Inferentia2 vs a GPU.

Before any endpoint is measured, the cost is projected the way training/report/projection.py
projects training: FLOPs per image from the model, the instance's dense peak from its
datasheet, list prices from training/prices.yaml, and an ASSUMED utilisation (MFU) band that
is the same for both platforms, so the band favours neither. Measured serving benches
(training/serve/bench.py JSON, ``python -m training.report --serving FILE``) are added as rows
next to it with the MFU their latency implies.

Formulas (tests/training/serve/test_cost.py checks them by hand):
- FLOPs per image = text encoder (prompt with CHI + negative) + steps x transformer forward x
  guidance batch (2) + DC-AE decode
- seconds per image at MFU m = FLOPs per image / (m x peak x 1e12)   (one image at a time)
- cost per 1,000 images = USD/h / (3600 / seconds per image) x 1000
- equal-cost MFU ratio (inf2 over GPU) = (USD/h_inf2 / peak_inf2) / (USD/h_gpu / peak_gpu):
  Inferentia2 is cheaper per image iff m_inf2 / m_gpu exceeds it.

The transformer forward is training/model/flops.py's analytic count; the Gemma-2-2B text encoder is
counted analytically below (its config: google/gemma-2-2b-it config.json, the text encoder
NVlabs Sana's configs name); the DC-AE decoder is counted by torch's FlopCounterMode on the
meta device for the dc-ae-f32c32-sana-1.0 config (diffusers scripts/convert_dcae_to_diffusers.py
``get_ae_config``): 8.37 TFLOP at 1024 px.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.model import flops
from training.serve.bench import ServeBenchResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingInstance:
    """What one serving instance type holds (one accelerator chip each) and its dense peak."""

    instance_type: str
    accelerator: str
    peak_bf16_tflops: float
    memory_gib: float
    source: str


SERVING_INSTANCES: dict[str, ServingInstance] = {s.instance_type: s for s in (
    ServingInstance(instance_type="ml.inf2.xlarge", accelerator="Inferentia2, 2 NeuronCore-v2",
                    peak_bf16_tflops=190.0, memory_gib=32,
                    source="AWS Neuron docs, Inferentia2 architecture (about-neuron/arch/neuron-hardware/"
                           "inferentia2.rst): per chip 190 FP16/BF16 TFLOPS, 32 GiB HBM"),
    ServingInstance(instance_type="ml.g6.xlarge", accelerator="NVIDIA L4", peak_bf16_tflops=121.0, memory_gib=24,
                    source="NVIDIA L4 datasheet: 242 BF16 Tensor TFLOPS with 2:4 sparsity = 121 dense, 24 GB"),
)}
INF2, GPU = "ml.inf2.xlarge", "ml.g6.xlarge"
#: ASSUMPTION, the same for both: no published Sana inference MFU exists on either chip. A
#: batch-1 diffusion step at 1024 px is a few TFLOPs of mostly dense matmuls, so it should
#: utilise a chip better than small-batch LLM decoding and worse than large-batch training.
SERVE_MFU = (0.15, 0.40)
SERVE_MFU_SOURCE = ("ASSUMPTION, the same band for both platforms (no published Sana inference MFU on "
                    "Inferentia2 or L4)")
DEFAULT_PRESET = "sana-1600m-1024"
DEFAULT_STEPS = 20
#: tokens of Sana's complex human instruction with Gemma's tokenizer: an assumption for the
#: text-encoder term (~2% of an image's FLOPs at 20 steps), not measured here (no Gemma tokenizer)
CHI_TOKENS = 200
TEXT_TOKENS = 300
GEMMA2_2B = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 256}
SANA_DCAE = dict(
    latent_channels=32, encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024), decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
    encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
    downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="rms_norm",
    decoder_act_fns="silu", scaling_factor=0.41407)


def serving_prices(paths: Sequence[str | Path]) -> dict[str, Any]:
    """The ``serving`` section of price files (training/prices.yaml's layout; later files win),
    each entry validated as every price table's entries are (training/report/prices.py)."""
    import yaml

    from training.errors import UserError
    from training.report.prices import parse_price  # one validation for every price entry

    out: dict[str, Any] = {}
    for path in map(Path, paths):
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise UserError(f"--prices {path}: unreadable ({exc})") from None
        section = data.get("serving") or {}
        if not isinstance(section, dict):
            raise UserError(f"--prices {path}: key serving: expected a mapping of instance type -> price entry")
        for name, entry in section.items():
            out[str(name)] = parse_price(path, "serving", str(name), entry, str(data.get("region", "")))
    return out


def text_encoder_flops(tokens: int, config: Mapping[str, int] = GEMMA2_2B) -> float:
    """Gemma-2 forward FLOPs for one sequence of ``tokens`` (matmuls + attention, 2 per MAC)."""
    d, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_token = 2 * (d * q + 2 * d * kv + q * d + 3 * d * f)  # q, k, v, o, gate/up/down
    attention = 2 * 2 * tokens * q  # QK^T and AV per token (full causal upper bound)
    return float(layers * tokens * (per_token + attention))


@functools.cache
def decoder_flops(height: int, width: int) -> float:
    """DC-AE f32c32 decode FLOPs for one image, counted on the meta device (no memory, no compute)."""
    import torch
    from diffusers import AutoencoderDC
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        vae = AutoencoderDC(**SANA_DCAE)
        z = torch.randn(1, 32, height // 32, width // 32)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        vae.decode(z)
    return float(counter.get_total_flops())


def image_flops(transformer: Mapping[str, Any], height: int, width: int, steps: int, *, vae_scale: int = 32,
                text_tokens: int = TEXT_TOKENS, chi_tokens: int = CHI_TOKENS, guidance: bool = True,
                real_decoder: bool = True) -> dict[str, float]:
    """FLOPs of one image by part (see the module docstring)."""
    latent = (height // vae_scale, width // vae_scale)
    per_step = flops.forward_flops_per_sample(transformer, text_tokens, latent) * (2 if guidance else 1)
    text = text_encoder_flops(chi_tokens + text_tokens - 2) + (text_encoder_flops(text_tokens) if guidance else 0.0)
    return {"text_encoder": text, "transformer": steps * per_step,
            "vae_decoder": decoder_flops(height, width) if real_decoder else 0.0}


def seconds_per_image(image_tflop: float, instance: ServingInstance, mfu: float) -> float:
    return image_tflop / (mfu * instance.peak_bf16_tflops)


def cost_per_1000(usd_per_hour: float, seconds: float) -> float:
    return usd_per_hour / (3600.0 / seconds) * 1000.0


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def section(results: Sequence[ServeBenchResult], prices: Mapping[str, Any], *, preset: str = DEFAULT_PRESET,
            steps: int = DEFAULT_STEPS, mfu_band: tuple[float, float] = SERVE_MFU) -> list[str]:
    """Markdown lines of the report's "Serving" section."""
    from training.model.build import PRESETS

    lo, hi = mfu_band
    side = int(PRESETS[preset]["sample_size"]) * 32
    parts = image_flops(PRESETS[preset], side, side, steps)
    tflop = sum(parts.values()) / 1e12
    lines = ["## Serving", "",
             f"Cost per 1,000 images on an Inferentia2 endpoint ({INF2}) against a GPU one ({GPU}), one image at a "
             f"time per instance (the `<project>-serving` stack; runbooks/serving.md). Projected for `{preset}` at "
             f"{side}x{side} px, {steps} steps with classifier-free guidance: {tflop:,.1f} TFLOP per image "
             f"(transformer {parts['transformer'] / 1e12:,.1f}, DC-AE decode {parts['vae_decoder'] / 1e12:,.2f}, "
             f"Gemma-2 text encoder {parts['text_encoder'] / 1e12:,.2f}, assuming {CHI_TOKENS} CHI tokens).", "",
             f"MFU band {lo:.0%}-{hi:.0%}: {SERVE_MFU_SOURCE}.", ""]
    missing = [name for name in (INF2, GPU) if name not in prices]
    if missing:
        return [*lines, f"No price for {', '.join(missing)} in the price table: add them to training/prices.yaml "
                "(or --prices) to project the serving cost.", ""]
    rows, at = [], {}
    for name in (INF2, GPU):
        inst, price = SERVING_INSTANCES[name], prices[name]
        slow, fast = seconds_per_image(tflop, inst, lo), seconds_per_image(tflop, inst, hi)
        at[name] = (cost_per_1000(price.usd_per_hour, slow), cost_per_1000(price.usd_per_hour, fast))
        rows.append([f"`{name}` ({inst.accelerator})", f"{inst.peak_bf16_tflops:g}", f"${price.usd_per_hour:,.4g}"
                     + ("" if price.verified else " (unverified)"), f"{fast:,.2f} - {slow:,.2f}",
                     f"{3600 / slow:,.0f} - {3600 / fast:,.0f}", f"${at[name][1]:,.2f} - ${at[name][0]:,.2f}"])
    lines += _table(["instance", "peak BF16 TFLOP/s", "USD/h", "s per image", "images/h", "USD per 1,000 images"], rows)
    ratio = (prices[INF2].usd_per_hour / SERVING_INSTANCES[INF2].peak_bf16_tflops) / (
        prices[GPU].usd_per_hour / SERVING_INSTANCES[GPU].peak_bf16_tflops)
    lines += ["", f"At equal MFU, {INF2} costs {ratio:.2f}x what {GPU} costs per image: Inferentia2 is the cheaper "
              f"endpoint whenever its MFU is more than {ratio:.2f}x the GPU's, and \"40% better price-performance\" "
              f"(0.60x the cost) needs it to reach {ratio / 0.6:.2f}x the GPU's MFU. This is a projection until both "
              "endpoints are measured (`python -m training.serve.bench` on each, then "
              "`python -m training.report --serving FILE ...`)."]
    lines += ["", *measured_lines(results, prices), ""]
    for name in (INF2, GPU):
        price = prices[name]
        checked = f"checked {price.checked}" if price.checked else "undated"
        lines.append(f"- `{name}` peak: {SERVING_INSTANCES[name].source}; price: {price.source} "
                     f"({checked}{'' if price.verified else ', unverified'}"
                     f"{'; ' + price.note if getattr(price, 'note', '') else ''}).")
    return [*lines, ""]


def measured_lines(results: Sequence[ServeBenchResult], prices: Mapping[str, Any]) -> list[str]:
    if not results:
        return ["No serving bench was measured yet: the figures above are projections only."]
    rows = []
    cpu = False
    for r in results:
        cpu = cpu or r.is_cpu
        price = prices.get(r.instance_type)
        cost = f"${cost_per_1000(price.usd_per_hour, 1 / r.images_per_s_per_instance):,.4g}" if price else "n/a (no price)"
        inst = SERVING_INSTANCES.get(r.instance_type)
        mfu = "n/a"
        if inst is not None and r.transformer_config:
            parts = image_flops(r.transformer_config, r.height, r.width, r.steps, guidance=r.guidance_scale > 1)
            mfu = f"{sum(parts.values()) / r.mean_s / (inst.peak_bf16_tflops * 1e12):.1%}"
        rows.append([f"`{r.instance_type}` {r.backend}", f"{r.height}x{r.width}, {r.steps} steps",
                     f"{r.p50_s:,.3f} / {r.p90_s:,.3f}", f"{r.images_per_s_per_instance:,.3f}", mfu, cost])
    out = ["Measured (python -m training.serve.bench):", "",
           *_table(["endpoint", "request", "latency p50 / p90 s", "images/s per instance", "implied MFU",
                    "USD per 1,000 images"], rows)]
    if cpu:
        out += ["", "**CPU figures from a local run (tiny model), not accelerator figures**: they show the "
                "measurement path and say nothing about Inferentia2 or GPU serving."]
    return out
