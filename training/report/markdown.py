"""Text formatting every report section shares: Markdown tables, durations and dollar amounts.

One copy, so the measured report (training/report/render.py), the projection
(training/report/projection_section.py) and the budget answer (training/report/budget.py)
print the same figure the same way.
"""

from __future__ import annotations


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: header, separator, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def duration(hours: float) -> str:
    """Hours as a reader wants them: "12.50 h", or minutes/seconds for short CPU demo targets."""
    if hours >= 0.1:
        return f"{hours:,.2f} h"
    if hours * 60 >= 1:
        return f"{hours * 60:.1f} min"
    return f"{hours * 3600:.1f} s"


def usd(x: float) -> str:
    """Dollars: whole above $100, cents below (a demo-sized target costs cents)."""
    return f"${x:,.0f}" if x >= 100 else f"${x:,.2f}"
