"""``manifest.json`` of a compiled directory: what was compiled, for which target, from what.

Written by ``python -m training.serve.compile`` next to the graphs; read (and checked) by the
handler before anything is loaded, so a missing, truncated or mismatched artefact becomes one
line on ``/ping`` instead of a crash in the first request.

Targets: ``inf2`` / ``trn1`` / ``trn2`` are compiled by ``torch_neuronx.trace`` (neuronx-cc) and
run only where torch-neuronx and a NeuronCore are; ``cpu`` is the same wrappers traced by
``torch.jit.trace``, which is what this repository's tests and demo run. Both produce
TorchScript files loaded with ``torch.jit.load`` (after ``import torch_neuronx`` for Neuron).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.serve.errors import ModelLoadError
from training.serve.spec import Size, parse_size

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
NEURON_TARGETS = ("inf2", "trn1", "trn2")
TARGETS = (*NEURON_TARGETS, "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Graph:
    """One compiled file: which component, for which static input shapes."""

    component: str  # "text_encoder" | "transformer" | "vae_decoder"
    file: str
    key: str  # sequence length ("460") or latent size ("32x32")
    inputs: list[dict[str, Any]]
    sha256: str
    bytes: int
    max_abs_error: float
    tolerance: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledManifest:
    target: str
    dtype: str
    sizes: tuple[Size, ...]
    transformer_batch: int
    text_lengths: dict[str, int]
    graphs: tuple[Graph, ...]
    source_sha256: str
    compiler: str
    compiler_args: list[str]
    runtime_env: dict[str, str]
    versions: dict[str, str]
    created: str
    raw: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def graphs_of(self, component: str) -> dict[str, Graph]:
        return {g.key: g for g in self.graphs if g.component == component}

    @classmethod
    def load(cls, directory: Path, *, verify: bool = True) -> CompiledManifest:
        """Read and check ``directory/manifest.json`` and (``verify``) every graph file's size and
        sha256; ModelLoadError naming the file otherwise."""
        from training.serve.export import sha256_file

        directory = Path(directory)
        path = directory / MANIFEST_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: missing; compile with python -m training.serve.compile") from None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: unreadable ({str(exc).splitlines()[0]}); re-run the compile") from None
        if raw.get("format") != MANIFEST_FORMAT:
            raise ModelLoadError(f"{path}: format {raw.get('format')!r}; this code reads format {MANIFEST_FORMAT}")
        try:
            manifest = cls(
                target=raw["target"], dtype=raw["dtype"], sizes=tuple(parse_size(s, flag="manifest") for s in raw["sizes"]),
                transformer_batch=int(raw["transformer_batch"]), text_lengths={k: int(v) for k, v in raw["text_lengths"].items()},
                graphs=tuple(Graph(**g) for g in raw["graphs"]), source_sha256=raw["source_sha256"],
                compiler=raw["compiler"], compiler_args=list(raw["compiler_args"]), runtime_env=dict(raw["runtime_env"]),
                versions=dict(raw["versions"]), created=raw["created"], raw=raw)
        except (KeyError, TypeError, ValueError, UserError) as exc:
            raise ModelLoadError(f"{path}: malformed ({type(exc).__name__}: {exc}); re-run the compile") from None
        if manifest.target not in TARGETS:
            raise ModelLoadError(f"{path}: target {manifest.target!r} is not one of {', '.join(TARGETS)}")
        for graph in manifest.graphs:
            file = directory / graph.file
            if not file.is_file():
                raise ModelLoadError(f"{file}: missing (listed in {MANIFEST_FILE}); re-run the compile or the package")
            if verify and (file.stat().st_size != graph.bytes or sha256_file(file) != graph.sha256):
                raise ModelLoadError(f"{file}: corrupt (size or sha256 differs from {MANIFEST_FILE}); "
                                     "re-copy the model or re-run the compile")
        for component in ("text_encoder", "transformer", "vae_decoder"):
            if not manifest.graphs_of(component):
                raise ModelLoadError(f"{path}: no {component} graph; re-run the compile")
        return manifest
