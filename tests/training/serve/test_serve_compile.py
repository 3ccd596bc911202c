"""``python -m training.serve.compile --target cpu``: one graph per component and shape, a
manifest that says what was compiled from what, outputs equal to eager on inputs the trace
never saw, and one-line refusals (bad shape, no torch-neuronx, a graph that bakes a value in)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.data.text_features import SANA_CHI
from training.errors import UserError
from training.serve.compile import TOLERANCE, check_graph, main
from training.serve.export import recorded_sha256
from training.serve.manifest import MANIFEST_FILE, CompiledManifest


def test_manifest_lists_every_graph_with_its_static_shapes(compiled_cpu: Path, tiny_export: Path):
    from transformers import AutoTokenizer

    manifest = CompiledManifest.load(compiled_cpu)
    tokenizer = AutoTokenizer.from_pretrained(tiny_export / "tokenizer")
    chi_tokens = len(tokenizer.encode("\n".join(SANA_CHI)))
    # SanaPipeline._get_gemma_prompt_embeds: CHI tokens + N - 2 for the prompt; N for the negative
    assert manifest.text_lengths == {"prompt": chi_tokens + 16 - 2, "negative": 16}
    assert set(manifest.graphs_of("text_encoder")) == {str(chi_tokens + 14), "16"}
    assert set(manifest.graphs_of("transformer")) == set(manifest.graphs_of("vae_decoder")) == {"32x32"}
    transformer = manifest.graphs_of("transformer")["32x32"]
    assert [(i["name"], i["shape"], i["dtype"]) for i in transformer.inputs] == [
        ("latents", [2, 4, 32, 32], "float32"), ("encoder_hidden_states", [2, 16, 8], "float32"),
        ("timestep", [2], "float32"), ("encoder_attention_mask", [2, 16], "int64")]
    assert manifest.source_sha256 == recorded_sha256(tiny_export)
    assert (manifest.target, manifest.compiler, manifest.dtype, [str(s) for s in manifest.sizes]) == (
        "cpu", "torch.jit.trace", "fp32", ["64x64"])
    assert manifest.versions["torch"] == torch.__version__.split("+")[0] or manifest.versions["torch"] == torch.__version__
    assert all(0 <= g.max_abs_error <= g.tolerance == TOLERANCE["fp32"] for g in manifest.graphs)


def test_saved_graphs_equal_eager_on_inputs_the_trace_never_saw(compiled_cpu: Path, tiny_export: Path):
    from diffusers import SanaPipeline

    from training.serve.components import DecoderGraph, TextEncoderGraph, TransformerGraph

    pipe = SanaPipeline.from_pretrained(tiny_export)
    gen = torch.Generator().manual_seed(123)
    mask = torch.zeros(2, 16, dtype=torch.long)
    mask[:, :3] = 1  # a much shorter caption than either trace input
    cases = {
        "transformer-32x32.pt": (TransformerGraph(pipe.transformer),
                                 (torch.randn(2, 4, 32, 32, generator=gen), torch.randn(2, 16, 8, generator=gen),
                                  torch.tensor([999.0, 1.0]), mask)),
        "vae_decoder-32x32.pt": (DecoderGraph(pipe.vae), (torch.randn(1, 4, 32, 32, generator=gen) * 3,)),
        "text_encoder-16.pt": (TextEncoderGraph(pipe.text_encoder),
                               (torch.randint(4, 60, (1, 16), generator=gen), torch.tensor([[1] * 5 + [0] * 11]))),
    }
    with torch.no_grad():
        for file, (eager, inputs) in cases.items():
            traced = torch.jit.load(str(compiled_cpu / file))
            out, ref = traced(*inputs), eager(*inputs)
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=file)


def test_check_graph_refuses_a_trace_that_baked_a_value_in():
    class Branchy(torch.nn.Module):  # data-dependent Python control flow: the trace keeps one branch
        def forward(self, x):
            return x * 2 if x.sum() > 0 else -x

    graph = Branchy()
    traced = torch.jit.trace(graph, (torch.ones(3),), check_trace=False)
    assert check_graph(traced, graph, (torch.full((3,), 2.0),), tolerance=1e-4, what="toy") == 0.0
    with pytest.raises(UserError, match=r"compiled toy differs from eager by 3 \(relative; tolerance 0\.0001\).* nothing was written"):
        check_graph(traced, graph, (-torch.ones(3),), tolerance=1e-4, what="toy")


def _run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


def test_shapes_not_multiple_of_32_are_refused_in_one_line(tiny_export: Path, tmp_path: Path, capsys):
    code, err = _run(["--export", str(tiny_export), "--target", "cpu", "--shapes", "1000x1024",
                      "--out", str(tmp_path / "c")], capsys)
    assert code == 2
    assert err == ("error: --shapes 1000x1024: 1000 is not a positive multiple of 32 (DC-AE compresses 32x); "
                   "use e.g. 992x1024\n")
    assert not (tmp_path / "c").exists()


def test_neuron_target_without_torch_neuronx_stops_in_one_line(tiny_export: Path, tmp_path: Path, capsys):
    code, err = _run(["--export", str(tiny_export), "--target", "inf2", "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: --target inf2: torch-neuronx is not importable")
    assert "--target cpu" in err and not (tmp_path / "c").exists()


def test_cli_refuses_a_non_empty_out_and_a_missing_export(tiny_export: Path, tmp_path: Path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    code, err = _run(["--export", str(tiny_export), "--target", "cpu", "--out", str(tmp_path / "busy")], capsys)
    assert (code, err) == (2, f"error: --out: {tmp_path / 'busy'} exists and is not empty; choose a new directory "
                              "or pass --overwrite\n")
    code, err = _run(["--export", str(tmp_path), "--target", "cpu", "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and "no readable serving.json" in err and err.count("\n") == 1


def test_manifest_is_json_with_the_compile_inputs(compiled_cpu: Path):
    raw = json.loads((compiled_cpu / MANIFEST_FILE).read_text())
    assert raw["format"] == 1 and raw["transformer_batch"] == 2 and raw["compiler_args"] == []
    assert {g["file"] for g in raw["graphs"]} == {p.name for p in compiled_cpu.glob("*.pt")}
