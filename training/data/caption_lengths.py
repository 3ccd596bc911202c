"""Caption lengths for benchmarks: the real token counts of a precomputed feature directory.

A benchmark on synthetic features decides how long the captions are, and that decides how
much caption trimming (training/data/text_trim.py) can save: 20-120-token captions make our
trimmed step look better against a padded reference than any real data would. So the
lengths come from real captions:

- a feature directory (``training.precompute`` output, local or FSx): each sample's stored
  caption rows, i.e. its Gemma-2 tokens after Sana's CHI prefix and selection (first token +
  last N-1 positions: the caption's own tokens plus two, at most N; training/data/text_features.py).
  They are read from the safetensors header of each tar member (8-byte length + JSON with
  the "text" shape), so no tensor data is read; the first ``max_samples`` members in shard
  order are a sample of the whole set (precompute writes captions in input order, which is
  not sorted by length).
- a JSON file written from one (``python -m training.data.caption_lengths DIR --out FILE``), for
  a GPU machine without the data;
- ``full``: every caption as long as the padded length. No real data says that; it is the
  choice that gives trimming nothing to gain, so a ratio measured with it is a lower bound
  for ours against a padded reference (and MFU on real tokens equals the padded-count MFU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import tarfile
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError, exits_cleanly

#: ``--caption-lengths`` keyword: every caption at the padded length
FULL = "full"
#: members read from a feature directory (a few MB of headers; seconds on FSx)
DEFAULT_MAX_SAMPLES = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaptionLengths:
    """Real caption tokens per sample (None = ``full``: every caption at the padded length)."""

    lengths: tuple[int, ...] | None
    source: str  # where they come from, for the result JSON and tables

    def describe(self) -> str:
        if self.lengths is None:
            return f"{self.source} (every caption at the padded length)"
        ordered = sorted(self.lengths)
        median = ordered[len(ordered) // 2]
        return (f"{self.source}: {len(ordered)} captions, median {median}, "
                f"min {ordered[0]}, max {ordered[-1]} tokens")


def _header_size(payload_header: bytes, label: str) -> int:
    """Byte length of a safetensors JSON header (its first 8 bytes, little-endian)."""
    if len(payload_header) < 8:
        raise UserError(f"{label}: truncated sample (no safetensors header); re-run training.precompute")
    (size,) = struct.unpack("<Q", payload_header[:8])
    return size


def stored_lengths(features: str | Path, *, max_samples: int = DEFAULT_MAX_SAMPLES) -> list[int]:
    """Stored caption rows of the first ``max_samples`` samples of a local feature directory."""
    from training.data.index import FeatureIndex

    index = FeatureIndex.load(str(features))
    root = Path(index.source)
    out: list[int] = []
    for shard in index.shards:
        path = root / shard.name
        try:
            with tarfile.open(path, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    fh = tar.extractfile(member)
                    assert fh is not None
                    size = _header_size(fh.read(8), f"{path}:{member.name}")
                    header = json.loads(fh.read(size))
                    out.append(int(header["text"]["shape"][0]))
                    if len(out) >= max_samples:
                        return out
        except (OSError, tarfile.TarError, KeyError, ValueError) as exc:
            raise UserError(f"{path}: cannot read caption lengths ({exc}); check the shard or re-run "
                            "training.precompute") from None
    if not out:
        raise UserError(f"{features}: no samples; point --caption-lengths at a precomputed feature directory")
    return out


def load(source: str, *, max_samples: int = DEFAULT_MAX_SAMPLES) -> CaptionLengths:
    """``full``, a feature directory (index.json) or a JSON file from ``save``."""
    if source == FULL:
        return CaptionLengths(lengths=None, source=FULL)
    path = Path(source)
    if (path / "index.json").is_file():
        return CaptionLengths(lengths=tuple(stored_lengths(path, max_samples=max_samples)),
                              source=f"stored caption tokens of {path}")
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
            lengths = tuple(int(n) for n in raw["lengths"])
            label = str(raw.get("source", path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"--caption-lengths {source}: not a caption-lengths JSON ({exc}); write one with "
                            "python -m training.data.caption_lengths DIR --out FILE") from None
        if not lengths or min(lengths) < 1:
            raise UserError(f"--caption-lengths {source}: needs a non-empty list of lengths >= 1")
        return CaptionLengths(lengths=lengths, source=f"{label} (via {path.name})")
    raise UserError(f"--caption-lengths {source}: neither 'full', a feature directory with index.json, "
                    "nor a caption-lengths JSON file")


def save(lengths: CaptionLengths, out: str | Path) -> Path:
    out = Path(out)
    out.write_text(json.dumps({"source": lengths.source, "lengths": list(lengths.lengths or ())}) + "\n")
    return out


def clipped(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Lengths as a ``max_tokens``-token model stores them (longer captions are cut)."""
    return [max(1, min(int(n), max_tokens)) for n in lengths]


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.data.caption_lengths",
                                description="Save the stored caption lengths of a feature directory as JSON "
                                            "(for training.bench --caption-lengths on a machine without the data).")
    p.add_argument("features", help="feature directory written by training.precompute")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES)
    args = p.parse_args(argv)
    lengths = load(args.features, max_samples=args.max_samples)
    save(lengths, args.out)
    print(lengths.describe(), flush=True)


if __name__ == "__main__":
    main()
