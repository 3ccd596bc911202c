"""The three graphs Sana serving compiles, and the stand-ins that put compiled graphs back
into diffusers' ``SanaPipeline``.

Graphs (each a ``torch.nn.Module`` with positional tensor inputs and one tensor output, the
form ``torch_neuronx.trace`` and ``torch.jit.trace`` both take):

- ``TextEncoderGraph``: Gemma-2 at ONE fixed sequence length -> last hidden state. Two lengths
  are compiled: the prompt's, with Sana's complex human instruction (CHI) in front
  (``CHI tokens + N - 2``, SanaPipeline ``_get_gemma_prompt_embeds``), and the negative
  prompt's, N (SanaPipeline ``encode_prompt`` encodes it with ``complex_human_instruction=False``).
- ``TransformerGraph``: ``SanaTransformer2DModel`` for one latent size at the classifier-free
  guidance batch (negative + positive), text length N.
- ``DecoderGraph``: the DC-AE decoder, ``AutoencoderDC.decode(z)`` for one latent size (the
  pipeline divides by the scaling factor before it calls decode, so the graph does not).

This is how optimum-neuron splits a diffusion pipeline (text encoder, transformer and VAE
decoder compiled separately at static batch/height/width/sequence length; optimum-neuron
optimum/exporters/neuron/utils.py ``get_submodels_for_export_diffusion``) and how
aws-neuron-samples compile PixArt-Sigma (torch-neuronx/inference/hf_pretrained_pixart_sigma_1k:
``torch_neuronx.trace`` per component). optimum-neuron itself cannot export Sana (see
runbooks/serving.md, "Why not optimum-neuron").

Stand-ins: ``CompiledTextEncoder``, ``CompiledTransformer`` and ``CompiledVae`` expose exactly
what ``SanaPipeline.__call__`` touches on its components (diffusers 0.42
src/diffusers/pipelines/sana/pipeline_sana.py): ``text_encoder(ids, attention_mask=)[0]``,
``transformer(x, encoder_hidden_states=, encoder_attention_mask=, timestep=, return_dict=False,
attention_kwargs=)[0]``, ``vae.decode(z, return_dict=False)[0]``, each one's ``.config``,
``.dtype`` and ``.device`` (``DiffusionPipeline.device``). So the sampling loop, the scheduler and
the guidance arithmetic stay diffusers' own on every target; only the three calls run compiled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TextEncoderGraph(nn.Module):
    """Gemma-2 (``transformers.Gemma2Model``): (input_ids, attention_mask) -> last hidden state."""

    def __init__(self, text_encoder: nn.Module) -> None:
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # use_cache=False: no KV cache is built (inference encodes once; the cache would be an output)
        return self.text_encoder(input_ids, attention_mask=attention_mask, use_cache=False)[0]


class TransformerGraph(nn.Module):
    """``SanaTransformer2DModel``: (latents, text, timestep, text mask) -> flow prediction."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, latents: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_attention_mask: torch.Tensor) -> torch.Tensor:
        return self.transformer(latents, encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                                encoder_attention_mask=encoder_attention_mask, return_dict=False)[0]


class DecoderGraph(nn.Module):
    """DC-AE decoder (``AutoencoderDC.decode``): scaled latents -> image in [-1, 1]."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents, return_dict=False)[0]


def text_lengths(tokenizer: Any, complex_human_instruction: tuple[str, ...] | None,
                 max_sequence_length: int) -> dict[str, int]:
    """Token lengths SanaPipeline pads to: ``prompt`` (with CHI) and ``negative`` (without)."""
    if complex_human_instruction:
        chi = "\n".join(complex_human_instruction)
        prompt = len(tokenizer.encode(chi)) + max_sequence_length - 2
    else:
        prompt = max_sequence_length
    return {"prompt": prompt, "negative": max_sequence_length}


class _Compiled(nn.Module):
    """Base of the stand-ins: a component config, a dtype and the host device."""

    def __init__(self, config: Mapping[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        from diffusers.configuration_utils import FrozenDict

        self.config = FrozenDict(dict(config))
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        # Neuron graphs take and return host tensors; the runtime moves them to the NeuronCore.
        return torch.device("cpu")


def _pick(graphs: Mapping[Any, nn.Module], key: Any, what: str) -> nn.Module:
    try:
        return graphs[key]
    except KeyError:
        raise RuntimeError(f"no compiled {what} for {key}; compiled: {sorted(graphs)}") from None


def _run_padded(graph: nn.Module, batch: int, *inputs: torch.Tensor) -> torch.Tensor:
    """Run a graph compiled for ``batch`` on a smaller batch (zero rows appended, then dropped).

    SanaPipeline runs the transformer on the CFG batch (2 per image) when guidance_scale > 1 and
    on 1 otherwise; one compiled batch serves both."""
    n = inputs[0].shape[0]
    if n == batch:
        return graph(*inputs)
    if n > batch:
        raise RuntimeError(f"batch {n} is larger than the compiled batch {batch}")
    padded = [torch.cat([t, t.new_zeros((batch - n, *t.shape[1:]))]) for t in inputs]
    return graph(*padded)[:n]


class CompiledTextEncoder(_Compiled):
    """``text_encoder`` for SanaPipeline: the graph compiled for the input's sequence length."""

    def __init__(self, graphs: Mapping[int, nn.Module], *, config: Mapping[str, Any], dtype: torch.dtype,
                 batch: int = 1) -> None:
        super().__init__(config, dtype)
        self.graphs = nn.ModuleDict({str(k): v for k, v in graphs.items()})
        self.batch = batch

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any
                ) -> tuple[torch.Tensor]:
        graph = _pick(self.graphs, str(input_ids.shape[1]), "text encoder (sequence length)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return (_run_padded(graph, self.batch, input_ids.long(), attention_mask.long()),)


class CompiledTransformer(_Compiled):
    """``transformer`` for SanaPipeline: the graph compiled for the latents' height x width."""

    def __init__(self, graphs: Mapping[tuple[int, int], nn.Module], *, config: Mapping[str, Any],
                 dtype: torch.dtype, batch: int) -> None:
        super().__init__(config, dtype)
        self.graphs = nn.ModuleDict({f"{h}x{w}": v for (h, w), v in graphs.items()})
        self.batch = batch

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_attention_mask: torch.Tensor | None = None, return_dict: bool = False,
                attention_kwargs: Mapping[str, Any] | None = None, **_: Any) -> tuple[torch.Tensor]:
        if attention_kwargs:
            raise RuntimeError(f"attention_kwargs {dict(attention_kwargs)} cannot change a compiled graph")
        h, w = hidden_states.shape[-2:]
        graph = _pick(self.graphs, f"{h}x{w}", "transformer (latent height x width)")
        if encoder_attention_mask is None:
            encoder_attention_mask = hidden_states.new_ones(encoder_hidden_states.shape[:2], dtype=torch.long)
        out = _run_padded(graph, self.batch, hidden_states.to(self.dtype), encoder_hidden_states.to(self.dtype),
                          timestep.to(self.dtype), encoder_attention_mask.long())
        return (out,)


class CompiledVae(_Compiled):
    """``vae`` for SanaPipeline: ``decode`` with the graph compiled for the latents' size."""

    def __init__(self, graphs: Mapping[tuple[int, int], nn.Module], *, config: Mapping[str, Any],
                 dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.graphs = nn.ModuleDict({f"{h}x{w}": v for (h, w), v in graphs.items()})

    def decode(self, z: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        h, w = z.shape[-2:]
        graph = _pick(self.graphs, f"{h}x{w}", "VAE decoder (latent height x width)")
        return (_run_padded(graph, 1, z.to(self.dtype)),)
