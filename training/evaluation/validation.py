"""Validation images during training: fixed prompts, fixed noise, rendered by ``SanaPipeline``.

Every ``validation.every_steps`` optimizer steps the loop calls ``maybe_run`` on every rank:

1. every rank joins the collectives that gather the full weights (``backend.model_state_dict``,
   and the EMA's ``state_dict`` when one is kept: EMA weights are what Sana samples from);
2. rank 0 alone loads them into its own copy of the transformer and renders the prompts
   through diffusers' ``SanaPipeline`` with the precomputed prompt embeddings
   (``prompt_embeds=`` / ``negative_prompt_embeds=``: no text encoder in training, and the
   same CHI / N as the training captions because precompute encoded both) and the DC-AE
   the data was encoded with; there is no collective inside the render, so it cannot
   deadlock the other ranks;
3. every rank meets at ``backend.barrier()`` and training goes on.

The grid goes to ``<output_dir>/validation/step-XXXXXXXX.png`` and to TensorBoard
(``validation/grid``). The noise is drawn once from the validation's own
``torch.Generator(seed)``, and the render runs inside a saved-and-restored RNG state (CPU,
CUDA, Python, NumPy), so training's random streams - and with them bit-identical resume -
do not depend on whether validation is on (tests/training/evaluation/test_validation.py). The
backend's device RNG (CUDA, or XLA's seed, which diffusers' per-step ``xm.mark_step()``
would otherwise advance on Trainium) is saved and restored around the render as well.

Where it renders: on the GPU backend, on the training GPU (the copy moves there for the
render and back to host memory after). On Trainium it renders on the host CPU, from a CPU
copy of the weights: nothing of it enters the XLA step graph (the weights come to the host
through the same gather a checkpoint uses). A 1.6B model at 1024 px on CPU takes minutes:
keep ``num_inference_steps``, the prompt count or ``size`` small there.

Sana's own training does the same (NVlabs/Sana train_scripts/train.py ``log_validation``:
precomputed prompt embeddings, the null embedding as the unconditional input, CFG 4.5,
``eval_sampling_steps: 500`` in its configs) but draws its noise from the global RNG.

The sampler is Sana's ``vis_sampler: flow_dpm-solver`` (every config in NVlabs Sana
configs/sana_config/; train.py runs it with ``steps=20, order=2, method="multistep",
skip_type="time_uniform_flow", flow_shift=config.scheduler.flow_shift``), in diffusers'
form: ``DPMSolverMultistepScheduler(flow_shift=..., use_flow_sigmas=True,
prediction_type="flow_prediction")``, exactly the scheduler diffusers'
scripts/convert_sana_to_diffusers.py ships Sana's pipelines with (its default
``--scheduler_type flow-dpm_solver``; solver_order 2, multistep). ``sampler: flow_euler``
picks Sana's other one (``FlowMatchEulerDiscreteScheduler(shift=...)``, the convert script's
``flow-euler``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.errors import UserError

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: Sana's ``scheduler.vis_sampler`` names (the flow ones)
SAMPLERS = ("flow_dpm-solver", "flow_euler")


def sana_scheduler(sampler: str, flow_shift: float) -> Any:
    """The diffusers scheduler for Sana's ``vis_sampler`` ``sampler`` at ``flow_shift``, as
    diffusers scripts/convert_sana_to_diffusers.py builds it (see the module docstring)."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    if sampler == "flow_dpm-solver":
        return DPMSolverMultistepScheduler(flow_shift=flow_shift, use_flow_sigmas=True,
                                           prediction_type="flow_prediction")
    if sampler == "flow_euler":
        return FlowMatchEulerDiscreteScheduler(shift=flow_shift)
    raise ValueError(f"sampler {sampler!r}: choose one of {', '.join(SAMPLERS)}")


@dataclasses.dataclass(kw_only=True)
class ValidationConfig:
    """The ``validation`` section of TrainConfig: images every N steps (0 = off)."""

    #: render every N optimizer steps (Sana's configs: 500); 0 = off
    every_steps: int = 0
    #: which of the prompts precompute encoded (index.json validation.prompts); [] = all of them
    prompts: list[str] = dataclasses.field(default_factory=list)
    #: or a file with one such prompt a line (not both)
    prompts_file: str = ""
    #: the fixed noise: torch.Generator seed (the same images every time at the same weights)
    seed: int = 0
    #: Sana's vis_sampler: "flow_dpm-solver" (DPM-Solver++ order 2 on flow sigmas, Sana's
    #: configs) or "flow_euler"
    sampler: str = "flow_dpm-solver"
    #: sampling steps per image (Sana's flow_dpm-solver: 20)
    num_inference_steps: int = 20
    #: classifier-free guidance scale (Sana: 4.5); the negative is the precomputed empty caption
    guidance_scale: float = 4.5
    #: square image side in pixels; 0 = the training latents' size times the VAE's compression
    size: int = 0
    #: AutoencoderDC directory (local or s3://); "" = the --vae index.json says precompute used
    vae: str = ""
    #: render from the EMA weights when the run keeps an EMA
    use_ema: bool = True
    #: precision of the render copy and the VAE: fp32 or bf16
    dtype: str = "fp32"
    #: images per grid row
    columns: int = 4

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError("validation.every_steps: must be >= 0 (0 = off)")
        if not isinstance(self.prompts, list) or not all(isinstance(p, str) for p in self.prompts):
            raise ValueError("validation.prompts: must be a list of prompt strings")
        if self.prompts and self.prompts_file:
            raise ValueError("validation.prompts: give prompts or prompts_file, not both")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"validation.sampler: {self.sampler!r}; choose {' or '.join(SAMPLERS)}")
        if self.num_inference_steps < 1:
            raise ValueError("validation.num_inference_steps: must be >= 1")
        if self.guidance_scale < 0:
            raise ValueError("validation.guidance_scale: must be >= 0 (<= 1 turns guidance off)")
        if self.size < 0 or self.size % 32:
            raise ValueError(f"validation.size: {self.size} is not a multiple of 32 (0 = the training size)")
        if self.dtype not in DTYPES:
            raise ValueError(f"validation.dtype: {self.dtype!r}; choose {' or '.join(DTYPES)}")
        if self.columns < 1:
            raise ValueError("validation.columns: must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0


class NoValidation:
    """Validation off: the loop's per-step call does nothing."""

    def maybe_run(self, step: int, model: nn.Module, ema: Any) -> Path | None:
        return None


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Run a block without moving any global RNG: CPU and (if used) CUDA generators, Python
    ``random`` and NumPy are restored afterwards, whatever the block drew (e.g. the random
    init of ``from_config``)."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def grid(images: list[Any], columns: int, gap: int = 2) -> Any:
    """Equal-size HWC uint8 arrays -> one HWC uint8 grid, ``columns`` per row, row-major,
    ``gap`` white pixels between cells (so noise-like images still read as separate)."""
    import numpy as np

    h, w, c = images[0].shape
    columns = min(columns, len(images))
    rows = math.ceil(len(images) / columns)
    out = np.full((rows * (h + gap) - gap, columns * (w + gap) - gap, c), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, columns)
        y, x = r * (h + gap), col * (w + gap)
        out[y:y + h, x:x + w] = image
    return out


def _selected_prompts(cfg: ValidationConfig, available: list[str], source: str) -> list[int]:
    wanted = cfg.prompts
    if cfg.prompts_file:
        try:
            wanted = [line.strip() for line in Path(cfg.prompts_file).read_text().splitlines() if line.strip()]
        except OSError as exc:
            raise UserError(f"validation.prompts_file: cannot read {cfg.prompts_file} ({exc.strerror})") from None
    if not available:
        raise UserError(f"validation.every_steps: data.path {source} holds no precomputed validation prompts; "
                        "re-run python -m training.precompute --merge-only (same flags; --validation-prompts FILE) "
                        "to add them, or set validation.every_steps=0")
    if not wanted:
        return list(range(len(available)))
    missing = [p for p in wanted if p not in available]
    if missing:
        raise UserError(f"validation.prompts: {missing[0]!r} was not precomputed in {source} (it has "
                        f"{len(available)}: {available[0]!r}, ...); pick from index.json validation.prompts or "
                        "re-run precompute --merge-only --validation-prompts FILE")
    return [available.index(p) for p in wanted]


class Validation:
    """Validation on. Built on every rank (so a config mistake fails everywhere before step 0);
    only rank 0 holds the VAE, the embeddings and the render copy."""

    def __init__(self, cfg: ValidationConfig, backend: Any, *, loader: Any, model: nn.Module, output_dir: str | Path,
                 metrics: Any, flow_shift: float, lora: Any = None) -> None:
        from training.data.shards import VALIDATION_PROMPTS

        self.cfg, self.backend, self.metrics, self.flow_shift = cfg, backend, metrics, flow_shift
        #: a LoRA run's adapters (training/model/lora.py LoraConfig): the render copy gets the same ones,
        #: so the gathered weights (PEFT names: ``...to_q.base_layer.weight``, ``...lora_A.default
        #: .weight``) load strictly and the copy computes what the trained model computes
        self.lora = lora if lora is not None and lora.enabled else None
        index = loader.index
        self.chosen = _selected_prompts(cfg, index.validation_prompts, index.source)
        self.prompts = [index.validation_prompts[i] for i in self.chosen]
        self.model_config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
        self.dir = Path(output_dir) / "validation"
        # Trainium: the host CPU, never the XLA device (see the module docstring).
        self.device = backend.device if backend.device.type in ("cuda", "cpu") else torch.device("cpu")
        self.dtype = DTYPES[cfg.dtype]
        self._transformer: nn.Module | None = None
        if not backend.is_main:
            return
        from safetensors.torch import load as st_load

        n_max, dim = index.max_text_tokens, index.text_dim
        stored = st_load(loader.fetch(VALIDATION_PROMPTS).read_bytes())
        self.embeds = torch.zeros(len(self.chosen), n_max, dim)
        self.masks = torch.zeros(len(self.chosen), n_max, dtype=torch.int64)
        for row, i in enumerate(self.chosen):
            text = stored[f"{i:04d}"]
            self.embeds[row, :text.shape[0]] = text.float()
            self.masks[row, :text.shape[0]] = 1
        self.null, self.null_mask = loader.null_caption()
        self.vae = self._load_vae(index)
        scale = 2 ** (len(self.vae.config.encoder_block_out_channels) - 1)  # as SanaPipeline computes it
        c, h, w = index.latent_shape
        self.size = (cfg.size, cfg.size) if cfg.size else (h * scale, w * scale)
        if self.size[0] % scale or self.size[0] % 32 or self.size[1] % 32:
            if cfg.size:
                raise UserError(f"validation.size: {cfg.size} must be a multiple of 32 and of the VAE's {scale}x")
            raise UserError(f"validation.size: 0 renders at the features' main bucket, {self.size[0]}x{self.size[1]} px, "
                            f"which is not a multiple of 32; set validation.size to a multiple of 32 and of {scale}")
        noise = torch.Generator().manual_seed(cfg.seed)
        self.noise = torch.randn(len(self.chosen), c, self.size[0] // scale, self.size[1] // scale, generator=noise)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "prompts.txt").write_text("".join(f"{p}\n" for p in self.prompts))
        log.info("validation: %d prompts every %d steps -> %s (rendered on %s)", len(self.prompts),
                 cfg.every_steps, self.dir, self.device)

    def _load_vae(self, index: Any) -> nn.Module:
        from diffusers import AutoencoderDC

        from training import s3
        source = self.cfg.vae or (index.raw.get("created_by") or {}).get("vae")
        if not source:
            raise UserError(f"validation.vae: data.path {index.source} does not record the VAE it was encoded "
                            "with; set validation.vae to that AutoencoderDC directory")
        local = Path(source)
        if s3.is_s3_url(source):
            import hashlib
            import os

            cache = Path(os.environ.get("SANA_CACHE_DIR", Path.home() / ".cache" / "sana"))
            local = s3.sync_down(source, cache / "vae" / hashlib.sha256(source.encode()).hexdigest()[:16])
        try:
            with preserved_rng(torch.device("cpu")):
                vae = AutoencoderDC.from_pretrained(local, torch_dtype=self.dtype).eval().requires_grad_(False)
        except (OSError, ValueError) as exc:
            raise UserError(f"validation.vae: cannot load AutoencoderDC from {source} ({str(exc).splitlines()[0]}); "
                            "set validation.vae to the DC-AE the features were made with") from None
        if abs(float(vae.config.scaling_factor) - index.vae_scaling_factor) > 1e-6 or (
                vae.config.latent_channels != index.latent_shape[0]):
            raise UserError(f"validation.vae: {source} (scaling {vae.config.scaling_factor}, "
                            f"{vae.config.latent_channels} channels) is not the VAE of {index.source} (scaling "
                            f"{index.vae_scaling_factor}, {index.latent_shape[0]} channels); point it at that one")
        return vae

    def maybe_run(self, step: int, model: nn.Module, ema: Any) -> Path | None:
        """At every ``every_steps``-th step: gather (all ranks), render (rank 0), barrier."""
        if step % self.cfg.every_steps:
            return None
        # The device RNG, through the backend's own save/restore (what a checkpoint keeps), on
        # every rank and around the gather and barrier too: on Trainium every xm.mark_step()
        # advances the XLA seed, diffusers' pipeline marks one step per denoising step when
        # torch_xla is importable (pipeline_sana.py XLA_AVAILABLE), and on XLA CPU restoring
        # around the render alone still changed the training noise (measured; the test
        # test_on_xla_validation_renders_on_the_host_and_changes_nothing_in_training).
        device_rng = self.backend.rng_state()
        weights = self.backend.model_state_dict(model)  # collective under FSDP
        if ema is not None and self.cfg.use_ema:
            weights.update(ema.state_dict())  # collective under FSDP; buffers stay the model's
        path = self._render(step, weights) if self.backend.is_main else None
        self.backend.barrier()
        self.backend.set_rng_state(device_rng)
        return path

    @torch.no_grad()
    def _render(self, step: int, weights: dict[str, torch.Tensor]) -> Path:
        from diffusers import SanaPipeline, SanaTransformer2DModel
        from PIL import Image

        started = time.perf_counter()
        with preserved_rng(self.device):
            if self._transformer is None:  # its random init draws from the (restored) global RNG
                self._transformer = SanaTransformer2DModel.from_config(self.model_config)
                if self.lora is not None:
                    from training.model.lora import apply_lora

                    apply_lora(self._transformer, self.lora)
                self._transformer.eval().requires_grad_(False)
                for tensor in [*self._transformer.parameters(), *self._transformer.buffers()]:
                    if tensor.is_floating_point():  # (ModelMixin.to(dtype) warns about fp32-pinned modules)
                        tensor.data = tensor.data.to(self.dtype)
            transformer = self._transformer
            transformer.load_state_dict(weights, strict=True)  # casts into the copy's dtype
            transformer.to(self.device)
            self.vae.to(self.device)
            # Sana's vis sampler at the training flow shift (a fresh scheduler: it keeps step state).
            # No tokenizer / text encoder: the embeddings are given, so encode_prompt encodes nothing.
            pipe = SanaPipeline(tokenizer=None, text_encoder=None, vae=self.vae, transformer=transformer,
                                scheduler=sana_scheduler(self.cfg.sampler, self.flow_shift))
            pipe.set_progress_bar_config(disable=True)
            images = []
            for i in range(len(self.prompts)):
                out = pipe(prompt=None, negative_prompt=None, prompt_embeds=self.embeds[i:i + 1].to(self.device),
                           prompt_attention_mask=self.masks[i:i + 1].to(self.device),
                           negative_prompt_embeds=self.null[None].to(self.device),
                           negative_prompt_attention_mask=self.null_mask[None].to(self.device),
                           latents=self.noise[i:i + 1].to(self.device), height=self.size[0], width=self.size[1],
                           num_inference_steps=self.cfg.num_inference_steps, guidance_scale=self.cfg.guidance_scale,
                           use_resolution_binning=False, output_type="np")
                images.append((out.images[0] * 255).round().clip(0, 255).astype("uint8"))
            transformer.to("cpu")
            self.vae.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        picture = grid(images, self.cfg.columns)
        path = self.dir / f"step-{step:08d}.png"
        tmp = path.with_name(f".{path.name}.part")
        Image.fromarray(picture).save(tmp, format="PNG")
        tmp.replace(path)
        self.metrics.log_image(step, "validation/grid", picture, path=path)
        log.info("validation: step %d, %d images in %.1f s -> %s", step, len(images),
                 time.perf_counter() - started, path)
        return path


def build_validation(cfg: ValidationConfig, backend: Any, *, loader: Any, model: nn.Module,
                     output_dir: str | Path, metrics: Any, flow_shift: float,
                     lora: Any = None) -> Validation | NoValidation:
    """The loop's validator: ``NoValidation`` when ``every_steps`` is 0 (CONTRIBUTING.md, 3).
    ``lora``: the run's LoraConfig (adapters on the render copy too)."""
    if not cfg.enabled:
        return NoValidation()
    return Validation(cfg, backend, loader=loader, model=model, output_dir=output_dir, metrics=metrics,
                      flow_shift=flow_shift, lora=lora)
