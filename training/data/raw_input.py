"""The raw input precompute reads: a folder of image + ``.txt`` pairs or WebDataset tars,
local or on S3, cut deterministically into units (one output shard each).

Folder input: images (.jpg .jpeg .png .webp) each with a same-stem ``.txt`` caption,
searched recursively; samples sorted by relative path and cut into shards of
``samples_per_shard``; an image without its caption is listed in ``missing`` (precompute
names each one and counts them). WebDataset tars (``<key>.<img ext>`` + ``<key>.txt``
members): one unit per tar; a sample missing either part is yielded with None there.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from training import s3
from training.data.shards import shard_name
from training.errors import UserError

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp")


@dataclass(frozen=True)
class Unit:
    """One output shard's worth of input: image/caption pairs, or one WebDataset tar."""

    number: int
    pairs: tuple[tuple[str, str, str], ...] = ()  # (key, image ref, caption ref)
    tar: str | None = None

    @property
    def name(self) -> str:
        return shard_name(self.number)


def _key(rel: str) -> str:
    return rel.rsplit(".", 1)[0].replace("/", "__")


def list_units(source: str, samples_per_shard: int, missing: list[str] | None = None) -> list[Unit]:
    """Deterministic split of the input into shards (every rank computes the same list).
    ``missing`` (folder input) receives every image without its ``.txt`` caption."""
    if s3.is_s3_url(source):
        base = s3.parse_s3_url(source.rstrip("/"))
        rels = s3.list_keys(base)
        ref = lambda rel: str(base.join(rel))  # noqa: E731
    else:
        root = Path(source)
        if root.is_file() and root.suffix == ".tar":
            return [Unit(0, tar=str(root))]
        if not root.is_dir():
            raise UserError(f"--input {source}: no such directory; give a folder of images + .txt captions, "
                            "WebDataset .tar files, or an s3:// prefix")
        rels = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        ref = lambda rel: str(root / rel)  # noqa: E731
    tars = [r for r in rels if r.endswith(".tar")]
    if tars:
        return [Unit(i, tar=ref(r)) for i, r in enumerate(tars)]
    texts = {r for r in rels if r.endswith(".txt")}
    pairs = []
    for r in rels:
        if r.lower().endswith(IMAGE_EXTS):
            caption = r.rsplit(".", 1)[0] + ".txt"
            if caption in texts:
                pairs.append((_key(r), ref(r), ref(caption)))
            elif missing is not None:
                missing.append(ref(r))
    if not pairs:
        raise UserError(f"--input {source}: found no image + .txt caption pairs and no .tar files")
    return [Unit(i // samples_per_shard, pairs=tuple(pairs[i:i + samples_per_shard]))
            for i in range(0, len(pairs), samples_per_shard)]


def read_ref(ref: str) -> bytes:
    return s3.get_bytes(ref) if s3.is_s3_url(ref) else Path(ref).read_bytes()



def unit_samples(unit: Unit, work: Path) -> Iterator[tuple[str, str, bytes | str | None, bytes | str | None]]:
    """(key, name for messages, image bytes or ref, caption bytes or ref) of a unit, in a fixed
    order; None for a WebDataset sample's missing image or caption (skipped with its reason)."""
    if unit.tar is None:
        for key, image, caption in unit.pairs:
            yield key, image, image, caption
        return
    path = Path(unit.tar)
    if s3.is_s3_url(unit.tar):
        path = s3.download_file(unit.tar, work / "input" / unit.tar.rsplit("/", 1)[-1])
    stem = path.name[:-4]
    groups: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path) as tar:
            for m in tar:
                if not m.isfile():
                    continue
                directory, _, base = m.name.rpartition("/")
                key, _, ext = base.partition(".")
                groups.setdefault(f"{directory}/{key}" if directory else key, {})[ext.lower()] = (
                    tar.extractfile(m).read())
    except tarfile.TarError as exc:
        raise UserError(f"{unit.tar}: not a readable tar ({exc}); fix or remove it") from None
    finally:
        if path != Path(unit.tar):
            path.unlink(missing_ok=True)  # a downloaded input tar is read once
    for key in sorted(groups):
        parts = groups[key]
        image = next((parts[e] for e in ("jpg", "jpeg", "png", "webp") if e in parts), None)
        yield f"{stem}__{key.replace('/', '__')}", f"{unit.tar}:{key}", image, parts.get("txt")
