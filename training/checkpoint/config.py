"""The ``checkpoint:`` section of a training config: where, how often, in which format, and
what a run resumes from.

Apart from the Checkpointer (training/checkpoint/checkpointer.py) so that training/config.py
composes it without loading the writers, readers and the S3 mirror.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``checkpoint.format`` values: "sharded" = sana-checkpoint/2, "full" = sana-checkpoint/1
#: (training/checkpoint/layout.py)
FORMAT_NAMES = ("sharded", "full")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and how often checkpoints are written, and what a run resumes from."""

    #: checkpoint root; relative paths are under the run's output_dir (default <output_dir>/checkpoints)
    dir: str = "checkpoints"
    #: save every N optimizer steps (0 = only when the loop forces a save, e.g. at the end)
    every_steps: int = 500
    #: keep the newest K complete local checkpoints (0 = keep all)
    keep_last: int = 3
    #: "auto" = newest complete checkpoint (local, else the S3 mirror) or a fresh start;
    #: "none" = always fresh; otherwise a checkpoint dir, a checkpoint root or an s3:// URL of either
    resume: str = "auto"
    #: s3://bucket/prefix to mirror every completed checkpoint to (None = no mirror)
    s3_mirror: str | None = None
    #: keep the newest K checkpoints under s3_mirror (0 = keep all; the bucket's lifecycle rules decide)
    s3_keep_last: int = 0
    #: False = write no checkpoint (not even the loop's final forced save) and resume from none;
    #: Trainium's --precompile sets it (neuron_parallel_compile's graphs return zeros)
    enabled: bool = True
    #: "sharded" (sana-checkpoint/2: every rank writes its own rows; reshardable N -> M) or
    #: "full" (sana-checkpoint/1: rank 0 gathers and writes everything; the old path)
    format: str = "sharded"
    #: sharded format: write in the background; the step blocks only for the device-to-host copy
    async_save: bool = True

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("checkpoint.dir: must not be empty; give a directory (default 'checkpoints')")
        for name in ("every_steps", "keep_last", "s3_keep_last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"checkpoint.{name}: must be an integer >= 0, got {value!r}")
        if not isinstance(self.resume, str) or not self.resume:
            raise ValueError("checkpoint.resume: use 'auto', 'none', a checkpoint path or an s3:// URL")
        if self.format not in FORMAT_NAMES:
            raise ValueError(f"checkpoint.format: {self.format!r} is not one of {FORMAT_NAMES}")
        if self.s3_mirror is not None and not (self.s3_mirror.startswith("s3://") and len(self.s3_mirror) > 5):
            raise ValueError(f"checkpoint.s3_mirror: {self.s3_mirror!r} is not an s3://BUCKET/PREFIX URL")
