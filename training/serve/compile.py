"""``python -m training.serve.compile --export DIR --target inf2|trn1|trn2|cpu --shapes 1024x1024,... --out DIR``.

Compiles a serving export (training/serve/export.py) into one static graph per component and
shape (training/serve/components.py): the Gemma-2 text encoder at the prompt's length (CHI +
N - 2) and at the negative prompt's (N), the transformer per image size at the guidance batch
(2: negative + positive) and text length N, and the DC-AE decoder per image size. Writes the
TorchScript files plus ``manifest.json`` (shapes, dtypes, versions, the export's sha256,
compiler and flags, and each graph's measured error against eager) into ``--out``, through a
temporary directory, so a failed compile leaves nothing half-written.

Targets:

- ``inf2``, ``trn1``, ``trn2``: ``torch_neuronx.trace`` with neuronx-cc flags as the
  aws-neuron-samples diffusion scripts use them (torch-neuronx/inference/
  hf_pretrained_pixart_sigma_1k*/neuron_pixart_sigma/compile_*.py: ``--model-type=unet-inference``;
  trn2 ``--lnc=2`` with ``NEURON_LOGICAL_NC_CONFIG=2``), and ``--auto-cast=none`` with weights
  cast to ``--dtype`` before tracing (optimum-neuron's ``auto_cast: none``): the compiler never
  downcasts on its own. Needs torch-neuronx (the Neuron DLC or the trn env); elsewhere the
  command stops with one line.
- ``cpu``: the same wrappers through ``torch.jit.trace`` (fp32). This is what runs here and in
  the tests: it proves the wrappers trace to graphs whose outputs equal eager on other inputs
  than the trace saw (no value baked in), and it gives the handler a compiled directory to
  serve on CPU.

Each graph is checked on a second, different input: max |traced - eager| must be within
``TOLERANCE`` (relative to the output's largest magnitude), else the compile fails naming the
graph. Shapes that are not multiples of 32, or that the VAE cannot divide, are refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from training.errors import UserError, exits_cleanly
from training.files.publish import replace_dir
from training.serve.components import (
    DTYPES,
    DecoderGraph,
    TextEncoderGraph,
    TransformerGraph,
    text_lengths,
)
from training.serve.export import recorded_sha256, sha256_file
from training.serve.manifest import MANIFEST_FILE, MANIFEST_FORMAT, NEURON_TARGETS, TARGETS
from training.serve.runtime import quiet_loading
from training.serve.spec import ServingSpec, Size, parse_sizes

#: |traced - eager| / max(1, |eager|max) allowed per graph, by compute dtype. fp32: the graphs
#: run the same kernels as eager (measured: < 1e-6 on the tiny model); bf16 on a NeuronCore
#: accumulates differently from the CPU's bf16 (8 mantissa bits: 2^-8 = 0.4% per rounding).
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}
#: classifier-free guidance doubles the transformer batch (SanaPipeline concatenates the
#: negative and positive halves); one image per request
TRANSFORMER_BATCH = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    compiler: str
    compiler_args: tuple[str, ...]
    runtime_env: dict[str, str]


def target_spec(name: str) -> Target:
    if name == "cpu":
        return Target(name="cpu", compiler="torch.jit.trace", compiler_args=(), runtime_env={})
    args = ["--target", name, "--model-type=unet-inference", "--auto-cast=none"]
    env: dict[str, str] = {}
    if name == "trn2":  # one logical NeuronCore = 2 physical (aws-neuron-samples trn2 scripts)
        args.append("--lnc=2")
        env = {"NEURON_LOGICAL_NC_CONFIG": "2", "NEURON_RT_VIRTUAL_CORE_SIZE": "2"}
    return Target(name=name, compiler="torch_neuronx.trace", compiler_args=tuple(args), runtime_env=env)


def tracer(target: Target, workdir: Path) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], str], Any]:
    """(graph, example inputs, name) -> traced TorchScript module, for the target."""
    if target.name == "cpu":
        def trace_cpu(graph, inputs, name):
            return torch.jit.trace(graph, inputs, check_trace=False)
        return trace_cpu
    try:
        import torch_neuronx
    except ImportError as exc:
        raise UserError(f"--target {target.name}: torch-neuronx is not importable ({exc}); run on an inf2/trn "
                        "host with the Neuron environment (training/requirements-neuron.txt or the Neuron DLC), "
                        "or use --target cpu to check the graphs here") from None
    os.environ.update(target.runtime_env)

    def trace_neuron(graph, inputs, name):
        return torch_neuronx.trace(graph, inputs, compiler_workdir=str(workdir / name),
                                   compiler_args=list(target.compiler_args))
    return trace_neuron


def versions(target: Target) -> dict[str, str]:
    names = ["torch", "diffusers", "transformers", "tokenizers"]
    if target.name in NEURON_TARGETS:
        names += ["torch-neuronx", "neuronx-cc", "libneuronxla"]
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _error(traced: torch.Tensor, eager: torch.Tensor) -> float:
    traced, eager = traced.float(), eager.float()
    return float((traced - eager).abs().max() / max(1.0, float(eager.abs().max())))


def _tokens(tokenizer: Any, texts: Sequence[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(list(texts), padding="max_length", max_length=length, truncation=True,
                    add_special_tokens=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def graph_inputs(pipe: Any, spec: ServingSpec, sizes: Sequence[Size], dtype: torch.dtype
                 ) -> dict[tuple[str, str], tuple[Callable[[], torch.nn.Module], list[tuple[torch.Tensor, ...]]]]:
    """(component, key) -> (graph factory, [trace inputs, check inputs]) for every graph."""
    chi = spec.complex_human_instruction
    lengths = text_lengths(pipe.tokenizer, chi, spec.max_sequence_length)
    prefix = "\n".join(chi) if chi else ""
    texts = {"prompt": ([prefix + "a photo of a cat"], [prefix + "a red fox in the snow, at dusk"]),
             "negative": ([""], ["blurry"])}
    out: dict[tuple[str, str], Any] = {}
    for kind, length in lengths.items():
        out[("text_encoder", str(length))] = (lambda: TextEncoderGraph(pipe.text_encoder),
                                              [_tokens(pipe.tokenizer, t, length) for t in texts[kind]])
    cfg = pipe.transformer.config
    gen = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    n = spec.max_sequence_length
    for size in sizes:
        h, w = size.latent(scale)
        examples = []
        for real, t in ((n, 500.0), (max(1, n // 3), 37.0)):
            mask = torch.zeros(TRANSFORMER_BATCH, n, dtype=torch.long)
            mask[:, :real] = 1
            examples.append((torch.randn(TRANSFORMER_BATCH, cfg.in_channels, h, w, generator=gen).to(dtype),
                             torch.randn(TRANSFORMER_BATCH, n, cfg.caption_channels, generator=gen).to(dtype),
                             torch.full((TRANSFORMER_BATCH,), t).to(dtype), mask))
        out[("transformer", f"{h}x{w}")] = (lambda: TransformerGraph(pipe.transformer), examples)
        out[("vae_decoder", f"{h}x{w}")] = (
            lambda: DecoderGraph(pipe.vae),
            [(torch.randn(1, pipe.vae.config.latent_channels, h, w, generator=gen).to(dtype),) for _ in range(2)])
    return out


def check_graph(traced: Any, graph: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, tolerance: float,
                what: str) -> float:
    """The traced graph's relative error against eager on ``inputs`` (an input it was NOT traced
    with); UserError when it exceeds ``tolerance``: a value was baked into the trace, or the
    compiler changed the numerics. Returns the error."""
    error = _error(traced(*inputs), graph(*inputs))
    if not error <= tolerance:
        raise UserError(f"compiled {what} differs from eager by {error:.3g} (relative; tolerance {tolerance:g}) on "
                        "an input it was not traced with; the graph does not generalise, nothing was written")
    return error


def _describe(inputs: tuple[torch.Tensor, ...], names: Sequence[str]) -> list[dict[str, Any]]:
    return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for n, t in zip(names, inputs, strict=True)]


INPUT_NAMES = {"text_encoder": ("input_ids", "attention_mask"),
               "transformer": ("latents", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
               "vae_decoder": ("latents",)}


def compile_export(export: Path, out: Path, *, target: str, sizes: Sequence[Size] | None = None,
                   dtype: str | None = None, workdir: Path | None = None, overwrite: bool = False,
                   log: Callable[[str], None] = print) -> Path:
    """Compile every graph of ``export`` for ``target`` into ``out`` (see the module docstring)."""
    from diffusers import SanaPipeline

    if target not in TARGETS:
        raise UserError(f"--target {target}: choose one of {', '.join(TARGETS)}")
    export, out = Path(export), Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out: {out} exists and is not empty; choose a new directory or pass --overwrite")
    spec_ = target_spec(target)
    try:
        spec = ServingSpec.read(export)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"--export {export}: no readable serving.json ({str(exc).splitlines()[0]}); write the "
                        "serving export with python -m training.serve.export") from None
    source = recorded_sha256(export)
    dtype = dtype or ("fp32" if target == "cpu" else spec.dtype)
    sizes = tuple(sizes or spec.sizes)
    trace = tracer(spec_, Path(workdir or out.with_name(f".{out.name}.neuron-workdir")))  # fails fast
    quiet_loading()
    pipe = SanaPipeline.from_pretrained(export, dtype=DTYPES[dtype])
    pipe.set_progress_bar_config(disable=True)
    scale = pipe.vae_scale_factor
    for size in sizes:
        if size.height % scale or size.width % scale:
            raise UserError(f"--shapes {size}: not a multiple of the VAE's {scale}x compression")
    tmp = out.with_name(f".{out.name}.tmp-compile")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    graphs = []
    with warnings.catch_warnings(), torch.no_grad():
        # TracerWarnings here come from shape arithmetic in transformers/diffusers (masking_utils
        # padding, attention_processor mask lengths, the multiscale attention's size test):
        # the shapes are static per graph, and every graph is checked below on an input it was
        # not traced with, which is what would catch a value baked into the trace.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for (component, key), (factory, examples) in graph_inputs(pipe, spec, sizes, DTYPES[dtype]).items():
            graph = factory().eval()
            started = time.perf_counter()
            traced = trace(graph, examples[0], f"{component}-{key}")
            seconds = time.perf_counter() - started
            tolerance = TOLERANCE[dtype]
            try:
                error = check_graph(traced, graph, examples[1], tolerance=tolerance, what=f"{component} {key}")
            except UserError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            file = f"{component}-{key}.pt"
            torch.jit.save(traced, str(tmp / file))
            graphs.append({"component": component, "file": file, "key": key,
                           "inputs": _describe(examples[0], INPUT_NAMES[component]),
                           "sha256": sha256_file(tmp / file), "bytes": (tmp / file).stat().st_size,
                           "max_abs_error": error, "tolerance": tolerance})
            log(f"compile: {component} {key}: {seconds:.1f} s, error {error:.2g} (tolerance {tolerance:g})")
    manifest = {
        "format": MANIFEST_FORMAT, "target": target, "dtype": dtype, "sizes": [str(s) for s in sizes],
        "transformer_batch": TRANSFORMER_BATCH,
        "text_lengths": text_lengths(pipe.tokenizer, spec.complex_human_instruction, spec.max_sequence_length),
        "graphs": graphs, "source_sha256": source, "source": str(export.resolve()),
        "compiler": spec_.compiler, "compiler_args": list(spec_.compiler_args), "runtime_env": spec_.runtime_env,
        "versions": versions(spec_), "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return replace_dir(tmp, out)


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.serve.compile", description=__doc__.splitlines()[0])
    p.add_argument("--export", required=True, help="serving export (python -m training.serve.export)")
    p.add_argument("--target", required=True, choices=TARGETS, help="inf2 / trn1 / trn2 (torch-neuronx) or cpu")
    p.add_argument("--shapes", help="image sizes HEIGHTxWIDTH,... (multiples of 32; default: serving.json sizes)")
    p.add_argument("--out", required=True, help="directory for the graphs and manifest.json")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="compute dtype (default: serving.json's; cpu: fp32)")
    p.add_argument("--workdir", help="neuronx-cc work directory (default: next to --out)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = p.parse_args(argv)
    sizes = parse_sizes(args.shapes, flag="--shapes") if args.shapes else None
    out = compile_export(Path(args.export), Path(args.out), target=args.target, sizes=sizes, dtype=args.dtype,
                         workdir=Path(args.workdir) if args.workdir else None, overwrite=args.overwrite)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    print(json.dumps({"out": str(out), "target": manifest["target"], "sizes": manifest["sizes"],
                      "graphs": [g["file"] for g in manifest["graphs"]]}), flush=True)


if __name__ == "__main__":
    main()
