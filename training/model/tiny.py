"""Tiny random VAE, text encoder and tokenizer saved as local model directories, built offline.

    python -m training.model.tiny OUT [--images RAW --num 24]

writes ``OUT/vae``, ``OUT/text_encoder`` and ``OUT/tokenizer`` (and with ``--images`` a folder
of synthetic image + caption pairs in precompute's input layout): the models of the offline
loop in runbooks/data.md. Used by the tests, by ``python -m training.demo`` and by the export
test: the real
classes (diffusers AutoencoderDC, transformers Gemma2Model, a fast tokenizer) at sizes
that run in milliseconds on CPU, so precompute and SanaPipeline run their true code
paths without downloading a single weight. The sizes follow diffusers' own Sana pipeline
tests (tests/pipelines/sana/test_sana.py) and fit the ``tiny`` transformer preset:
4 latent channels, 2x spatial compression (64 px images -> 4x32x32 latents, the preset's
sample_size 32) and caption_channels 8. The tokenizer is a WordLevel vocabulary over a
fixed word list (every caption ``synthetic_caption`` writes is in it, and every word and
punctuation mark of both complex-human-instruction lists, so Sana's and diffusers' CHI
tokenize differently here as they do with Gemma's tokenizer), with Gemma's special-token
ids (<pad>=0, <eos>=1, <bos>=2, <unk>=3) and its "<bos> text" template.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from training.errors import UserError, exits_cleanly

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
COLOURS = ["red", "green", "blue", "yellow", "white", "black", "purple", "orange"]
SHAPES = ["circle", "square", "triangle", "stripe", "cross", "ring"]
WORDS = ["a", "an", "on", "with", "and", "the", "of", "small", "large", "bright", "dark", "background",
         "image", "photo", "picture", "given", "user", "prompt", "enhanced", "description", "generate"]

TINY_VAE = dict(
    in_channels=3, latent_channels=4, attention_head_dim=2,
    encoder_block_types=("ResBlock", "EfficientViTBlock"), decoder_block_types=("ResBlock", "EfficientViTBlock"),
    encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
    encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
    encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
    downsample_block_type="conv", upsample_block_type="interpolate",
    decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
)
TINY_GEMMA = dict(head_dim=16, hidden_size=8, intermediate_size=64, max_position_embeddings=8192,
                  num_attention_heads=2, num_hidden_layers=1, num_key_value_heads=2, initializer_range=0.02)
#: image side for the tiny VAE (2x compression) that gives the tiny preset's 32x32 latents
TINY_RESOLUTION = 64


def build_tokenizer(out_dir: str | Path):
    """A WordLevel fast tokenizer (Gemma-like specials, right padding) saved to ``out_dir``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from training.data.text_features import SANA_CHI, default_complex_human_instruction

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    tok.train_from_iterator([" ".join(COLOURS + SHAPES + WORDS), *SANA_CHI, *default_complex_human_instruction()],
                            trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2, 3]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", padding_side="right", model_max_length=8192)
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_components(out_dir: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """Save ``vae/``, ``text_encoder/`` and ``tokenizer/`` under ``out_dir``; returns their paths.

    Deterministic for a seed (same weights every time), and cheap (well under a second).
    """
    from diffusers import AutoencoderDC
    from transformers import Gemma2Config, Gemma2Model

    out = Path(out_dir)
    paths = {name: out / name for name in ("vae", "text_encoder", "tokenizer")}
    tokenizer = build_tokenizer(paths["tokenizer"])
    torch.manual_seed(seed)
    AutoencoderDC(**TINY_VAE).save_pretrained(paths["vae"])
    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, bos_token_id=2, **TINY_GEMMA)
    config._attn_implementation = "eager"  # Gemma-2 soft-capping: eager is what transformers recommends
    Gemma2Model(config).save_pretrained(paths["text_encoder"])
    return paths


def synthetic_caption(rng: random.Random) -> str:
    size = rng.choice(["small", "large", "bright", "dark"])
    words = [rng.choice(["a", "the"]), size, rng.choice(COLOURS), rng.choice(SHAPES), "on", "a",
             rng.choice(COLOURS), "background"]
    if rng.random() < 0.5:
        words += ["with", "a", rng.choice(COLOURS), rng.choice(SHAPES)]
    return " ".join(words)


def synthetic_image(rng: random.Random, size: int):
    """A PIL image: coloured background with a filled shape (so the VAE sees structure)."""
    from PIL import Image, ImageDraw

    rgb = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40),
           "white": (245, 245, 245), "black": (15, 15, 15), "purple": (140, 50, 170), "orange": (240, 140, 30)}
    img = Image.new("RGB", (size, size), rgb[rng.choice(COLOURS)])
    draw = ImageDraw.Draw(img)
    x0, y0 = rng.randrange(size // 2), rng.randrange(size // 2)
    x1, y1 = x0 + rng.randrange(size // 4, size // 2), y0 + rng.randrange(size // 4, size // 2)
    draw.ellipse((x0, y0, x1, y1), fill=rgb[rng.choice(COLOURS)])
    return img


def write_image_caption_folder(out_dir: str | Path, *, num: int, size: int = 80, seed: int = 0,
                               fmt: str = "png", aspect: float = 1.25) -> list[Path]:
    """``num`` pairs ``<i>.png`` + ``<i>.txt`` (the raw folder layout precompute reads).

    Images are ``size`` x ``size*aspect`` (not square, not the training resolution) so
    the resize + center-crop path runs.
    """
    from PIL import Image

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for i in range(num):
        img = synthetic_image(rng, size).resize((size, int(size * aspect)), Image.BICUBIC)
        path = out / f"{i:06d}.{fmt}"
        img.save(path)
        path.with_suffix(".txt").write_text(synthetic_caption(rng) + "\n")
        paths.append(path)
    return paths


def write_webdataset_tars(out_dir: str | Path, *, num: int, per_tar: int, size: int = 80, seed: int = 0
                          ) -> list[Path]:
    """The same kind of pairs as WebDataset tars (``<key>.jpg`` + ``<key>.txt`` members)."""
    import tarfile

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tars = []
    for t in range(0, num, per_tar):
        path = out / f"raw-{t // per_tar:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(t, min(num, t + per_tar)):
                buf = io.BytesIO()
                synthetic_image(rng, size).save(buf, format="JPEG", quality=90)
                for name, data in ((f"{i:06d}.jpg", buf.getvalue()),
                                   (f"{i:06d}.txt", synthetic_caption(rng).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        tars.append(path)
    return tars


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    p = argparse.ArgumentParser(prog="python -m training.model.tiny", description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory for vae/, text_encoder/ and tokenizer/")
    p.add_argument("--images", help="also write synthetic image + .txt caption pairs here (precompute's input)")
    p.add_argument("--num", type=int, default=24, help="how many pairs with --images (default 24)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num < 1:
        raise UserError(f"--num: must be >= 1, got {args.num}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory; give a directory for the tiny models")
    paths = build_tiny_components(out, seed=args.seed)
    if args.images:
        write_image_caption_folder(args.images, num=args.num, seed=args.seed)
        paths = {**paths, "images": Path(args.images)}
    print(json.dumps({name: str(path) for name, path in paths.items()}), flush=True)
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
