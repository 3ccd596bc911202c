"""One raw image + caption pair -> (pixels at its bucket's size, caption text), or a Skip.

What precompute (training/data/precompute.py) does per sample, and every way a sample is left
out, each counted under one reason and named by its file in one warning line:

- ``no caption``: an image without its ``.txt`` (or a WebDataset sample without one);
- ``empty caption``: a ``.txt`` holding only whitespace (it would train the model that the
  image means nothing, i.e. as a second null caption);
- ``caption not UTF-8``: a ``.txt`` in another encoding (e.g. Latin-1); decoding it with
  ``errors="replace"`` would train on replacement characters;
- ``unreadable or corrupt image``: what PIL cannot open or decode;
- ``too small for its bucket``: covering the bucket would need more than ``--max-upscale``.

Resize + crop follow NVlabs Sana ``SanaWebDatasetMS.getdata`` (diffusion/data/datasets/
sana_data_multi_scale.py): the nearest-ratio bucket, resized to cover it (training/data/
buckets.py ``cover_resize``) with BICUBIC (LANCZOS for the 2048 table), centre-cropped.
"""

from __future__ import annotations

import io
import re

import torch

from training.data.buckets import cover_resize, nearest_bucket

#: skip reasons, as the summary prints them
UNREADABLE, TOO_SMALL = "unreadable or corrupt image", "too small for its bucket"
NO_CAPTION, EMPTY_CAPTION, NOT_UTF8 = "no caption", "empty caption", "caption not UTF-8"
#: PIL names an in-memory file by its repr (``cannot identify image file <_io.BytesIO object at
#: 0x7f...>``): meaningless to a user, who gets the file's own name in the warning instead
_BYTESIO = re.compile(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


class Skip(Exception):
    """A raw sample that is not used; ``reason`` is the summary line it is counted under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}{f' ({detail})' if detail else ''}")
        self.reason = reason


def caption_text(data: bytes, name: str) -> str:
    """A caption file's bytes -> its text, surrounding whitespace (the file's final newline)
    removed; ``Skip`` when it is not UTF-8 or holds nothing."""
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise Skip(NOT_UTF8, f"{name}: byte 0x{data[exc.start]:02x} at offset {exc.start}; re-save it as "
                             "UTF-8") from None
    if not text:
        raise Skip(EMPTY_CAPTION, name)
    return text


def open_rgb(data: bytes):
    """Image bytes -> an RGB PIL image, decoded now (a truncated file fails here, not mid-batch)."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # PIL's errors
        raise Skip(UNREADABLE, _BYTESIO.sub("", str(exc)) or type(exc).__name__) from None


def preprocess_to(data: bytes, target: tuple[int, int], img=None, *, resample: str = "BICUBIC") -> torch.Tensor:
    """Image bytes -> [3, h, w] in [-1, 1]: resized (``resample``: a PIL filter name) to cover
    ``target`` (h, w) with its aspect kept, then centre-cropped to it."""
    import numpy as np
    from PIL import Image

    img = open_rgb(data) if img is None else img
    th, tw = target
    rh, rw = cover_resize(img.height, img.width, target)
    img = img.resize((rw, rh), getattr(Image.Resampling, resample))
    left, top = (rw - tw) // 2, (rh - th) // 2
    img = img.crop((left, top, left + tw, top + th))
    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    return x.float() / 127.5 - 1.0


def load_image(data: bytes, table: dict[str, tuple[int, int]], max_upscale: float, *,
               resample: str = "BICUBIC") -> tuple[torch.Tensor, str]:
    """Image bytes -> (pixels at its bucket's size, bucket name); ``Skip`` if unusable."""
    img = open_rgb(data)
    name = next(iter(table)) if len(table) == 1 else nearest_bucket(img.height, img.width, table)
    th, tw = table[name]
    upscale = max(th / img.height, tw / img.width)
    if upscale > max_upscale:
        raise Skip(TOO_SMALL, f"{img.width}x{img.height} -> {tw}x{th} is {upscale:.1f}x, over --max-upscale "
                              f"{max_upscale:g}")
    return preprocess_to(data, (th, tw), img, resample=resample), name
