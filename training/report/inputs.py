"""What the report is asked besides the bench results and the prices (``Options``: the
target, the FSx figures, the projection's assumptions and question, the decision inputs), and
the readers that fill it from outside files: bytes per sample and mean real caption tokens of
a feature index, and the provisioned FSx throughput from cdk.json.

Definitions (tests/training/report/test_report.py checks these by hand):
- FSx provisioned (PERSISTENT_2) = storage TiB x throughput per TiB (MB/s/TiB)
"""

from __future__ import annotations

import dataclasses
import json
import struct
import tarfile
from pathlib import Path

from training.errors import UserError
from training.report import assemble, projection


@dataclasses.dataclass(kw_only=True)
class Options:
    dataset_samples: int | None = None
    epochs: float = 1.0
    allow_mismatch: bool = False
    bytes_per_sample: float | None = None  # from --features-index
    features_index: str | None = None
    fsx_mbps: float | None = None  # provisioned FSx throughput
    fsx_source: str = ""
    project_only: bool = False  # --project without result files
    assumptions: projection.Assumptions | None = None  # None: the defaults
    question: projection.Question | None = None  # None: the defaults + this target
    decision: assemble.DecisionOptions = dataclasses.field(default_factory=assemble.DecisionOptions)
    serving: tuple[str, ...] = ()  # --serving: serving bench JSONs (training/serve/bench.py)


def target_samples(opts: Options) -> tuple[float, str]:
    if opts.dataset_samples:
        return opts.dataset_samples * opts.epochs, (f"{opts.dataset_samples:,} samples x {opts.epochs:g} "
                                                    f"epoch{'s' if opts.epochs != 1 else ''}")
    return 1e6, "1,000,000 samples (give --dataset-samples and --epochs for your target)"


def fsx_provisioned_mbps(storage_gib: float, per_tib_mbps: float) -> float:
    """PERSISTENT_2 throughput capacity = storage (TiB) x throughput per unit of storage."""
    return storage_gib / 1024.0 * per_tib_mbps


def fsx_from_cdk(path: Path) -> tuple[float, str] | None:
    """Provisioned MB/s from cdk.json context (fsxStorageGiB x fsxThroughputPerTiB), if present."""
    try:
        context = json.loads(path.read_text()).get("context", {})
    except (OSError, ValueError):
        return None
    gib, per = context.get("fsxStorageGiB"), context.get("fsxThroughputPerTiB")
    if not isinstance(gib, int | float) or not isinstance(per, int | float):
        return None
    return (fsx_provisioned_mbps(gib, per),
            f"{path.name} context: fsxStorageGiB {gib} x fsxThroughputPerTiB {per} MB/s/TiB")


def bytes_per_sample_from_index(source: str) -> float:
    from training.data.index import FeatureIndex

    src = source[: -len("/index.json")] if source.endswith("/index.json") else source
    index = FeatureIndex.load(src)
    if not index.bytes_per_sample:
        raise UserError(f"--features-index {source}: index has no bytes_per_sample")
    return float(index.bytes_per_sample)


def mean_real_text_tokens(features: str, *, max_samples: int = 4096) -> tuple[float, int, int]:
    """(mean real caption tokens, samples read, padded max_text_tokens) of a feature directory.

    Reads only the safetensors headers of the first shards' members (8-byte length + JSON,
    https://github.com/huggingface/safetensors#format): ``text`` is stored as [n_real, D],
    unpadded (training/data.py ShardWriter.add).
    """
    from training.data.index import FeatureIndex

    src = features[: -len("/index.json")] if features.endswith("/index.json") else features
    index = FeatureIndex.load(src)
    counts: list[int] = []
    # s3://: fetch downloads whole shards, so one is enough; local tars are read header by header
    for shard in [s for s in index.shards if s.samples][: 1 if index.is_s3 else None]:
        with tarfile.open(index.fetch(shard.name), "r") as tar:
            for member in tar:
                fh = tar.extractfile(member)
                if fh is None:
                    continue
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
                counts.append(int(header["text"]["shape"][0]))
                if len(counts) >= max_samples:
                    break
        if len(counts) >= max_samples:
            break
    if not counts:
        raise UserError(f"--features-index {features}: no samples to read caption lengths from")
    return sum(counts) / len(counts), len(counts), index.max_text_tokens
