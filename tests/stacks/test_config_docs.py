"""The configuration docs list every context key with its default (they change with the code)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from stacks.config import PlatformConfig

REPO = Path(__file__).resolve().parents[2]


def _table_rows(text: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-zA-Z]+)`.*$", text, re.M)}


@pytest.mark.parametrize("doc", ["README.md", "runbooks/configure.md"])
def test_every_key_and_default_is_documented(doc):
    rows = _table_rows((REPO / doc).read_text())
    for field in dataclasses.fields(PlatformConfig):
        row = rows.get(field.name)
        if row is None:  # the EBS keys share one row in configure.md
            row = next(r for r in (REPO / doc).read_text().splitlines() if f"`{field.name}`" in r)
        default = PlatformConfig.context_defaults()[field.name]  # as cdk.json writes it
        if isinstance(default, (bool, list)):  # true/false; clusterUsers as cdk.json's JSON list
            shown = json.dumps(default)
        else:
            shown = str(default) if default != "" else '""'
        assert f"`{shown}`" in row, (doc, field.name, row)
