"""Text conditioning as Sana trains: CHI on by default, the shards equal what SanaPipeline's
``encode_prompt`` gives (within bf16), and the choice travels index -> checkpoint -> export
-> a later fine-tune, which warns once when its data was encoded otherwise."""

from __future__ import annotations

import inspect
import json
import logging
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from tests.training.cpu_run import train_on_cpu
from training.checkpoint.export import main as export_main
from training.config import config_from_dict, load_yaml
from training.data.index import FeatureIndex
from training.data.precompute import main as precompute
from training.data.shards import write_synthetic_features
from training.data.text_features import (
    SANA_CHI,
    TextConditioning,
    chi_sha256,
    default_complex_human_instruction,
    warn_if_unexpected,
)
from training.model.tiny import TINY_RESOLUTION, build_tiny_components, write_image_caption_folder

REPO = Path(__file__).resolve().parents[3]
N = 16
#: one bf16 step (8 mantissa bits): the shards are bf16, the pipeline's embeddings fp32
BF16 = dict(rtol=2.0**-7, atol=1e-3)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_components(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("raw")
    write_image_caption_folder(out, num=8, seed=5)
    return out


def features(models, raw, out: Path, *extra: str) -> Path:
    precompute(["--input", str(raw), "--out", str(out), "--vae", str(models["vae"]),
                "--text-encoder", str(models["text_encoder"]), "--tokenizer", str(models["tokenizer"]),
                "--resolution", str(TINY_RESOLUTION), "--max-text-tokens", str(N), "--batch-size", "4",
                "--device", "cpu", "--dtype", "fp32", *extra])
    return out


@pytest.fixture(scope="module")
def made(models, raw, tmp_path_factory) -> dict[str, Path]:
    """Feature directories for each --chi (the default, sana, first)."""
    base = tmp_path_factory.mktemp("features")
    return {"sana": features(models, raw, base / "sana"),  # no --chi: the default
            "diffusers": features(models, raw, base / "diffusers", "--chi", "diffusers"),
            "none": features(models, raw, base / "none", "--chi", "none")}


def pipeline(models):
    from diffusers import SanaPipeline
    from transformers import AutoTokenizer, Gemma2Model

    return SanaPipeline(tokenizer=AutoTokenizer.from_pretrained(models["tokenizer"]),
                        text_encoder=Gemma2Model.from_pretrained(models["text_encoder"]).eval(),
                        vae=None, transformer=None, scheduler=None)


def first_sample(out: Path) -> tuple[str, torch.Tensor]:
    with tarfile.open(out / "shard-00000.tar") as tar:
        member = tar.getmembers()[0]
        return member.name.removesuffix(".safetensors"), st_load(tar.extractfile(member).read())["text"]


@pytest.mark.parametrize("chi", ["sana", "diffusers", "none"])
def test_shards_hold_what_sana_pipeline_encode_prompt_gives(models, raw, made, chi):
    """The training captions, the validation prompts and the empty caption, against
    SanaPipeline.encode_prompt with the same complex_human_instruction (the pipeline's
    __call__ default for "diffusers")."""
    pipe = pipeline(models)
    call_default = inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default
    chi_list = {"sana": list(SANA_CHI), "diffusers": list(call_default), "none": None}[chi]
    out = made[chi]
    key, stored = first_sample(out)
    caption = (raw / f"{key}.txt").read_text()
    embeds, mask, neg, neg_mask = pipe.encode_prompt(caption, negative_prompt="", device=torch.device("cpu"),
                                                     max_sequence_length=N, complex_human_instruction=chi_list)
    want = embeds[0][mask[0].bool()]
    assert stored.shape == want.shape  # the same real tokens survive the CHI-aware selection
    torch.testing.assert_close(stored.float(), want.bfloat16().float(), **BF16)

    index = json.loads((out / "index.json").read_text())
    prompts = index["validation"]["prompts"]
    rows = load_file(out / "validation_prompts.safetensors")
    embeds, mask, _, _ = pipe.encode_prompt(prompts, device=torch.device("cpu"), max_sequence_length=N,
                                            complex_human_instruction=chi_list, do_classifier_free_guidance=False)
    for i in range(len(prompts)):
        torch.testing.assert_close(rows[f"{i:04d}"].float(), embeds[i][mask[i].bool()].bfloat16().float(), **BF16)
    null = load_file(out / "null_caption.safetensors")
    # the whole encoding of "" (Sana's null_embed) is the pipeline's negative prompt, all N rows
    torch.testing.assert_close(null["text"].float(), neg[0].bfloat16().float(), **BF16)
    assert torch.equal(null["mask"], neg_mask[0].to(torch.int64))


def test_sana_and_diffusers_instructions_differ_and_are_recorded(made):
    # the one difference: 'Enhanced prompt' in single (diffusers) vs double (Sana) quotes
    assert default_complex_human_instruction() != SANA_CHI
    assert [a == b for a, b in zip(SANA_CHI, default_complex_human_instruction(), strict=True)].count(False) == 1
    assert not torch.equal(first_sample(made["sana"])[1], first_sample(made["diffusers"])[1])
    for chi, out in made.items():
        tc = FeatureIndex.load(out).text_conditioning
        assert tc.chi == chi and tc.max_text_tokens == N
        assert tc.chi_sha256 == {"sana": chi_sha256(SANA_CHI), "none": None,
                                 "diffusers": chi_sha256(default_complex_human_instruction())}[chi]
        assert tc.tokenizer["fingerprint"] == FeatureIndex.load(made["sana"]).text_conditioning.tokenizer["fingerprint"]
        assert tc.text_encoder["num_hidden_layers"] == 1 and tc.text_encoder["path"].endswith("text_encoder")


def test_indexes_without_the_record_read_as_older_or_unknown(tmp_path):
    write_synthetic_features(tmp_path / "synthetic", num_samples=4, text_dim=8)
    assert FeatureIndex.load(tmp_path / "synthetic").text_conditioning.chi == "unknown"
    raw = json.loads((tmp_path / "synthetic" / "index.json").read_text())
    # what the precompute before this change wrote: created_by.complex_human_instruction only
    assert TextConditioning.from_index({**raw, "created_by": {"complex_human_instruction": None}}).chi == "none"
    old = TextConditioning.from_index({**raw, "created_by": {"complex_human_instruction": list(SANA_CHI)}})
    assert old.chi == "sana" and old.chi_sha256 == chi_sha256(SANA_CHI)
    assert TextConditioning.from_dict(old.to_dict()) == old


def test_chi_flag_errors_are_one_line(models, raw, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        features(models, raw, tmp_path / "x", "--chi", "default")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--chi: 'default' is neither sana, diffusers, none" in err


def run_tiny(features_dir: Path, out: Path, **model) -> Path:
    tree = load_yaml(REPO / "training/configs/tiny-cpu.yaml")
    tree.update(max_steps=2, output_dir=str(out), tensorboard=False, log_every=1)
    tree["data"].update(path=str(features_dir), prefetch=0)
    tree["checkpoint"].update(every_steps=2)
    tree["model"].update(model)
    cfg = config_from_dict(tree)
    train_on_cpu(cfg)
    return out / "checkpoints" / "step-00000002"


def test_conditioning_travels_to_checkpoint_and_export_and_a_fine_tune_warns_once(made, tmp_path, caplog):
    recorded = json.loads((made["sana"] / "index.json").read_text())["text_conditioning"]
    ckpt = run_tiny(made["sana"], tmp_path / "scratch")
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["provenance"]["text_conditioning"] == recorded
    export_main([str(ckpt), "--out", str(tmp_path / "export")])
    exported = json.loads((tmp_path / "export" / "text_conditioning.json").read_text())
    assert exported == recorded and exported["complex_human_instruction"] == list(SANA_CHI)

    # Fine-tune the export: same conditioning -> silent; without CHI -> one clear warning.
    with caplog.at_level(logging.WARNING, logger="training"):
        run_tiny(made["sana"], tmp_path / "same", pretrained=str(tmp_path / "export"))
        assert not [r for r in caplog.records if "text conditioning" in r.getMessage()]
        run_tiny(made["none"], tmp_path / "other", pretrained=str(tmp_path / "export"))
    warned = [r.getMessage() for r in caplog.records if "text conditioning" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "expects CHI sana" in warned[0] and "has CHI none" in warned[0] and "--chi sana" in warned[0]


def test_pretrained_without_a_record_is_taken_as_sanas_default(made, tmp_path):
    from diffusers import SanaTransformer2DModel

    from training.model.build import PRESETS

    SanaTransformer2DModel(**PRESETS["tiny"]).save_pretrained(tmp_path / "released")  # like NVlabs' dirs
    model = SanaTransformer2DModel.from_pretrained(tmp_path / "released")
    sana = FeatureIndex.load(made["sana"]).text_conditioning
    diffusers = FeatureIndex.load(made["diffusers"]).text_conditioning
    assert warn_if_unexpected(str(tmp_path / "released"), model, dataclass_with_n(sana, 300), source="s") is None
    msg = warn_if_unexpected(str(tmp_path / "released"), model, diffusers, source="s")
    assert msg and "CHI diffusers" in msg and "--max-text-tokens 300" in msg
    unknown = warn_if_unexpected("p", model, TextConditioning(chi="unknown"), source="s")
    assert unknown and "does not record its text conditioning" in unknown
    assert warn_if_unexpected(None, model, diffusers, source="s") is None  # from scratch: nothing to expect


def dataclass_with_n(tc: TextConditioning, n: int) -> TextConditioning:
    import dataclasses

    return dataclasses.replace(tc, max_text_tokens=n)
