"""Precompute with tiny offline models: Sana's token rule, end to end, resume, ranks, S3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import boto3
import pytest
import torch
from safetensors.torch import load as st_load

from training.data.loader import FeatureLoader
from training.data.precompute import main, preprocess
from training.data.text_features import (
    SANA_CHI,
    chi_sha256,
    encode_captions,
    encode_for_shards,
    null_caption,
    resolve_chi,
)
from training.errors import UserError
from training.model.tiny import (
    TINY_RESOLUTION,
    build_tiny_components,
    write_image_caption_folder,
    write_webdataset_tars,
)

REPO = Path(__file__).resolve().parents[3]
N = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_components(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def loaded(models):
    from diffusers import AutoencoderDC
    from transformers import AutoTokenizer, Gemma2Model

    return (AutoencoderDC.from_pretrained(models["vae"]).eval(), Gemma2Model.from_pretrained(models["text_encoder"]).eval(),
            AutoTokenizer.from_pretrained(models["tokenizer"]))


def args(models, inp, out, *extra) -> list[str]:
    """The CLI for the tiny models; square crops unless ``extra`` picks --buckets (the default
    is Sana's multi-scale buckets: test_default_is_sanas_multi_scale_buckets)."""
    square = () if "--buckets" in extra else ("--buckets", "square")
    return ["--input", str(inp), "--out", str(out), "--vae", str(models["vae"]), "--text-encoder",
            str(models["text_encoder"]), "--tokenizer", str(models["tokenizer"]), "--resolution",
            str(TINY_RESOLUTION), "--max-text-tokens", str(N), "--batch-size", "3", *square, *extra]


@pytest.mark.parametrize("chi", ["none", "sana", "diffusers"])
def test_embeddings_match_sana_pipeline(loaded, chi):
    """Our selection of tokens is SanaPipeline.encode_prompt's, for prompts and the empty caption."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    vae, text_encoder, tokenizer = loaded
    transformer = SanaTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=1,
                                         num_attention_heads=2, attention_head_dim=4, num_cross_attention_heads=2,
                                         cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
                                         sample_size=32)
    pipe = SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler())
    chi_list = list(resolve_chi(chi) or []) or None
    # the second caption is longer than N: truncation keeps <bos> + the last N-1 positions
    prompts = ["A Red circle on a blue background ", " ".join(["a small green square"] * 6)]
    embeds, mask, neg, neg_mask = pipe.encode_prompt(prompts, do_classifier_free_guidance=True, negative_prompt="",
                                                     device=torch.device("cpu"), max_sequence_length=N,
                                                     complex_human_instruction=chi_list)
    ours, our_mask = encode_captions(prompts, tokenizer, text_encoder, max_tokens=N,
                                     complex_human_instruction=chi_list, caption_text="diffusers")
    assert torch.equal(our_mask.cpu(), mask.cpu())
    assert torch.equal(ours[mask.bool()], embeds[mask.bool()])
    rows = encode_for_shards(prompts, tokenizer, text_encoder, max_tokens=N, complex_human_instruction=chi_list,
                             caption_text="diffusers")
    assert [r.shape[0] for r in rows] == mask.sum(1).tolist()
    assert mask[1].sum() == N if chi_list else True  # the long caption fills all N
    null = encode_for_shards([""], tokenizer, text_encoder, max_tokens=N)[0]
    assert null.shape == (1, 8) and torch.equal(null, neg[0, :1])
    assert neg_mask[0].tolist() == [1] + [0] * (N - 1)
    # the stored null caption is the whole encoding (Sana's null_embed), the pipeline's negative
    full, full_mask = null_caption(tokenizer, text_encoder, max_tokens=N)
    assert full.shape == (N, 8) and torch.equal(full, neg[0]) and torch.equal(full_mask, neg_mask[0])


def test_sana_caption_text_is_the_raw_caption_after_the_chi(loaded):
    """--caption-text sana: NVlabs Sana train_scripts/train.py (gemma branch), step for step:
    ``prompt = [chi_prompt + i for i in batch[1]]`` (no lower-casing), max_length_all =
    CHI tokens + N - 2, right padding, then select_index = [0] + range(-N + 1, 0)."""
    _, text_encoder, tokenizer = loaded
    captions = ["A Red Circle on a BLUE background", "the small square"]
    chi_prompt = "\n".join(SANA_CHI)
    max_length_all = len(tokenizer.encode(chi_prompt)) + N - 2
    tokenizer.padding_side = "right"
    tokens = tokenizer([chi_prompt + c for c in captions], padding="max_length", max_length=max_length_all,
                       truncation=True, return_tensors="pt")
    select = [0] + list(range(-N + 1, 0))
    with torch.no_grad():
        want = text_encoder(tokens.input_ids, attention_mask=tokens.attention_mask)[0][:, select]
    ours, mask = encode_captions(captions, tokenizer, text_encoder, max_tokens=N, complex_human_instruction=SANA_CHI)
    assert torch.equal(mask, tokens.attention_mask[:, select]) and torch.equal(ours, want)
    lowered, _ = encode_captions(captions, tokenizer, text_encoder, max_tokens=N, complex_human_instruction=SANA_CHI,
                                 caption_text="diffusers")
    assert not torch.equal(lowered, ours)  # "Red" / "BLUE" are other tokens than "red" / "blue"


def test_preprocess_resizes_and_center_crops():
    import io

    from PIL import Image

    img = Image.new("RGB", (80, 100), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 80, 10))  # a blue band at the top: cropped away
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    x = preprocess(buf.getvalue(), 64)
    assert x.shape == (3, 64, 64) and x.min() >= -1 and x.max() <= 1
    assert torch.allclose(x[:, 32, 32], torch.tensor([1.0, -1.0, -1.0]))
    assert x[2, 0].max() < 0  # no blue left in the first row


def test_folder_end_to_end_and_resume(models, loaded, tmp_path: Path, capsys):
    raw = tmp_path / "raw"
    write_image_caption_folder(raw, num=10, seed=1)
    (raw / "orphan.png").write_bytes((raw / "000000.png").read_bytes())  # no caption: skipped
    (raw / "broken.png").write_bytes(b"not a png")
    (raw / "broken.txt").write_text("a red ring\n")
    out = tmp_path / "features"
    index = main(args(models, raw, out, "--samples-per-shard", "4"))
    assert index["num_samples"] == 10 and [s["samples"] for s in index["shards"]] == [4, 4, 2]
    assert index["latent_shape"] == [4, 32, 32] and index["text_dim"] == 8 and index["max_text_tokens"] == N
    assert index["created_by"]["skipped"] == 2
    # Sana's CHI by default, and the record of it (tests/training/data/test_text_conditioning.py goes further)
    tc = index["text_conditioning"]
    assert tc["chi"] == "sana" and tc["complex_human_instruction"] == list(SANA_CHI)
    assert tc["chi_sha256"] == chi_sha256(SANA_CHI) and tc["max_text_tokens"] == N
    assert tc["text_encoder"]["hidden_size"] == 8 and len(tc["text_encoder"]["fingerprint"]) == 64
    assert tc["tokenizer"]["vocab_size"] > 100 and len(tc["tokenizer"]["fingerprint"]) == 64
    assert len(index["validation"]["prompts"]) == 6 and (out / "validation_prompts.safetensors").exists()
    assert all(json.loads(p.read_text())["chi_sha256"] == tc["chi_sha256"] for p in out.glob("shard-*.json"))
    captured = capsys.readouterr()
    assert f"{raw / 'orphan.png'}: no caption (orphan.txt missing); skipped" in captured.err
    assert f"{raw / 'broken.png'}: unreadable or corrupt image" in captured.err
    assert index["created_by"]["skipped_reasons"] == {"no caption": 1, "unreadable or corrupt image": 1}
    assert "precompute: skipped 1 images: unreadable or corrupt image" in captured.out
    assert "precompute: skipped 1 images: no caption" in captured.out

    # a shard holds exactly what the models give for that sample (bf16)
    vae, text_encoder, tokenizer = loaded
    with tarfile.open(out / "shard-00000.tar") as tar:
        first = tar.getmembers()[0]
        stored = st_load(tar.extractfile(first).read())
    assert first.name == "000000.safetensors"
    with torch.no_grad():
        latents = vae.encode(preprocess((raw / "000000.png").read_bytes(), 64)[None]).latent[0]
    text = encode_for_shards([(raw / "000000.txt").read_text()], tokenizer, text_encoder, max_tokens=N,
                             complex_human_instruction=SANA_CHI)[0]
    # Precompute encodes a batch, this recomputes one sample: float kernels may differ in the
    # last fp32 bits with batch size and thread count, which can flip a bf16 rounding. So
    # compare within one bf16 step (8 mantissa bits) rather than bit for bit.
    bf16_step = dict(rtol=2.0**-7, atol=1e-3)
    torch.testing.assert_close(stored["latents"].float(), latents.bfloat16().float(), **bf16_step)
    torch.testing.assert_close(stored["text"].float(), text.bfloat16().float(), **bf16_step)
    assert stored["latents"].dtype == stored["text"].dtype == torch.bfloat16

    loader = FeatureLoader(out, batch_size=5, prefetch=0)
    batch = next(loader)
    assert batch["latents"].shape == (5, 4, 32, 32) and batch["text"].shape == (5, N, 8)
    assert loader.null_caption()[1].tolist() == [1] + [0] * (N - 1)

    # resume: shard 1 lost its marker (killed before publishing), index gone
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar")}
    (out / "shard-00001.json").unlink()
    (out / "index.json").unlink()
    again = main(args(models, raw, out, "--samples-per-shard", "4"))
    assert "3 shards in total, 3 mine, 2 already done" in capsys.readouterr().out
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.tar")}
    assert after["shard-00000.tar"] == before["shard-00000.tar"]
    assert after["shard-00002.tar"] == before["shard-00002.tar"]
    assert after["shard-00001.tar"] != before["shard-00001.tar"]
    assert again["shards"] == index["shards"]  # deterministic: the redone shard is byte-identical

    # --merge-only rebuilds the index from the markers alone
    (out / "index.json").unlink()
    assert main(args(models, raw, out, "--samples-per-shard", "4", "--merge-only")) == again


@pytest.mark.slow
def test_two_ranks_under_torchrun(models, tmp_path: Path):
    raw = tmp_path / "raw"
    write_image_caption_folder(raw, num=9, seed=2)
    out = tmp_path / "features"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "training.precompute", *args(models, raw, out, "--samples-per-shard", "2", "--merge-timeout", "120")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0/2: 5 shards in total, 3 mine" in proc.stdout and "rank 1/2: 5 shards in total, 2 mine" in proc.stdout
    index = json.loads((out / "index.json").read_text())
    assert index["num_samples"] == 9 and [s["name"] for s in index["shards"]] == [
        f"shard-{i:05d}.tar" for i in range(5)]
    single = main(args(models, raw, tmp_path / "single", "--samples-per-shard", "2"))
    assert [(s["name"], s["samples"]) for s in single["shards"]] == [(s["name"], s["samples"]) for s in index["shards"]]
    # same samples in the same places (bits may differ: OMP_NUM_THREADS=1 sums in another order)
    for shard in index["shards"]:
        with tarfile.open(out / shard["name"]) as a, tarfile.open(tmp_path / "single" / shard["name"]) as b:
            assert a.getnames() == b.getnames()
            for m in a.getmembers():
                x, y = st_load(a.extractfile(m).read()), st_load(b.extractfile(m.name).read())
                torch.testing.assert_close(x, y)


def test_webdataset_tars_from_and_to_s3(models, s3_bucket: str, tmp_path: Path, capsys):
    s3 = boto3.client("s3")
    for tar in write_webdataset_tars(tmp_path / "raw", num=7, per_tar=4, seed=3):
        s3.upload_file(str(tar), s3_bucket, f"raw/{tar.name}")
    out = f"s3://{s3_bucket}/features/v1"
    index = main(args(models, f"s3://{s3_bucket}/raw/", out, "--work-dir", str(tmp_path / "work")))
    assert index["num_samples"] == 7 and [s["samples"] for s in index["shards"]] == [4, 3]
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="features/v1/")["Contents"])
    assert keys == [f"features/v1/{n}" for n in ("index.json", "null_caption.safetensors", "shard-00000.json",
                                                 "shard-00000.tar", "shard-00001.json", "shard-00001.tar",
                                                 "validation_prompts.safetensors")]
    loader = FeatureLoader(out, batch_size=3, cache_dir=tmp_path / "cache", prefetch=0)
    assert next(loader)["latents"].shape == (3, 4, 32, 32)
    # resume on S3: nothing left to do, index rewritten identically
    capsys.readouterr()
    assert main(args(models, f"s3://{s3_bucket}/raw/", out, "--work-dir", str(tmp_path / "w2"))) == index
    assert "2 shards in total, 2 mine, 2 already done" in capsys.readouterr().out


def test_user_errors_are_one_line(models, tmp_path: Path, capsys, s3_bucket: str):
    write_image_caption_folder(tmp_path / "raw", num=2)
    for argv, message in [
        (args(models, tmp_path / "nope", tmp_path / "o"), "no such directory"),
        (args(models, tmp_path / "o", tmp_path / "o"), "no such directory"),
        (args(models, tmp_path / "raw" / "000000.txt", tmp_path / "o"), "no such directory"),
        (args(models, tmp_path, tmp_path / "o", "--resolution", "100"), "--resolution: 100 is not a multiple of 32"),
        (args(models, tmp_path / "raw", f"s3://{s3_bucket}-missing/x"), "bucket does not exist"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="found no image \\+ .txt caption pairs"):
        main.__wrapped__(args(models, tmp_path / "empty", tmp_path / "o"))
    bad = args(models, tmp_path / "raw", tmp_path / "o")
    bad[bad.index("--vae") + 1] = str(tmp_path / "no-vae")
    with pytest.raises(UserError, match="--vae .*no-vae: no such directory"):
        main.__wrapped__(bad)


def test_shard_with_only_unreadable_images_is_left_out(models, tmp_path: Path):
    raw = tmp_path / "raw"
    write_image_caption_folder(raw, num=2, seed=4)
    (raw / "0-broken.png").write_bytes(b"\x89PNG truncated")
    (raw / "0-broken.txt").write_text("a red ring\n")
    index = main(args(models, raw, tmp_path / "out", "--samples-per-shard", "1"))
    assert [(s["name"], s["samples"]) for s in index["shards"]] == [("shard-00001.tar", 1), ("shard-00002.tar", 1)]
    assert json.loads((tmp_path / "out" / "shard-00000.json").read_text())["skipped"] == ["0-broken"]
    assert next(FeatureLoader(tmp_path / "out", batch_size=2, prefetch=0))["latents"].shape == (2, 4, 32, 32)


def test_buckets_mixed_shapes_skips_and_loader(models, loaded, tmp_path: Path, capsys):
    """--buckets 512 (scaled to the tiny VAE's 64 px): three aspect ratios land in three
    buckets at Sana's sizes, a tiny and a corrupt image are skipped with one summary line
    per reason, each stored latent is the VAE's encoding of the cover-resize + centre crop,
    and every loader batch is one bucket."""
    from training.data.precompute import preprocess_to

    raw = tmp_path / "raw"
    for sub, aspect, num in (("square", 1.0, 5), ("tall", 2.0, 4), ("wide", 0.5, 3)):
        write_image_caption_folder(raw / sub, num=num, size=80 if aspect != 0.5 else 160, aspect=aspect, seed=7)
    write_image_caption_folder(raw / "tiny", num=1, size=12, seed=8)  # 12x12 -> 64x64 is 5.3x > 2x
    (raw / "broken.png").write_bytes(b"\x89PNG truncated")
    (raw / "broken.txt").write_text("a red ring\n")
    out = tmp_path / "features"
    index = main(args(models, raw, out, "--buckets", "512", "--samples-per-shard", "5"))
    # Sana's ASPECT_RATIO_512 "0.5": [352, 704], "1.0": [512, 512], "2.0": [704, 352] px, x 64/512, / 2 (VAE)
    assert index["buckets"] == {"0.5": {"latent_shape": [4, 22, 44], "samples": 3},
                                "1.0": {"latent_shape": [4, 32, 32], "samples": 5},
                                "2.0": {"latent_shape": [4, 44, 22], "samples": 4}}
    assert index["latent_shape"] == [4, 32, 32]  # the most populous bucket
    assert index["created_by"]["skipped_reasons"] == {"too small for its bucket": 1, "unreadable or corrupt image": 1}
    stdout = capsys.readouterr().out
    assert "precompute: skipped 1 images: too small for its bucket" in stdout
    assert "precompute: bucket 2.0: 4 samples, latents 4x44x22" in stdout

    # a stored sample is the VAE's encoding of Sana's resize + crop to its bucket (within one
    # bf16 step: precompute encodes a batch, see test_folder_end_to_end_and_resume)
    vae = loaded[0]
    stored = {}
    for shard in out.glob("shard-*.tar"):
        with tarfile.open(shard) as tar:
            stored.update({m.name: st_load(tar.extractfile(m).read())["latents"] for m in tar.getmembers()})
    for key, size in (("tall__000001", (88, 44)), ("wide__000002", (44, 88)), ("square__000003", (64, 64))):
        with torch.no_grad():
            expected = vae.encode(preprocess_to((raw / key.replace("__", "/")).with_suffix(".png").read_bytes(),
                                                size)[None]).latent[0]
        torch.testing.assert_close(stored[f"{key}.safetensors"].float(), expected.bfloat16().float(),
                                   rtol=2.0**-7, atol=1e-3)

    with FeatureLoader(out, batch_size=3, prefetch=0) as loader:
        shapes = [tuple(next(loader)["latents"].shape) for _ in range(loader.steps_per_epoch)]
    assert sorted(shapes) == [(3, 4, 22, 44), (3, 4, 32, 32), (3, 4, 44, 22)]  # 3//3 + 5//3 + 4//3 steps
