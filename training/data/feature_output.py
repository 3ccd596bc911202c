"""A feature directory being written by precompute, local or on S3: its shard markers, the
shards, index.json, and the part files a failed writer may have left."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from training import s3
from training.data.feature_settings import SETTINGS_KEY
from training.data.shards import INDEX, NULL_CAPTION, VALIDATION_PROMPTS, atomic_write_bytes, write_index
from training.errors import UserError

#: validation_prompts.safetensors metadata key holding the prompts (JSON list), in file order
PROMPTS_METADATA = "prompts"


class Output:
    """The feature directory, local or S3: markers, shards, index."""

    def __init__(self, out: str, work: Path) -> None:
        self.out, self.work = out.rstrip("/"), work
        self.is_s3 = s3.is_s3_url(out)
        self.staging = work / "staging" if self.is_s3 else Path(out)
        self.staging.mkdir(parents=True, exist_ok=True)
        self._seen: dict[str, dict[str, Any]] = {}  # S3 markers already read (they never change)

    def markers(self) -> dict[str, dict[str, Any]]:
        """Finished shards: name -> marker (a marker whose tar is missing does not count)."""
        if self.is_s3:
            keys = set(s3.list_keys(self.out))  # a missing bucket is a one-line UserError here
            for name in (k[:-5] for k in keys if k.startswith("shard-") and k.endswith(".json")):
                if name not in self._seen:
                    self._seen[name] = json.loads(s3.get_bytes(f"{self.out}/{name}.json"))
            return {n: m for n, m in self._seen.items() if m["samples"] == 0 or f"{n}.tar" in keys}
        done = {}
        for path in self.staging.glob("shard-*.json"):
            marker = json.loads(path.read_text())
            tar = self.staging / marker["name"]
            if marker["samples"] == 0 or (tar.exists() and tar.stat().st_size == marker["bytes"]):
                done[marker["name"][:-4]] = marker
        return done

    def publish(self, marker: dict[str, Any]) -> None:
        """Tar first, then its marker: a marker always points at a complete shard."""
        tar = self.staging / marker["name"]
        body = json.dumps(marker, indent=1)
        if self.is_s3:
            if marker["samples"]:
                s3.upload_file(tar, f"{self.out}/{marker['name']}")
            s3.put_bytes(body.encode(), f"{self.out}/{marker['name'][:-4]}.json")
            tar.unlink(missing_ok=True)
        else:
            atomic_write_bytes(self.staging / f"{marker['name'][:-4]}.json", body.encode())

    def read_index(self) -> dict[str, Any] | None:
        """The index.json already there (a finished earlier run), or None."""
        if self.is_s3:
            if INDEX not in set(s3.list_keys(self.out)):
                return None
            raw = s3.get_bytes(f"{self.out}/{INDEX}")
        else:
            try:
                raw = (self.staging / INDEX).read_bytes()
            except FileNotFoundError:
                return None
        try:
            return json.loads(raw)
        except ValueError:
            raise UserError(f"{self.out}/{INDEX}: not valid JSON; delete it (the shards and markers are kept) "
                            "and re-run to rebuild it") from None

    def recorded_validation_prompts(self, index: dict[str, Any] | None) -> list[str] | None:
        """The validation prompts this directory records: index.json's, else those stored in
        validation_prompts.safetensors' metadata (an index lost to a crash mid-merge); None
        when neither says."""
        if index is not None and "prompts" in (index.get("validation") or {}):
            return list(index["validation"]["prompts"])
        from safetensors import safe_open

        local = self.staging / VALIDATION_PROMPTS
        if self.is_s3:
            if VALIDATION_PROMPTS not in set(s3.list_keys(self.out)):
                return None
            local = Path(self.work) / f"previous-{VALIDATION_PROMPTS}"
            local.write_bytes(s3.get_bytes(f"{self.out}/{VALIDATION_PROMPTS}"))
        if not local.is_file():
            return None
        try:
            with safe_open(str(local), "pt") as f:
                prompts = (f.metadata() or {}).get(PROMPTS_METADATA)
        except Exception:  # unreadable or from an older precompute: nothing recorded
            return None
        return json.loads(prompts) if prompts else None

    def remove_stale_parts(self, names: Sequence[str]) -> list[Path]:
        """Delete the ``.NAME.part-PID`` files a killed or disk-full run left for ``names``
        (files this rank is about to write: no other process writes them). Returns them."""
        stale = [p for name in names for p in self.staging.glob(f".{name}.part-*")]
        for path in stale:
            path.unlink(missing_ok=True)
        return stale

    def write_index(self, markers: Sequence[dict[str, Any]], null: tuple[torch.Tensor, torch.Tensor],
                    created_by: dict[str, Any], extra: dict[str, Any], extra_files: Sequence[str] = ()
                    ) -> dict[str, Any]:
        first = next((m for m in markers if m["samples"]), markers[0])
        bucketed = "bucket_shapes" in first
        shape_key = "bucket_table" if bucketed else "latent_shape"
        for m in markers:
            for key in (shape_key, "text_dim", "max_text_tokens", "vae_scaling_factor", "chi_sha256", SETTINGS_KEY):
                if m["samples"] and m.get(key) != first.get(key):
                    raise UserError(f"{self.out}/{m['name']}: {key} {m.get(key)} differs from {first['name']}'s "
                                    f"{first.get(key)}; shards come from different settings - delete and redo them")
        keys = ("name", "samples", "bytes", "sha256", *(("buckets",) if bucketed else ()))
        shards = [{k: m[k] for k in keys} for m in markers if m["samples"]]
        if not shards:
            raise UserError(f"{self.out}: every shard is empty; check the input")
        shapes = {name: shape for m in markers if m["samples"] for name, shape in m.get("bucket_shapes", {}).items()}
        index = write_index(self.staging, shards=shards, latent_shape=None if bucketed else first["latent_shape"],
                            text_dim=first["text_dim"], max_text_tokens=first["max_text_tokens"],
                            vae_scaling_factor=first["vae_scaling_factor"], null_caption=null[0], null_mask=null[1],
                            created_by=created_by, extra=extra, bucket_shapes=shapes if bucketed else None)
        if self.is_s3:
            for name in (NULL_CAPTION, *extra_files):
                s3.upload_file(self.staging / name, f"{self.out}/{name}")
            s3.upload_file(self.staging / INDEX, f"{self.out}/{INDEX}")  # last: makes the directory readable
        return index
