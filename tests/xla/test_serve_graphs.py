"""The serving graphs (training/serve/components.py) lower to exactly ONE static XLA graph each.

neuronx-cc compiles what torch-xla lowers, so this is the check that runs here for what
``torch_neuronx.trace`` will compile on inf2/trn (torch-neuronx itself is not installable on this
machine): for each component (the Gemma-2 text encoder at the CHI prompt's length, the
transformer at the guidance batch, the DC-AE decoder), one forward on the XLA device compiles one
graph, reads nothing back to the host inside it (no ``.item()``-style sync: no data-dependent
Python control flow), a second forward with different values compiles nothing new, and the
result equals eager on the CPU within 1e-5 (relative to the output's magnitude; fp32).

On a Neuron host, ``python -m training.serve.smoke`` compiles the same wrappers with
torch-neuronx and serves them (runbooks/serving.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory: pytest.TempPathFactory):
    from diffusers import SanaPipeline

    from training.serve.tiny import build_tiny_serving_export

    export = build_tiny_serving_export(tmp_path_factory.mktemp("serve-xla"))
    return SanaPipeline.from_pretrained(export), export


def _inputs(pipe, component: str, seed: int) -> tuple[torch.Tensor, ...]:
    from training.serve.components import text_lengths
    from training.serve.spec import ServingSpec

    gen = torch.Generator().manual_seed(seed)
    if component == "text_encoder":
        spec = ServingSpec.read(Path(pipe.config._name_or_path))
        length = text_lengths(pipe.tokenizer, spec.complex_human_instruction, spec.max_sequence_length)["prompt"]
        ids = torch.randint(4, 60, (1, length), generator=gen)
        mask = torch.zeros(1, length, dtype=torch.long)
        mask[:, : length - 3 - seed] = 1  # a different caption length each call
        return ids, mask
    if component == "transformer":
        mask = torch.zeros(2, 16, dtype=torch.long)
        mask[:, : 4 + seed] = 1
        return (torch.randn(2, 4, 32, 32, generator=gen), torch.randn(2, 16, 8, generator=gen),
                torch.tensor([800.0 - 100 * seed] * 2), mask)
    return (torch.randn(1, 4, 32, 32, generator=gen),)


@pytest.mark.parametrize("component", ["text_encoder", "transformer", "vae_decoder"])
def test_each_serving_graph_lowers_to_one_static_xla_graph(tiny_pipe, component):
    import torch_xla
    import torch_xla.debug.metrics as met

    from training.serve.components import DecoderGraph, TextEncoderGraph, TransformerGraph

    pipe, _ = tiny_pipe
    graph = {"text_encoder": lambda: TextEncoderGraph(pipe.text_encoder),
             "transformer": lambda: TransformerGraph(pipe.transformer),
             "vae_decoder": lambda: DecoderGraph(pipe.vae)}[component]().eval()
    with torch.no_grad():
        eager = [graph(*_inputs(pipe, component, seed)) for seed in (0, 1)]
    device = torch_xla.device()
    xla_graph = graph.to(device)
    met.clear_all()

    def run(seed: int) -> torch.Tensor:
        with torch.no_grad():
            out = xla_graph(*[t.to(device) for t in _inputs(pipe, component, seed)])
        torch_xla.sync()
        return out.cpu()

    first = run(0)
    compiles_first = met.metric_data("CompileTime")[0]
    second = run(1)
    compiles_second = met.metric_data("CompileTime")[0]
    assert compiles_first == 1, f"{component}: {compiles_first} graphs for one forward"
    assert compiles_second == 1, f"{component}: new values recompiled ({compiles_second} graphs)"
    assert int(met.counter_value("aten::_local_scalar_dense") or 0) == 0, f"{component}: a host read inside"
    for out, ref in zip((first, second), eager, strict=True):
        assert out.shape == ref.shape
        error = float((out - ref).abs().max() / max(1.0, float(ref.abs().max())))
        assert error <= TOLERANCE, (component, error)
    graph.to("cpu")
