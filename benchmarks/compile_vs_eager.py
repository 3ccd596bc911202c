"""Training-step time with per-block ``torch.compile`` (``gpu.compile: true``) vs eager.

Two copies of one model (same init), the compiled one built by the GPU backend exactly as
training builds it (training/model/compile.py: each transformer block's forward compiled,
dynamic=False), then forward + backward + AdamW steps interleaved eager / compiled in one
process. Prints the compile (first-step) time, the median step times and the ratio.

Default model: sana-600m-512's width (1152, 2 blocks) at 8x8 latents, batch 2, fp32 on CPU
(``--precision bf16-mixed`` for autocast; on CUDA use the real preset, e.g. ``--layers 28
--latent 16 --batch 32``).

Run: ``python benchmarks/compile_vs_eager.py [--layers 2] [--reps 8]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sana-600m-512")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--latent", type=int, default=8, help="latent height = width")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--text-tokens", type=int, default=16)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    ap.add_argument("--activation-checkpointing", default="none")
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    from training.backends.gpu import GpuBackend, GpuConfig
    from training.model.build import ModelConfig, build_model

    cfg = ModelConfig(
        preset=args.preset,
        overrides=dict(num_layers=args.layers, sample_size=args.latent),
        activation_checkpointing=args.activation_checkpointing,
    )
    runs = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        backend = GpuBackend(GpuConfig(compile=compile_, compile_cache_dir=""), precision=args.precision)
        backend.init()
        torch.manual_seed(0)
        model = backend.prepare_model(build_model(cfg))
        runs[name] = (backend, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    kw = cfg.model_kwargs()
    dev = runs["eager"][0].device
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, kw["in_channels"], args.latent, args.latent, generator=g).to(dev)
    text = torch.randn(args.batch, args.text_tokens, kw["caption_channels"], generator=g).to(dev)
    t = torch.tensor([500.0] * args.batch, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(name: str) -> float:
        backend, model, opt = runs[name]
        sync()
        t0 = time.perf_counter()
        with backend.autocast():
            out = model(x, text, t, return_dict=False)[0]
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    first = {name: step(name) for name in runs}  # compile happens here (and eager's warm-up)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name in runs:
            times[name].append(step(name))
    params = sum(p.numel() for p in runs["eager"][1].parameters())
    print(
        f"{args.preset} width, {args.layers} blocks ({params / 1e6:.1f}M params), {args.latent}x{args.latent} "
        f"latents, batch {args.batch}, {args.text_tokens} text tokens, {args.precision}, AC "
        f"{args.activation_checkpointing}, {dev}, torch {torch.__version__}, {args.reps} interleaved reps"
    )
    med = {name: statistics.median(v) for name, v in times.items()}
    for name in runs:
        print(f"  {name:9} first step {first[name]:7.2f} s, then {med[name] * 1e3:8.1f} ms/step")
    print(f"  eager / compiled = {med['eager'] / med['compiled']:.2f}x")


if __name__ == "__main__":
    main()
