"""Moved to training/checkpoint/mirror.py (the checkpoint package); kept importable."""

from training.checkpoint.mirror import (  # noqa: F401
    MirrorError,
    S3Mirror,
    fetch_checkpoint,
    fetch_latest,
    remote_checkpoints,
)
