"""Load a model directory into ONE ``SanaPipeline`` and generate images with it.

A model directory (what SageMaker extracts ``model.tar.gz`` into, ``/opt/ml/model``; or any
local directory) holds:

- ``export/``: the serving export (training/serve/export.py): configs, tokenizer, scheduler,
  ``serving.json``, and the weights unless the package was made for a compiled target;
- ``compiled/`` (optional): graphs + ``manifest.json`` from ``python -m training.serve.compile``.

A bare serving export (``serving.json`` at the top) is accepted too, for local use.

Backends, one sampling loop (diffusers' ``SanaPipeline.__call__``):

- ``compiled``: the three graphs behind the stand-ins of training/serve/components.py. Neuron
  targets need torch-neuronx (the Neuron inference DLC has it); ``cpu`` graphs run anywhere.
- ``diffusers``: ``SanaPipeline.from_pretrained(export)`` on CUDA when there is a GPU (the
  serving dtype, bf16 by default), else on CPU in fp32.

``SANA_SERVE_BACKEND`` = ``auto`` (default: compiled when ``compiled/`` exists, else diffusers),
``compiled`` or ``diffusers``. Every failure while loading becomes a ``ModelLoadError`` whose
one line names the path and the fix; the server reports it on ``/ping``.

Concurrency: ``SanaPipeline`` keeps per-call state on itself (``_guidance_scale``,
``_num_timesteps``, the scheduler's step index), so one pipeline runs one request at a time:
``generate`` holds ``Served.lock`` for the whole call. Requests wait for it in the server's
bounded queue (training/serve/server.py) or in TorchServe's per-worker queue on SageMaker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from training.serve.errors import ModelLoadError
from training.serve.spec import SPEC_FILE, GenerateRequest, ServingSpec

log = logging.getLogger(__name__)
BACKEND_ENV = "SANA_SERVE_BACKEND"
BACKENDS = ("auto", "compiled", "diffusers")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclasses.dataclass(kw_only=True)
class Served:
    """A loaded model: the pipeline, what it serves, and the lock one request holds."""

    pipe: Any
    spec: ServingSpec
    backend: str  # "compiled-<target>" | "diffusers-cuda" | "diffusers-cpu"
    model_dir: Path
    load_seconds: float
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "sizes": [str(s) for s in self.spec.sizes], "model_dir": str(self.model_dir),
                "load_seconds": round(self.load_seconds, 2), "max_steps": self.spec.limits.max_steps}


def locate(model_dir: Path) -> tuple[Path, Path | None]:
    """(serving export, compiled dir or None) inside ``model_dir``."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir}: missing; SageMaker extracts model.tar.gz there "
                             "(check ModelDataUrl), locally pass --model-dir DIR")
    export = model_dir / "export" if (model_dir / "export").is_dir() else model_dir
    if not (export / SPEC_FILE).is_file():
        raise ModelLoadError(f"{export}: no {SPEC_FILE}; package with python -m training.serve.package "
                             "(or point at a serving export from python -m training.serve.export)")
    compiled = model_dir / "compiled"
    return export, compiled if compiled.is_dir() else None


def _read_spec(export: Path) -> ServingSpec:
    try:
        return ServingSpec.read(export)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{export / SPEC_FILE}: unreadable ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); re-package the model") from None


def quiet_loading() -> None:
    """No tqdm bars from diffusers/transformers while loading (they would fill logs and stderr)."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def load(model_dir: Path, *, backend: str | None = None) -> Served:
    """The model in ``model_dir`` as a ready pipeline (see the module docstring)."""
    started = time.perf_counter()
    quiet_loading()
    backend = backend or os.environ.get(BACKEND_ENV, "auto")
    if backend not in BACKENDS:
        raise ModelLoadError(f"{BACKEND_ENV}={backend!r}: choose {', '.join(BACKENDS)}")
    export, compiled = locate(Path(model_dir))
    spec = _read_spec(export)
    if backend == "compiled" and compiled is None:
        raise ModelLoadError(f"{BACKEND_ENV}=compiled but {model_dir} has no compiled/ directory; package with --compiled")
    try:
        if compiled is not None and backend in ("auto", "compiled"):
            pipe, spec, name = _load_compiled(export, compiled, spec)
        else:
            pipe, name = _load_diffusers(export, spec)
    except ModelLoadError:
        raise
    except Exception as exc:  # whatever a broken file raises deep inside diffusers/transformers/torch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(f"{model_dir}: cannot load the pipeline ({type(exc).__name__}: {first[:300]}); "
                             "re-package the model from a complete serving export") from None
    pipe.set_progress_bar_config(disable=True)
    # NOTE: deliberate deviation from SanaPipeline's default: it calls xm.mark_step() after every
    # step when torch_xla is importable (pipeline_sana.py XLA_AVAILABLE), and torch-neuronx
    # brings torch_xla along. No backend here runs the pipeline on an XLA device (Neuron graphs
    # take host tensors through the Neuron runtime), so there is nothing to mark and no XLA
    # device to claim.
    import diffusers.pipelines.sana.pipeline_sana as pipeline_sana

    pipeline_sana.XLA_AVAILABLE = False
    served = Served(pipe=pipe, spec=spec, backend=name, model_dir=Path(model_dir),
                    load_seconds=time.perf_counter() - started)
    log.info("serve: loaded %s", json.dumps(served.describe()))
    return served


def _load_diffusers(export: Path, spec: ServingSpec) -> tuple[Any, str]:
    import torch
    from diffusers import SanaPipeline

    from training.serve.components import DTYPES

    for component in ("transformer", "text_encoder", "vae"):
        if not any(p.suffix in WEIGHT_SUFFIXES for p in (export / component).glob("*")):
            raise ModelLoadError(f"{export / component}: no weights (a package made for a compiled target keeps "
                                 "only configs); package without --compiled for a GPU instance")
    cuda = torch.cuda.is_available()
    dtype = DTYPES[spec.dtype] if cuda else torch.float32
    pipe = SanaPipeline.from_pretrained(export, dtype=dtype)
    return pipe.to("cuda" if cuda else "cpu"), "diffusers-cuda" if cuda else "diffusers-cpu"


def _load_compiled(export: Path, compiled: Path, spec: ServingSpec) -> tuple[Any, ServingSpec, str]:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline
    from transformers import AutoTokenizer

    from training.serve.components import DTYPES, CompiledTextEncoder, CompiledTransformer, CompiledVae
    from training.serve.export import recorded_sha256
    from training.serve.manifest import NEURON_TARGETS, CompiledManifest

    manifest = CompiledManifest.load(compiled)
    try:
        source = recorded_sha256(export)
    except Exception:
        source = ""
    if manifest.source_sha256 != source:
        raise ModelLoadError(f"{compiled}: compiled from export sha256 {manifest.source_sha256[:12]}, but {export} "
                             f"is {source[:12] or 'unrecorded'}; re-compile, or package the export it was compiled from")
    if manifest.target in NEURON_TARGETS:
        try:
            import torch_neuronx  # noqa: F401  (registers the Neuron ops torch.jit.load needs)
        except ImportError as exc:
            raise ModelLoadError(f"{compiled}: graphs compiled for {manifest.target}, but torch-neuronx is not "
                                 f"importable ({exc}); serve on an {manifest.target} instance with the Neuron DLC, or "
                                 "package without --compiled for a GPU instance") from None
        os.environ.update(manifest.runtime_env)

    def graphs(component: str) -> dict[str, Any]:
        return {key: torch.jit.load(str(compiled / g.file)).eval() for key, g in manifest.graphs_of(component).items()}

    def config(component: str) -> dict[str, Any]:
        return json.loads((export / component / "config.json").read_text())

    dtype = DTYPES[manifest.dtype]
    lengths = {int(k): v for k, v in graphs("text_encoder").items()}
    latent = {tuple(int(v) for v in key.split("x")): g for key, g in graphs("transformer").items()}
    decoders = {tuple(int(v) for v in key.split("x")): g for key, g in graphs("vae_decoder").items()}
    pipe = SanaPipeline(
        tokenizer=AutoTokenizer.from_pretrained(export / "tokenizer"),
        text_encoder=CompiledTextEncoder(lengths, config=config("text_encoder"), dtype=dtype),
        vae=CompiledVae(decoders, config=config("vae"), dtype=dtype),
        transformer=CompiledTransformer(latent, config=config("transformer"), dtype=dtype,
                                        batch=manifest.transformer_batch),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(export / "scheduler"))
    # What is served is what was compiled (``--shapes``), whatever serving.json listed.
    return pipe, dataclasses.replace(spec, sizes=manifest.sizes), f"compiled-{manifest.target}"


def generate(served: Served, request: GenerateRequest) -> tuple[Any, float]:
    """One image for ``request`` (a PIL image) and the seconds it took, under the model's lock."""
    import torch

    spec = served.spec
    chi = list(spec.complex_human_instruction) if spec.complex_human_instruction else None
    with served.lock:
        started = time.perf_counter()
        generator = torch.Generator("cpu").manual_seed(request.seed)  # the same noise on every target
        with torch.no_grad():
            out = served.pipe(prompt=request.prompt, negative_prompt=request.negative_prompt,
                              height=request.size.height, width=request.size.width,
                              num_inference_steps=request.steps, guidance_scale=request.guidance_scale,
                              generator=generator, max_sequence_length=spec.max_sequence_length,
                              complex_human_instruction=chi, use_resolution_binning=False, output_type="pil")
        return out.images[0], time.perf_counter() - started
