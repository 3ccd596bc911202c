"""Plain-text tables for the pipeline's commands: fixed-width columns, the last one free."""

from __future__ import annotations

from collections.abc import Sequence


def render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``header`` and ``rows`` as aligned columns; every cell is one line (whitespace collapsed)."""
    cells = [[" ".join(str(c).split()) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]).rstrip())
        if n == 0:
            lines.append("  ".join([*("-" * w for w in widths), "-" * max(len(header[-1]), 6)]))
    return "\n".join(lines)
