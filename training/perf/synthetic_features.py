"""The features a bench trains on when it is given none (``--synthetic``): random latents
and caption features of the model's own shapes, with caption lengths taken from real data.

Why real lengths: caption trimming (training/data/text_trim.py) makes a step cheaper the
shorter the captions are, so the lengths decide the measured speed-up; they come from
training/data/caption_lengths.py (a feature directory, a saved JSON, or ``full``). The
directory is written once per node and shared by its ranks (and by the loop-overhead check,
training/perf/overhead.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

#: caption length for synthetic features: Sana's Gemma-2 max_length (first token + last 299)
DEFAULT_TEXT_TOKENS = 300


def synthetic_spec(model_kwargs: dict[str, Any], text_tokens: int, captions: Any = None) -> dict[str, Any]:
    """Feature shapes that feed this transformer: [C, S, S] latents, caption_channels text,
    and the real caption lengths (training/data/caption_lengths.py ``CaptionLengths``; None
    or ``full``: every caption at the padded ``text_tokens``)."""
    from training.data.caption_lengths import clipped

    size = int(model_kwargs.get("sample_size", 32))
    spec: dict[str, Any] = {"latent_shape": (int(model_kwargs.get("in_channels", 32)), size, size),
                            "text_dim": int(model_kwargs.get("caption_channels", 2304)),
                            "max_text_tokens": int(text_tokens)}
    lengths = getattr(captions, "lengths", None)
    if lengths:
        spec["text_lengths"] = clipped(lengths, int(text_tokens))
    else:
        spec["text_tokens"] = (int(text_tokens), int(text_tokens))
    return spec


def resolve_caption_lengths(choice: str, cfg: Any) -> Any:
    """``--caption-lengths``: ``auto`` = the config's ``data.path`` when it is a local feature
    directory (real captions: the lengths training will see), else ``full``."""
    from training.data import caption_lengths

    if choice == "auto":
        path = Path(str(cfg.data.path))
        choice = str(path) if (path / "index.json").is_file() else caption_lengths.FULL
    return caption_lengths.load(choice)


def ensure_synthetic_features(root: Path, spec: dict[str, Any], num_samples: int, *, write: bool) -> Path:
    """A synthetic feature directory for ``spec`` under ``root`` (written once per node)."""
    from training.data.shards import INDEX, write_synthetic_features

    key = hashlib.sha256(json.dumps([spec, num_samples], sort_keys=True, default=list).encode()).hexdigest()[:12]
    path = root / f"synthetic-{key}"
    if write and not (path / INDEX).is_file():
        tmp = root / f".tmp-synthetic-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write_synthetic_features(tmp, num_samples=num_samples, seed=0, **spec)
        try:
            tmp.rename(path)
        except OSError:  # another process on this node won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return path
