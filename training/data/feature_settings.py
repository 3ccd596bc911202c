"""The settings that make a feature directory ONE feature set, and the refusal to mix two.

Every shard marker and index.json record the settings precompute ran with (``settings``).
Before a run encodes or merges anything into an ``--out`` that already holds shards or an
index, the settings of this run are compared with the recorded ones; any difference ends the
run in one line naming each differing setting (with both values), before a byte is written.
Without this a re-run with another ``--resolution`` keeps the finished 64 px shards and
writes an index that claims 128 px: training would read a feature set no single run made.

A setting is compared only when both sides know it (a model's fingerprint is unknown to a
run that did not load it): directories written before
``settings`` existed are read from what they did record (``created_by``, the markers'
``bucket_table``, ``text_conditioning``); those older precomputes lower-cased captions
(``caption_text: diffusers``, training/data/text_features.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from training import s3
from training.errors import UserError

SETTINGS_KEY = "settings"
#: settings where None means "not known" (a model this run did not load), not a value;
#: everywhere else None is a value (``chi_sha256`` None: no CHI)
UNKNOWN_WHEN_NONE = ("vae", "text_encoder", "tokenizer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSettings:
    """What precompute's output depends on besides the input's bytes."""

    #: the raw data (an absolute local path or an s3:// prefix)
    input: str
    #: square side, or the side of the bucket table's 1.0 bucket
    resolution: int
    #: "square" or a Sana table ("512", "1024", "2048")
    buckets: str
    max_upscale: float
    #: folder input is cut into shards of this many samples (which shard holds what)
    samples_per_shard: int
    max_text_tokens: int
    #: sha256 of the complex human instruction (None: no CHI)
    chi_sha256: str | None
    #: "sana" (raw caption) or "diffusers" (lower-cased, stripped)
    caption_text: str
    #: the models' compute dtype ("float32", "bfloat16")
    dtype: str
    #: ``dir_fingerprint`` of the model directories (None: not loaded by this run)
    vae: str | None
    text_encoder: str | None
    tokenizer: str | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def normalised_input(source: str) -> str:
    """``--input`` as recorded: s3:// prefixes as given, local paths absolute (so ``raw`` and
    ``/home/me/raw`` are the same input)."""
    return source.rstrip("/") if s3.is_s3_url(source) else os.path.abspath(source)


def recorded_settings(index: Mapping[str, Any] | None, markers: Mapping[str, Mapping[str, Any]]
                      ) -> dict[str, Any]:
    """What an existing ``--out`` records of its settings: index.json's, else a marker's
    (every marker of one run records the same), else what older directories recorded."""
    for source in ([index] if index else []) + [markers[k] for k in sorted(markers)]:
        if source.get(SETTINGS_KEY):
            return dict(source[SETTINGS_KEY])
    known: dict[str, Any] = {}
    if index:
        created = index.get("created_by") or {}
        if created.get("tool") == "training.precompute":
            for key in ("resolution", "buckets", "max_upscale", "dtype"):
                if key in created:
                    known[key] = created[key]
            if "input" in created:
                known["input"] = normalised_input(str(created["input"]))
            known["caption_text"] = "diffusers"  # what every precompute did before the choice
        known["max_text_tokens"] = index.get("max_text_tokens")
        conditioning = index.get("text_conditioning") or {}
        if conditioning:
            known["chi_sha256"] = conditioning.get("chi_sha256")
            known["text_encoder"] = (conditioning.get("text_encoder") or {}).get("fingerprint")
            known["tokenizer"] = (conditioning.get("tokenizer") or {}).get("fingerprint")
    for name in sorted(markers):
        marker = markers[name]
        table, _, resolution = str(marker.get("bucket_table", "")).partition("@")
        if table and resolution.isdigit():
            known.setdefault("buckets", table)
            known.setdefault("resolution", int(resolution))
        for key in ("max_text_tokens", "chi_sha256"):
            if key in marker:
                known.setdefault(key, marker[key])
        break
    return {k: v for k, v in known.items() if v is not None or k == "chi_sha256"}


def differences(recorded: Mapping[str, Any], requested: FeatureSettings) -> list[str]:
    """``["resolution 64 (this run: 128)", ...]`` for every setting both sides know and differ in."""
    out = []
    for key, value in requested.to_dict().items():
        if key not in recorded or (key in UNKNOWN_WHEN_NONE and (value is None or recorded[key] is None)):
            continue
        old = recorded[key]
        same = float(old) == float(value) if isinstance(value, float) else old == value
        if not same:
            shown = (lambda v: f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else v)  # noqa: E731
            out.append(f"{key} {shown(old)} (this run: {shown(value)})")
    return out


def refuse_mixed(out: str, recorded: Mapping[str, Any], requested: FeatureSettings) -> None:
    """One-line UserError when ``out`` holds features made with other settings than this run's."""
    diff = differences(recorded, requested)
    if diff:
        raise UserError(f"--out {out}: already holds features made with other settings: {'; '.join(diff)}. "
                        "A feature set must come from one set of settings: use a new --out for these, or run "
                        "with the recorded ones (index.json settings) to finish or extend it")
