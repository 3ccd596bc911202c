"""bf16-mixed vs fp32 agreement before/after the fp32 linear-attention + fp32-timestep fix, and
the step-time cost of fp32 linear attention at a 600M-shaped block (CPU; issue 12).

    .venv/bin/python benchmarks/bf16_numerics.py [--reps 5] [--timing-reps 7]

Part 1 - agreement. For each model config and each of ``--reps`` fixed batches (seeded latents,
captions, noise and sigmas, the real RectifiedFlow loss), one forward+backward in fp32 is the
reference and these variants are compared with it, interleaved batch by batch:

- ``plain/before``: bf16 autocast, diffusers' processor (its matmuls autocast to bf16);
- ``plain/after``: bf16 autocast, training/model/attention.py's fp32 processor;
- ``fsdp/before``: FSDP2 (gloo, one process) bf16 params with the root casting the timestep
  to bf16 (``cast_forward_inputs=True``), diffusers' processor - the code before the fix;
- ``fsdp/after``: the GPU backend as it is now (no input casting, fp32 scale-shift tables and
  root, fp32 processor): it should equal ``plain/after``.

Part 1b - the kernel alone. The linear self-attention of a sana-600m-512 block (36 heads x 32)
on N = 1024 and 4096 tokens (512px and 1024px latents at batch 1), under bf16 autocast, with
each processor; relative error of its output against the same module in fp32.

Printed: median (max) over batches of the loss relative error |L - L32| / |L32| and of the
gradient relative error ||g - g32|| / ||g32|| over all parameters, and the after/before ratio.

Part 2 - cost. One SanaTransformerBlock shaped like the sana-600m-512 preset (dim 1152, 36
linear heads x 32, cross 16 x 72, mlp 2.5), batch 1, 16x16 latents, forward+backward under
bf16 autocast, fp32 processor vs diffusers' processor, alternated for ``--timing-reps`` pairs;
prints the median time ratio. On CPU, bf16 matmuls are emulated or AMX-dependent, so the
ratio says little about an H100: it is the measurement the issue asked for, not a GPU figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from training.backends.gpu import GpuBackend, GpuConfig  # noqa: E402
from training.model.build import ModelConfig, build_model  # noqa: E402
from training.objective import ObjectiveConfig, RectifiedFlow  # noqa: E402

#: (name, model overrides over the tiny preset, latent (C, H, W), text tokens)
CONFIGS: list[tuple[str, dict[str, Any], tuple[int, int, int], int]] = [
    ("tiny", {}, (4, 8, 8), 8),
    # wider and longer: 256-dim, 1024 tokens, where the N-term sums of linear attention matter
    ("small-1024tok", dict(num_layers=2, num_attention_heads=8, attention_head_dim=32,
                           num_cross_attention_heads=8, cross_attention_head_dim=32, cross_attention_dim=256,
                           caption_channels=64, sample_size=32), (4, 32, 32), 16),
]


class _OldFsdpBackend(GpuBackend):
    """The GPU backend's FSDP2 wrapping before the fix: one policy, root casts every float input."""

    def _fully_shard(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (self.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer_blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self._fsdp_root = model
        return model


def _batch(seed: int, latent: tuple[int, int, int], tokens: int, text_dim: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 2
    mask = torch.ones(n, tokens, dtype=torch.int64)
    mask[1, tokens // 2:] = 0
    return {"latents": torch.randn(n, *latent, generator=g), "text": torch.randn(n, tokens, text_dim, generator=g),
            "text_mask": mask,
            "_sigma": torch.sigmoid(torch.randn(n, generator=g)), "_noise": torch.randn(n, *latent, generator=g)}


class _FixedFlow(RectifiedFlow):
    """The real objective with its random draw (sigma, noise, caption drop) fixed by the batch."""

    draw: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def sample(self, latents: torch.Tensor):
        return self.draw


def _loss_and_grads(backend: GpuBackend, model_cfg: ModelConfig, batch: dict[str, torch.Tensor], text_dim: int,
                    tokens: int) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)  # the same init for every variant
    model = backend.prepare_model(build_model(model_cfg))
    flow = _FixedFlow(ObjectiveConfig(caption_dropout=0.0), vae_scaling_factor=1.0,
                      null_text=torch.zeros(tokens, text_dim), null_mask=torch.ones(tokens, dtype=torch.int64))
    flow.draw = (batch["_sigma"], batch["_noise"], torch.zeros(batch["latents"].shape[0], dtype=torch.bool))
    real = {k: v for k, v in batch.items() if not k.startswith("_")}
    with backend.autocast():
        loss = flow(model, real)
    loss.backward()
    inner = backend.unwrap(model)
    grads = []
    for p in inner.parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads.append(g.detach().float().flatten())
    return float(loss.detach().float()), torch.cat(grads)


def agreement(reps: int) -> None:
    print("== bf16-mixed vs fp32: relative error on a fixed batch (median (max) over "
          f"{reps} batches; lower is better)")
    fsdp_new = GpuBackend(GpuConfig(distributed="fsdp"), precision="bf16-mixed")
    fsdp_old = _OldFsdpBackend(GpuConfig(distributed="fsdp"), precision="bf16-mixed")
    fsdp_new.init()  # one gloo group (a lone process) serves both FSDP variants
    fsdp_old.world_size = 1
    plain32 = GpuBackend(GpuConfig(), precision="fp32")
    plain16 = GpuBackend(GpuConfig(), precision="bf16-mixed")
    variants = [("plain/before", plain16, False), ("plain/after", plain16, True),
                ("fsdp/before", fsdp_old, False), ("fsdp/after", fsdp_new, True)]
    try:
        for name, overrides, latent, tokens in CONFIGS:
            base = {"preset": "tiny", "overrides": overrides}
            text_dim = int(overrides.get("caption_channels", 8))
            errs: dict[str, dict[str, list[float]]] = {v[0]: {"loss": [], "grad": []} for v in variants}
            for rep in range(reps):
                batch = _batch(100 + rep, latent, tokens, text_dim)
                ref_loss, ref_grad = _loss_and_grads(plain32, ModelConfig(**base), batch, text_dim, tokens)
                for vname, backend, fp32_attn in variants:  # interleaved with the reference, per batch
                    loss, grad = _loss_and_grads(backend, ModelConfig(**base, fp32_linear_attention=fp32_attn),
                                                 batch, text_dim, tokens)
                    errs[vname]["loss"].append(abs(loss - ref_loss) / abs(ref_loss))
                    errs[vname]["grad"].append(float((grad - ref_grad).norm() / ref_grad.norm()))
            print(f"-- {name}: latents {latent}, {latent[1] * latent[2]} image tokens")
            for vname, _, _ in variants:
                e = errs[vname]
                print(f"   {vname:13s} loss {statistics.median(e['loss']):.3e} ({max(e['loss']):.3e})   "
                      f"grad {statistics.median(e['grad']):.3e} ({max(e['grad']):.3e})")
            for kind in ("plain", "fsdp"):
                b, a = errs[f"{kind}/before"], errs[f"{kind}/after"]
                print(f"   {kind}: after/before median ratio  loss "
                      f"{statistics.median(a['loss']) / max(statistics.median(b['loss']), 1e-30):.2f}  grad "
                      f"{statistics.median(a['grad']) / max(statistics.median(b['grad']), 1e-30):.2f}")
    finally:
        fsdp_new.close()


def kernel_error() -> None:
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
    from diffusers.models.transformers.sana_transformer import SanaTransformerBlock

    from training.model.attention import Fp32LinearAttnProcessor

    torch.manual_seed(0)
    dim = 1152
    attn = SanaTransformerBlock(dim, 36, 32, num_cross_attention_heads=16, cross_attention_head_dim=72,
                                cross_attention_dim=dim, mlp_ratio=2.5).attn1
    print("== linear self-attention alone (sana-600m-512 shape), output relative error vs fp32")
    with torch.no_grad():
        for tokens in (1024, 4096):
            x = torch.nn.functional.layer_norm(torch.randn(1, tokens, dim), (dim,))  # what norm1 hands it
            attn.set_processor(Fp32LinearAttnProcessor())
            ref = attn(x)
            row = []
            for name, proc in (("bf16 matmuls (diffusers)", SanaLinearAttnProcessor2_0()),
                               ("fp32 matmuls (ours)", Fp32LinearAttnProcessor())):
                attn.set_processor(proc)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    got = attn(x).float()
                row.append(f"{name} {float((got - ref).norm() / ref.norm()):.3e}")
            print(f"   N={tokens:5d}: " + "   ".join(row))
            # the kernel alone: the same bf16 q/k/v (what the projections hand it), matmuls and
            # normaliser in bf16 vs fp32, against fp64
            q, k, v = (torch.nn.functional.linear(x, m.weight).to(torch.bfloat16)
                       .transpose(1, 2).unflatten(1, (36, -1)) for m in (attn.to_q, attn.to_k, attn.to_v))
            exact = _linear_attention(q.double(), k.double(), v.double())
            errs = [float((_linear_attention(q.to(dt), k.to(dt), v.to(dt)).double() - exact).norm() / exact.norm())
                    for dt in (torch.bfloat16, torch.float32)]
            print(f"   N={tokens:5d}: kernel only (same bf16 q/k/v): bf16 {errs[0]:.3e}   fp32 {errs[1]:.3e}   "
                  f"ratio {errs[0] / errs[1]:.0f}x")


def _linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """diffusers' SanaLinearAttnProcessor2_0 math on (B, h, d, N) q/k/v, in their dtype."""
    q, k = torch.relu(q), torch.relu(k).transpose(2, 3)
    v = torch.nn.functional.pad(v, (0, 0, 0, 1), value=1.0)
    out = torch.matmul(torch.matmul(v, k), q)
    return out[:, :, :-1] / (out[:, :, -1:] + 1e-15)


def cost(reps: int) -> None:
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
    from diffusers.models.transformers.sana_transformer import SanaTransformerBlock

    from training.model.attention import Fp32LinearAttnProcessor

    torch.manual_seed(0)
    dim = 1152
    block = SanaTransformerBlock(dim, 36, 32, num_cross_attention_heads=16, cross_attention_head_dim=72,
                                 cross_attention_dim=dim, mlp_ratio=2.5)
    h = w = 16
    x = torch.randn(1, h * w, dim)
    text = torch.randn(1, 300, dim)
    temb = torch.randn(1, 6 * dim)

    def step(processor: Any) -> float:
        block.attn1.set_processor(processor)
        block.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x, None, text, None, temb, h, w)
        out.float().square().mean().backward()
        return time.perf_counter() - t0

    procs = {"fp32": Fp32LinearAttnProcessor(), "bf16": SanaLinearAttnProcessor2_0()}
    for p in procs.values():  # warm-up
        step(p)
    times: dict[str, list[float]] = {k: [] for k in procs}
    for _ in range(reps):
        for k, p in procs.items():  # alternated
            times[k].append(step(p))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"== step time, one sana-600m-512 block (dim {dim}, 36x32 linear heads), batch 1, {h}x{w} latents, "
          f"300 text tokens, fwd+bwd under bf16 autocast, CPU threads {torch.get_num_threads()}, "
          f"median of {reps} alternated pairs")
    print(f"   fp32 linear attention {med['fp32'] * 1e3:.1f} ms   bf16 (diffusers) {med['bf16'] * 1e3:.1f} ms   "
          f"ratio fp32/bf16 {med['fp32'] / med['bf16']:.3f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="fixed batches per config (agreement)")
    p.add_argument("--timing-reps", type=int, default=7, help="alternated timing pairs (cost)")
    p.add_argument("--skip-cost", action="store_true")
    args = p.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    agreement(args.reps)
    kernel_error()
    if not args.skip_cost:
        cost(args.timing_reps)


if __name__ == "__main__":
    main()
