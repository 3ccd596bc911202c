"""Helpers shared by the tests/training/serve modules (imported by name: tests/training/serve is on sys.path)."""

from __future__ import annotations

import json


def request_body(**fields) -> bytes:
    return json.dumps({"prompt": "a small red circle on a blue background", "steps": 2, "seed": 1, **fields}).encode()
