"""The observability files the stacks deploy, read from observability/ (no aws_cdk import:
the tests render them the same way, so promtool and amtool check what is deployed).

- observability/rules/alerts.yaml       -> AWS::APS::RuleGroupsNamespace Data, with the
                                           stallMinutes window written into TrainingJobStalled
- observability/alertmanager.yaml       -> the workspace's AlertManagerDefinition
- observability/dashboards/*.json       -> Grafana dashboards (imported, runbooks/observability.md)
"""

from __future__ import annotations

import re
from pathlib import Path

OBSERVABILITY_DIR = Path(__file__).resolve().parents[1] / "observability"
RULES_FILE = OBSERVABILITY_DIR / "rules" / "alerts.yaml"
ALERTMANAGER_FILE = OBSERVABILITY_DIR / "alertmanager.yaml"
DASHBOARDS_DIR = OBSERVABILITY_DIR / "dashboards"
#: the stall window alerts.yaml is written with (the stallMinutes default)
DEFAULT_STALL_MINUTES = 30


def render_rules(stall_minutes: int, text: str | None = None) -> str:
    """alerts.yaml with TrainingJobStalled's window (``[30m]`` and ``> 1800``) set to ``stall_minutes``.

    Exactly one of each must be found in that rule: a changed rule that no longer matches fails
    synth here rather than deploying an alert with the wrong window."""
    text = RULES_FILE.read_text() if text is None else text
    start = text.index("- alert: TrainingJobStalled")
    end = text.find("- alert:", start + 1)
    end = len(text) if end < 0 else end
    rule = text[start:end]
    window = f"[{DEFAULT_STALL_MINUTES}m]"
    seconds = f"> {DEFAULT_STALL_MINUTES * 60}"
    if rule.count(window) != 1 or len(re.findall(re.escape(seconds) + r"\b", rule)) != 1:
        raise ValueError(f"{RULES_FILE}: TrainingJobStalled must hold {window} and {seconds} exactly once "
                         "(stacks/observability_rules.py writes stallMinutes into them)")
    rule = rule.replace(window, f"[{stall_minutes}m]").replace(seconds, f"> {stall_minutes * 60}")
    return text[:start] + rule + text[end:]


def alertmanager_definition(text: str | None = None) -> str:
    """AMP's alert manager definition: the Alertmanager config under ``alertmanager_config``
    (placeholders ${SnsTopicArn} and ${AWS::Region} left for Fn::Sub)."""
    text = ALERTMANAGER_FILE.read_text() if text is None else text
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return "alertmanager_config: |\n" + "".join(f"  {line}\n" for line in body.strip("\n").splitlines())


def dashboards() -> dict[str, Path]:
    return {path.stem: path for path in sorted(DASHBOARDS_DIR.glob("*.json"))}
