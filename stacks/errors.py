"""The one error a user's configuration causes: a bad CDK context value, said in one line.

Its own module so that every validator (stacks/config.py, stacks/serving_config.py) can raise it
without importing the others.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad context value. ``str(err)`` is one line: key, value, what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid context value {key}={value!r}: {allowed}")
