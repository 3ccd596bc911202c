"""What the bf16 paths actually compute, probed in real bf16 on CPU (tiny shapes).

Three promises (issue 12, point 1), each failing on the code before it:
- the linear self-attention's batched matmuls and normaliser run in fp32 under bf16 autocast,
  for a random and a pretrained model, and the exported directory still loads in plain
  diffusers with diffusers' own processor;
- FSDP2 + bf16-mixed hands the time embedding an fp32 timestep (the other float inputs in
  bf16), as DDP + autocast does;
- GPU ``precision: bf16`` is refused with one line naming bf16-mixed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.backends.gpu import GPU_BF16_REFUSED, GpuBackend, GpuConfig
from training.errors import UserError
from training.model.attention import Fp32LinearAttnProcessor
from training.model.build import ModelConfig, build_model

BATCH = dict(hidden_states=(2, 4, 8, 8), encoder_hidden_states=(2, 5, 8))
AUTOCAST = dict(device_type="cpu", dtype=torch.bfloat16)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(*BATCH["hidden_states"], generator=g),
            "encoder_hidden_states": torch.randn(*BATCH["encoder_hidden_states"], generator=g),
            "timestep": torch.tensor([999.0, 3.0])}


class _OpDtypes(TorchDispatchMode):
    """Records (aten op name, input float dtypes) of every op while ``active``: below autocast,
    so it sees the dtypes the kernels really get."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.ops: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            dtypes = tuple(a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point())
            self.ops.append((func._schema.name, dtypes))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _probe_self_attention(model: torch.nn.Module) -> Iterator[_OpDtypes]:
    """Dispatch-level dtypes of the ops inside every block's ``attn1`` (the linear attention)."""
    probe = _OpDtypes()
    handles = []
    for block in model.transformer_blocks:
        handles.append(block.attn1.register_forward_pre_hook(lambda *_: setattr(probe, "active", True)))
        handles.append(block.attn1.register_forward_hook(lambda *_: setattr(probe, "active", False)))
    try:
        with probe:
            yield probe
    finally:
        for h in handles:
            h.remove()


def _kernel_dtypes(probe: _OpDtypes) -> dict[str, set[torch.dtype]]:
    """bmm (the two matmuls) and div (the normaliser) -> the dtypes they ran in."""
    out: dict[str, set[torch.dtype]] = {}
    for name, dtypes in probe.ops:
        if name in ("aten::bmm", "aten::div"):
            out.setdefault(name, set()).update(dtypes)
    return out


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("pretrained")
    build_model(ModelConfig(preset="tiny")).save_pretrained(out)
    return out


@pytest.mark.parametrize("source", ["random", "pretrained"])
def test_linear_attention_runs_in_fp32_under_bf16_autocast(source: str, pretrained_dir: Path) -> None:
    cfg = ModelConfig(preset="tiny", pretrained=str(pretrained_dir) if source == "pretrained" else None)
    model = build_model(cfg)
    assert all(isinstance(b.attn1.processor, Fp32LinearAttnProcessor) for b in model.transformer_blocks)
    with _probe_self_attention(model) as probe, torch.autocast(**AUTOCAST):
        out = model(**_inputs()).sample
    kernels = _kernel_dtypes(probe)
    assert kernels == {"aten::bmm": {torch.float32}, "aten::div": {torch.float32}}
    # the projections around it still autocast (as Sana's qkv/proj Linear layers do)
    assert any(name == "aten::addmm" or name == "aten::mm" for name, _ in probe.ops)
    assert torch.bfloat16 in {d for name, ds in probe.ops if name in ("aten::mm", "aten::addmm") for d in ds}
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_the_probe_sees_diffusers_processor_in_bf16() -> None:
    """The stand-in check: with diffusers' own processor the same probe sees bf16 matmuls,
    which is what the fp32 processor exists to prevent."""
    model = build_model(ModelConfig(preset="tiny", fp32_linear_attention=False))
    with _probe_self_attention(model) as probe, torch.autocast(**AUTOCAST):
        model(**_inputs())
    assert _kernel_dtypes(probe)["aten::bmm"] == {torch.bfloat16}


def test_pure_bf16_model_still_computes_the_attention_in_fp32() -> None:
    """Trainium's precision 'bf16' (bf16 weights, no autocast): fp32 kernels, bf16 output."""
    model = build_model(ModelConfig(preset="tiny")).to(torch.bfloat16)
    inputs = {k: (v if k == "timestep" else v.to(torch.bfloat16)) for k, v in _inputs().items()}
    with _probe_self_attention(model) as probe:
        out = model(**inputs).sample
    assert _kernel_dtypes(probe)["aten::bmm"] == {torch.float32} and out.dtype == torch.bfloat16


def test_fp32_processor_is_diffusers_math_and_the_export_loads_plain(tmp_path: Path) -> None:
    """Processors are not serialized: the saved directory loads with diffusers' processor and
    computes the same output in fp32 (the processor changes precision, not the function)."""
    from diffusers import SanaTransformer2DModel
    from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0

    torch.manual_seed(0)
    ours = build_model(ModelConfig(preset="tiny")).eval()
    ours.save_pretrained(tmp_path)
    plain = SanaTransformer2DModel.from_pretrained(tmp_path).eval()
    assert all(isinstance(b.attn1.processor, SanaLinearAttnProcessor2_0) for b in plain.transformer_blocks)
    with torch.no_grad():
        torch.testing.assert_close(ours(**_inputs()).sample, plain(**_inputs()).sample, rtol=1e-5, atol=1e-6)


def test_fp32_attention_is_closer_to_fp32_than_bf16_matmuls() -> None:
    """What the fp32 kernels buy, at a token count where the N-term sums matter (32x32 latents)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny", overrides=dict(
        attention_head_dim=16, cross_attention_head_dim=16, cross_attention_dim=32))).eval()
    x = {"hidden_states": torch.randn(1, 4, 32, 32), "encoder_hidden_states": torch.randn(1, 5, 8),
         "timestep": torch.tensor([500.0])}
    attn = model.transformer_blocks[0].attn1
    seen: dict[str, torch.Tensor] = {}

    def keep_input(_module, args) -> None:
        seen.setdefault("x", args[0].detach())

    attn.register_forward_pre_hook(keep_input)
    with torch.no_grad():
        model(**x)
        ref = attn(seen["x"])
        errors = {}
        for name, proc in (("fp32", Fp32LinearAttnProcessor()), ("bf16", None)):
            if proc is None:
                from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
                proc = SanaLinearAttnProcessor2_0()
            attn.set_processor(proc)
            with torch.autocast(**AUTOCAST):
                got = attn(seen["x"]).float()
            errors[name] = ((got - ref).norm() / ref.norm()).item()
    assert errors["fp32"] < errors["bf16"]


# ----- FSDP2 and the timestep ---------------------------------------------------------------
def _input_dtypes(backend: GpuBackend) -> dict[str, object]:
    """dtypes arriving at the time embedding, the caption projection and the second block
    (the residual stream between blocks), under the backend's own autocast."""
    torch.manual_seed(0)
    model = backend.prepare_model(build_model(ModelConfig(preset="tiny", overrides={"num_layers": 2})))
    inner = backend.unwrap(model)
    seen: dict[str, object] = {}

    def record(key: str):
        def hook(_module, args):
            seen.setdefault(key, args[0].dtype)
        return hook

    inner.time_embed.register_forward_pre_hook(record("timestep"))
    inner.caption_projection.register_forward_pre_hook(record("caption"))
    inner.transformer_blocks[1].register_forward_pre_hook(record("between_blocks"))
    with backend.autocast():
        loss = model(**_inputs()).sample.float().square().mean()
    loss.backward()
    seen["loss"] = loss.item()
    return seen


def test_fsdp_bf16_mixed_casts_no_fp32_input_and_matches_ddp() -> None:
    """FSDP2's default cast_forward_inputs=True hands the time embedding a bf16 timestep
    (999 -> 1000), and bf16 copies of the scale-shift tables make the residual stream bf16;
    now FSDP + autocast sees the dtypes DDP + autocast sees and computes the same loss."""
    backend = GpuBackend(GpuConfig(distributed="fsdp"), precision="bf16-mixed")
    backend.init()
    try:
        fsdp = _input_dtypes(backend)
    finally:
        backend.close()
    plain = _input_dtypes(GpuBackend(GpuConfig(), precision="bf16-mixed"))
    assert fsdp["timestep"] == plain["timestep"] == torch.float32
    assert fsdp["between_blocks"] == plain["between_blocks"] == torch.float32
    assert fsdp["caption"] == plain["caption"] == torch.float32  # autocast casts inside the Linear
    assert fsdp["loss"] == pytest.approx(plain["loss"], rel=1e-4)


def test_fsdp_root_output_is_its_own_tensor_not_a_view() -> None:
    """diffusers' unpatchify returns a view; FSDP2 hooks the root's output for backward and
    warns that an in-place op on a view would drop that hook. The backend hands out a
    tensor of its own (torch stays silent) in both return forms, and backward still works."""
    import warnings

    backend = GpuBackend(GpuConfig(distributed="fsdp"), precision="bf16-mixed")
    backend.init()
    try:
        torch.manual_seed(0)
        model = backend.prepare_model(build_model(ModelConfig(preset="tiny", overrides={"num_layers": 2})))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with backend.autocast():
                sample = model(**_inputs()).sample
                tup = model(**_inputs(1), return_dict=False)[0]
            (sample.float().square().mean() + tup.float().square().mean()).backward()
    finally:
        backend.close()
    assert not [w for w in caught if "view tensor" in str(w.message)], [str(w.message) for w in caught]
    assert sample._base is None and tup._base is None and sample.is_contiguous()
    assert all(p.grad is not None for p in model.parameters())


def test_gpu_pure_bf16_is_refused_with_one_line() -> None:
    with pytest.raises(UserError) as err:
        GpuBackend(GpuConfig(), precision="bf16")
    assert str(err.value) == GPU_BF16_REFUSED and "\n" not in GPU_BF16_REFUSED
    assert "precision: bf16-mixed" in GPU_BF16_REFUSED
