"""Which checkpoints belong to the live run: branches and their lineage.

Every start of a run that writes checkpoints begins a new *branch* (a random id and its
start time). Its *lineage* is what it builds on: the checkpoint it resumed from and that
checkpoint's own lineage, as ``(branch id, last step)`` pairs. A checkpoint is on the live
branch when its manifest names the branch itself, or an ancestor at a step no later than
where the lineage left that ancestor. Resuming from an older step (or starting fresh) thus
leaves the later checkpoints of the old trajectory off the lineage, whatever their step.

Locally those are renamed ``abandoned-step-*`` (resume.py); on S3, where nothing can
be renamed, the run's branch is published as ``<mirror>/branch.json`` (the *head*) before
any of its manifests is uploaded, and restores and prunes take only checkpoints on the
head's lineage (training/checkpoint/mirror.py). The head is one object replaced with one
PUT, so publishing it cannot half-succeed, and a late manifest from an older run (a mirror
still uploading) is simply not on the lineage.

A manifest without a branch (written before branches existed) belongs to branch ``None``;
a run resumed from one has ``(None, step)`` in its lineage. The lineage grows by one pair
(~30 bytes) per start.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: S3 key (under the mirror prefix) of the head: the branch of the run that started last
HEAD_KEY = "branch.json"


@dataclass(frozen=True, kw_only=True)
class Branch:
    """One run's trajectory: ``id``, start time, and the ``(ancestor id, last step)`` pairs
    it builds on, oldest first."""

    id: str
    started_ns: int
    lineage: tuple[tuple[str | None, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"branch: id must be a non-empty string, got {self.id!r}")

    @classmethod
    def fresh(cls) -> Branch:
        """A run that builds on no checkpoint."""
        return cls(id=secrets.token_hex(6), started_ns=time.time_ns())

    @classmethod
    def fork(cls, manifest: Mapping[str, Any] | None) -> Branch:
        """A run that resumes from the checkpoint with ``manifest`` (None: starts fresh)."""
        if manifest is None:
            return cls.fresh()
        parent = cls.from_json(manifest.get("branch"))
        step = int(manifest["step"])
        lineage = ((None, step),) if parent is None else (*parent.lineage, (parent.id, step))
        return cls(id=secrets.token_hex(6), started_ns=time.time_ns(), lineage=lineage)

    def holds(self, manifest: Mapping[str, Any]) -> bool:
        """Whether the checkpoint with ``manifest`` is on this branch or its lineage."""
        owner = branch_id(manifest)
        if owner == self.id:
            return True
        step = int(manifest.get("step", -1))
        return any(owner == ancestor and step <= last for ancestor, last in self.lineage)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "started_ns": self.started_ns, "lineage": [list(p) for p in self.lineage]}

    @classmethod
    def from_json(cls, obj: Any) -> Branch | None:
        """The branch a manifest or head records; None for none (or a malformed record)."""
        if not isinstance(obj, Mapping):
            return None
        try:
            lineage = tuple((None if a is None else str(a), int(s)) for a, s in obj.get("lineage", ()))
            return cls(id=str(obj["id"]), started_ns=int(obj["started_ns"]), lineage=lineage)
        except (KeyError, TypeError, ValueError):
            return None


def branch_id(manifest: Mapping[str, Any]) -> str | None:
    """The id of the branch that wrote the checkpoint (None: written before branches)."""
    branch = manifest.get("branch")
    return str(branch["id"]) if isinstance(branch, Mapping) and "id" in branch else None
