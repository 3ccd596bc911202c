"""Validation images during training: the real loop on the tiny preset, features from the
real precompute (tiny DC-AE / Gemma-2 / tokenizer), images through diffusers' SanaPipeline.

What must hold: a grid PNG per validation step (and in TensorBoard), rendered from the EMA
when kept, equal to what SanaPipeline makes from the prompt *text* with the same CHI; and
training's RNG streams untouched - with validation on, a run and a stopped-and-resumed run
end bit-identical to a run without validation."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import xla_python
from tests.training.cpu_run import train_on_cpu
from training.backends.gpu import GpuBackend
from training.checkpoint.consolidate import load_full
from training.config import config_from_dict, load_yaml
from training.data.loader import FeatureLoader
from training.data.precompute import main as precompute
from training.data.shards import write_synthetic_features
from training.data.text_features import SANA_CHI
from training.errors import UserError
from training.evaluation.validation import (
    NoValidation,
    ValidationConfig,
    build_validation,
    grid,
    preserved_rng,
)
from training.model.tiny import TINY_RESOLUTION, build_tiny_components, write_image_caption_folder

REPO = Path(__file__).resolve().parents[3]
N = 16
PROMPTS = ["a red circle on a blue background", "a small green square", "the dark yellow ring"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_components(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def features(models, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("validation")
    write_image_caption_folder(base / "raw", num=12, seed=7)
    (base / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    precompute(["--input", str(base / "raw"), "--out", str(base / "features"), "--vae", str(models["vae"]),
                "--text-encoder", str(models["text_encoder"]), "--tokenizer", str(models["tokenizer"]),
                "--resolution", str(TINY_RESOLUTION), "--max-text-tokens", str(N), "--device", "cpu",
                "--dtype", "fp32", "--validation-prompts", str(base / "prompts.txt"), "--buckets", "square"])
    return base / "features"


def config(features: Path, out: Path, max_steps: int, **validation):
    tree = load_yaml(REPO / "training/configs/tiny-cpu.yaml")
    tree.update(max_steps=max_steps, output_dir=str(out), tensorboard=True, log_every=2)
    tree["data"].update(path=str(features), prefetch=0)
    tree["checkpoint"].update(every_steps=3, keep_last=5)
    tree["objective"]["caption_dropout"] = 0.3  # the objective's random draws are in play
    tree["ema"] = {"decay": 0.9}
    tree["validation"] = {"num_inference_steps": 2, **validation}
    return config_from_dict(tree)


def run(cfg, resume: str = "none"):
    cfg.checkpoint.resume = resume
    return train_on_cpu(cfg)


def final(out: Path, step: int) -> dict:
    ckpt = out / "checkpoints" / f"step-{step:08d}"
    full = load_full(ckpt)
    optim = full["optimizer"]
    state = json.loads((ckpt / "train_state.json").read_text())
    for volatile in ("config", "provenance", "created_at", "time"):
        state.pop(volatile, None)
    return {"model": full["model"], "ema": full["ema"],
            "optim": {f"{n}/{k}": torch.as_tensor(v) for n, st in optim["state"].items() for k, v in st.items()},
            "state": state}


def assert_bit_identical(got: dict, want: dict) -> None:
    for part in ("model", "ema", "optim"):
        assert got[part].keys() == want[part].keys()
        for key in want[part]:
            assert torch.equal(got[part][key], want[part][key]), f"{part}: {key} differs"
    assert got["state"] == want["state"]


def test_training_with_validation_is_bit_identical_to_without_and_resumes_bit_identically(features, tmp_path):
    run(config(features, tmp_path / "off", 6))
    run(config(features, tmp_path / "on", 6, every_steps=2))
    want = final(tmp_path / "off", 6)
    assert_bit_identical(final(tmp_path / "on", 6), want)
    # Stopped at 3 (a checkpoint) and resumed to 6, validation on throughout.
    run(config(features, tmp_path / "resumed", 3, every_steps=2))
    run(config(features, tmp_path / "resumed", 6, every_steps=2), resume="auto")
    assert_bit_identical(final(tmp_path / "resumed", 6), want)

    pngs = sorted(p.name for p in (tmp_path / "on" / "validation").glob("step-*.png"))
    assert pngs == ["step-00000002.png", "step-00000004.png", "step-00000006.png"]
    assert (tmp_path / "on" / "validation" / "prompts.txt").read_text().splitlines() == PROMPTS
    assert not (tmp_path / "off" / "validation").exists()
    from PIL import Image

    image = np.asarray(Image.open(tmp_path / "on" / "validation" / "step-00000006.png"))
    assert image.shape == (64, 3 * 64 + 2 * 2, 3)  # one row of three 64 px images, 2 px gaps
    cells = [image[:, i * 66:i * 66 + 64] for i in range(3)]
    assert all(c.std() > 0 for c in cells) and not np.array_equal(cells[0], cells[1])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "on" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("validation/grid")] == [2, 4, 6]


def loaded(features: Path, **cfg):
    """A Validation built as the loop builds it, with its model and EMA."""
    from training.metrics import MetricsLogger
    from training.model.build import ModelConfig, build_model
    from training.optim.ema import EMA, EmaConfig

    torch.manual_seed(0)
    backend = GpuBackend(config(features, Path("unused"), 1).gpu, precision="fp32")
    backend.init()
    loader = FeatureLoader(features, batch_size=2, prefetch=0)
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny")))
    ema = EMA(model, EmaConfig(decay=0.5))
    out = cfg.pop("out")
    metrics = MetricsLogger(out, enabled=True, tensorboard=False, total_steps=1)
    validation = build_validation(ValidationConfig(every_steps=1, **{"num_inference_steps": 2, **cfg}), backend,
                                  loader=loader, model=model, output_dir=out, metrics=metrics, flow_shift=3.0)
    return validation, backend, model, ema


def test_render_leaves_every_global_rng_as_it_was(features, tmp_path):
    validation, backend, model, ema = loaded(features, out=tmp_path)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    assert validation.maybe_run(1, model, ema) == tmp_path / "validation" / "step-00000001.png"
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1] and np.array_equal(np.random.get_state()[1], states[2])
    backend.close()
    with preserved_rng(torch.device("cpu")):  # and the guard itself restores what a block draws
        torch.randn(3), random.random(), np.random.rand()
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]


def test_renders_the_ema_when_kept_and_equals_sana_pipeline_prompted_with_text(models, features, tmp_path):
    """...with Sana's flow DPM-Solver (its configs' vis_sampler) as diffusers ships Sana's
    pipelines: scripts/convert_sana_to_diffusers.py ``--scheduler_type flow-dpm_solver``."""
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        FlowMatchEulerDiscreteScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from transformers import AutoTokenizer, Gemma2Model

    validation, backend, model, ema = loaded(features, out=tmp_path, columns=1, num_inference_steps=4)
    with torch.no_grad():  # make the EMA really differ from the weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seen = {}
    render = validation._render
    validation._render = lambda step, weights: seen.setdefault("w", weights) and render(step, weights)
    path = validation.maybe_run(1, model, ema)
    for name, value in ema.state_dict().items():
        assert torch.equal(seen["w"][name], value), name
    backend.close()

    # The same weights, noise and prompts through a SanaPipeline that encodes the prompt text
    # itself with Sana's CHI: the only difference left is the bf16 storage of the embeddings.
    transformer = SanaTransformer2DModel.from_config(validation.model_config)
    transformer.load_state_dict(seen["w"])
    pipe = SanaPipeline(tokenizer=AutoTokenizer.from_pretrained(models["tokenizer"]),
                        text_encoder=Gemma2Model.from_pretrained(models["text_encoder"]),
                        vae=AutoencoderDC.from_pretrained(models["vae"]), transformer=transformer.eval(),
                        scheduler=DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True,
                                                              prediction_type="flow_prediction"))
    pipe.set_progress_bar_config(disable=True)
    from PIL import Image

    rendered = np.asarray(Image.open(path)).astype(np.float32)
    for i, prompt in enumerate(PROMPTS):
        image = pipe(prompt, negative_prompt="", latents=validation.noise[i:i + 1], height=64, width=64,
                     num_inference_steps=4, guidance_scale=4.5, max_sequence_length=N,
                     complex_human_instruction=list(SANA_CHI), use_resolution_binning=False,
                     output_type="np").images[0] * 255
        cell = rendered[i * 66:i * 66 + 64]
        assert np.abs(cell - image).mean() < 1.0 and np.abs(cell - image).max() < 8.0, i
    # ...and without the CHI the pipeline makes visibly other images: the test can tell
    other = pipe(PROMPTS[0], negative_prompt="", latents=validation.noise[:1], height=64, width=64,
                 num_inference_steps=4, guidance_scale=4.5, max_sequence_length=N, complex_human_instruction=None,
                 use_resolution_binning=False, output_type="np").images[0] * 255
    assert np.abs(rendered[:64] - other).mean() > 2.0
    # ...and the flow-matching Euler sampler makes other images from the same inputs
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler = pipe(PROMPTS[0], negative_prompt="", latents=validation.noise[:1], height=64, width=64,
                 num_inference_steps=4, guidance_scale=4.5, max_sequence_length=N,
                 complex_human_instruction=list(SANA_CHI), use_resolution_binning=False,
                 output_type="np").images[0] * 255
    assert np.abs(rendered[:64] - euler).mean() > 2.0


def test_configuration_mistakes_are_one_line(features, tmp_path):
    assert isinstance(build_validation(ValidationConfig(), None, loader=None, model=None, output_dir=tmp_path,
                                       metrics=None, flow_shift=3.0), NoValidation)
    with pytest.raises(UserError, match="validation.prompts: 'a purple cat' was not precomputed"):
        loaded(features, out=tmp_path, prompts=["a purple cat"])
    chosen, backend, _, _ = loaded(features, out=tmp_path, prompts=[PROMPTS[2], PROMPTS[0]])
    backend.close()
    assert chosen.prompts == [PROMPTS[2], PROMPTS[0]] and chosen.chosen == [2, 0]
    write_synthetic_features(tmp_path / "synthetic", num_samples=4, latent_shape=(4, 32, 32), text_dim=8)
    with pytest.raises(UserError, match="holds no precomputed validation prompts; re-run python -m "
                                        "training.precompute --merge-only"):
        loaded(tmp_path / "synthetic", out=tmp_path)
    with pytest.raises(UserError, match="validation.vae: cannot load AutoencoderDC from /nope"):
        loaded(features, out=tmp_path, vae="/nope")
    for bad, message in ((dict(size=48), "validation.size: 48 is not a multiple of 32"),
                         (dict(prompts=["a"], prompts_file="f"), "give prompts or prompts_file, not both"),
                         (dict(dtype="fp16"), "validation.dtype: 'fp16'")):
        with pytest.raises(ValueError, match=message):
            ValidationConfig(**bad)


def test_grid_is_row_major_with_gaps():
    cells = [np.full((2, 3, 3), i, dtype=np.uint8) for i in range(5)]
    out = grid(cells, columns=2, gap=1)
    assert out.shape == (3 * 2 + 2, 2 * 3 + 1, 3)
    assert out[0, 0, 0] == 0 and out[0, 4, 0] == 1 and out[3, 0, 0] == 2 and out[6, 0, 0] == 4
    assert out[2, 0, 0] == 255 and out[6, 4, 0] == 255  # gap row, empty last cell


@pytest.mark.slow
@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
def test_two_ranks_with_validation_do_not_deadlock(features, tmp_path, distributed):
    """Rank 0 renders while rank 1 waits at the barrier (after the weight and EMA gathers,
    collectives under FSDP); both finish, one set of images."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "training.gpu", "--config", str(REPO / "training/configs/tiny-cpu.yaml"),
           "--set", f"data.path={features}", "--set", "data.batch_size=2", "--set", "checkpoint.every_steps=0",
           "--set", "tensorboard=false", "--set", "validation.every_steps=2",
           "--set", "validation.num_inference_steps=2", "--set", "ema.decay=0.9",
           "--set", f"gpu.distributed={distributed}",
           "--max-steps", "4", "--output-dir", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in (tmp_path / "run" / "validation").glob("*.png")) == [
        "step-00000002.png", "step-00000004.png"]


XLA_RUN = """
import hashlib, json, os, sys
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")
import torch
import torch_xla.debug.metrics as met
from training.backends.neuron import NeuronBackend
from training.config import config_from_dict
from training.loop import train

torch.set_num_threads(1)
tree, repeat = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for i in range(repeat):
    tree["output_dir"] = tree["output_dir"] + f"-{i}"
    cfg = config_from_dict(tree)
    backend = NeuronBackend(cfg.trainium, precision=cfg.precision)
    backend.init()
    before = (met.metric_data("CompileTime") or [0])[0]
    result = train(cfg, backend)
    state = backend.model_state_dict(result.model)
    out.setdefault("sha", hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest())
    out["compiles"] = (met.metric_data("CompileTime") or [0])[0] - before
    backend.close()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_on_xla_validation_renders_on_the_host_and_changes_nothing_in_training(features, tmp_path):
    """The Trainium backend on torch-xla's CPU device (.venv-xla): a run with validation ends
    bit-identical to one without (the XLA seed survives the render's mark_steps), and once the
    step graph is compiled a validated run compiles nothing new."""
    python = xla_python()
    tree = load_yaml(REPO / "training/configs/tiny-cpu.yaml")
    tree.update(max_steps=4, tensorboard=False, log_every=2)
    tree["data"].update(path=str(features), prefetch=0)
    tree["checkpoint"].update(every_steps=0, resume="none")
    tree["ema"] = {"decay": 0.9}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PJRT_DEVICE": "CPU"}
    results = {}
    for name, every, repeat in (("off", 0, 1), ("on", 2, 2)):
        tree["output_dir"] = str(tmp_path / name)
        tree["validation"] = {"every_steps": every, "num_inference_steps": 2}
        proc = subprocess.run([str(python), "-c", XLA_RUN, json.dumps(tree), str(repeat)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[name] = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert results["on"]["sha"] == results["off"]["sha"]
    assert results["on"]["compiles"] == 0  # the second validated run, graph cache warm
    assert sorted(p.name for p in (tmp_path / "on-0" / "validation").glob("*.png")) == [
        "step-00000002.png", "step-00000004.png"]


def test_a_lora_run_with_validation_renders_the_adapted_model(features, tmp_path):
    """validation.every_steps on a LoRA run: the gathered weights carry PEFT's names
    (``...base_layer.weight``, ``...lora_A.default.weight``), so the render copy carries the
    same adapters; what it draws equals the adapter merged into the base weights (what
    ``export --lora-merge`` writes) and differs from the base alone."""
    from training.metrics import MetricsLogger
    from training.model.lora import LoraConfig, is_adapter_key, merged_state_dict

    cfg = config(features, tmp_path / "run", 4, every_steps=2)
    cfg.lora = LoraConfig(rank=2, alpha=4.0)
    result = run(cfg)
    assert result.steps == 4
    assert sorted(p.name for p in (tmp_path / "run" / "validation").glob("step-*.png")) == [
        "step-00000002.png", "step-00000004.png"]

    model = result.model
    with torch.no_grad():  # adapters far from zero, so base and base + adapter draw visibly apart
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn_like(p))
    backend = GpuBackend(cfg.gpu, precision="fp32")
    backend.init()
    loader = FeatureLoader(features, batch_size=2, prefetch=0)
    metrics = MetricsLogger(tmp_path / "m", enabled=True, tensorboard=False, total_steps=1)

    def render(weights, lora, name):
        validation = build_validation(ValidationConfig(every_steps=1, num_inference_steps=2, use_ema=False),
                                      backend, loader=loader, model=model, output_dir=tmp_path / name,
                                      metrics=metrics, flow_shift=3.0, lora=lora)
        from PIL import Image

        return np.asarray(Image.open(validation._render(1, weights))).astype(np.float32)

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    adapted = render(state, cfg.lora, "adapted")
    merged = render(merged_state_dict(model), None, "merged")
    base = render({k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter_key(k)}, None,
                  "base")
    backend.close()
    assert np.abs(adapted - merged).max() <= 2.0  # uint8 rounding of (almost) the same image
    assert np.abs(adapted - base).mean() > 10 * max(np.abs(adapted - merged).mean(), 0.1)
