"""Errors a user can cause and fix. Entrypoints print them as one line and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """Bad input (config key, CLI flag, shard, bucket, path): the message names the
    input and the fix, and is shown without a traceback."""


def exits_cleanly(main: Callable[..., T]) -> Callable[..., T]:
    """Decorate an entrypoint ``main``: a UserError becomes ``error: <message>`` on stderr, exit 2."""

    @wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    return wrapper
