"""Compliance audit of a synthesized cloud assembly: cdk-nag findings + cfn-lint per template.

    python -m stacks.audit cdk.out

Prints, for each cdk-nag pack (AWS Solutions, HIPAA Security), the open findings and every
acknowledged one with its reason; acknowledgements that no longer match any finding
(stale); then cfn-lint's findings for every template. Exits 1 when anything is open: an
unacknowledged nag finding, a stale acknowledgement, a missing nag report, or a cfn-lint
error or warning (informational cfn-lint messages are printed but do not fail).

cdk-nag 3 runs as a CDK policy-validation plugin during synth and writes
``validation-report.json`` into the assembly; with open findings the synth itself fails
after printing CDK's report, so the audit normally sees only acknowledged findings.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKS = ("AwsSolutions", "HIPAA.Security")
DEFAULT_LINT_REGION = "us-east-1"


@dataclass(kw_only=True)
class NagFinding:
    pack: str
    rule: str
    path: str
    description: str
    acknowledged_id: str | None = None
    acknowledged_at: str | None = None
    reason: str | None = None


@dataclass(kw_only=True)
class LintFinding:
    template: str
    rule: str
    severity: str
    line: int
    message: str


@dataclass(kw_only=True)
class AuditResult:
    nag_open: list[NagFinding] = field(default_factory=list)
    nag_acknowledged: list[NagFinding] = field(default_factory=list)
    stale_acknowledgements: list[tuple[str, str, str]] = field(default_factory=list)
    lint: list[LintFinding] = field(default_factory=list)
    lint_regions: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def lint_failures(self) -> list[LintFinding]:
        return [f for f in self.lint if f.severity in ("error", "warning")]

    @property
    def ok(self) -> bool:
        return not (self.nag_open or self.stale_acknowledgements or self.lint_failures or self.errors)


def stack_templates(assembly: Path) -> dict[str, tuple[Path, str]]:
    """Stack artifact id -> (template path, cfn-lint region) from the assembly manifest."""
    manifest = json.loads((assembly / "manifest.json").read_text())
    out = {}
    for name, artifact in manifest.get("artifacts", {}).items():
        if artifact.get("type") != "aws:cloudformation:stack":
            continue
        region = artifact.get("environment", "").rsplit("/", 1)[-1]
        if not region or region.startswith("unknown"):
            region = DEFAULT_LINT_REGION
        out[name] = (assembly / artifact["properties"]["templateFile"], region)
    return out


def read_nag(assembly: Path, result: AuditResult) -> None:
    report_file = assembly / "validation-report.json"
    if not report_file.exists():
        result.errors.append(f"{report_file} is missing: synthesize with the cdk-nag plugins attached "
                             "(app.py does; `make synth`)")
        return
    report = json.loads(report_file.read_text())
    for plugin in report.get("pluginReports", []):
        pack = plugin["pluginName"]
        for kind, target in (("violations", result.nag_open), ("suppressedViolations", result.nag_acknowledged)):
            for v in plugin.get(kind, []):
                for construct in v["violatingConstructs"]:
                    target.append(NagFinding(pack=pack, rule=v["ruleName"], path=construct["constructPath"],
                                             description=v["description"],
                                             acknowledged_id=v.get("acknowledgedId"),
                                             acknowledged_at=v.get("acknowledgedAt"), reason=v.get("reason")))
    used = {(f.acknowledged_id, f.acknowledged_at) for f in result.nag_acknowledged}
    for path, rule, reason in declared_acknowledgements(assembly):
        if (rule, path) not in used:
            result.stale_acknowledgements.append((path, rule, reason))


def declared_acknowledgements(assembly: Path) -> list[tuple[str, str, str]]:
    """(construct path, rule id, reason) for every nag acknowledgement recorded in the stacks' metadata."""
    out = []
    for meta_file in sorted(assembly.glob("*.metadata.json")):
        for path, entries in json.loads(meta_file.read_text()).items():
            for entry in entries:
                if entry.get("type") != "aws:cdk:acknowledged-rules":
                    continue
                for rule, reason in entry["data"].items():
                    if rule.split("::", 1)[0] in PACKS:
                        out.append((path.lstrip("/"), rule, reason))
    return out


def run_cfn_lint(templates: dict[str, tuple[Path, str]], result: AuditResult) -> None:
    from cfnlint.api import ManualArgs, lint_file  # imported late: it takes a few seconds

    for name, (template, region) in sorted(templates.items()):
        result.lint_regions[name] = region
        for match in lint_file(template, config=ManualArgs(regions=[region])):
            result.lint.append(LintFinding(template=template.name, rule=match.rule.id,
                                           severity=match.rule.severity, line=match.linenumber,
                                           message=match.message))


def audit(assembly: Path, *, lint: bool = True) -> AuditResult:
    result = AuditResult()
    if not (assembly / "manifest.json").exists():
        result.errors.append(f"{assembly} is not a cloud assembly (no manifest.json): run `make synth` first")
        return result
    read_nag(assembly, result)
    if lint:
        run_cfn_lint(stack_templates(assembly), result)
    return result


def render(result: AuditResult) -> str:
    lines: list[str] = []
    for pack in PACKS:
        opened = [f for f in result.nag_open if f.pack == pack]
        acked = [f for f in result.nag_acknowledged if f.pack == pack]
        lines.append(f"== cdk-nag {pack}: {len(opened)} open, {len(acked)} acknowledged")
        for f in opened:
            lines.append(f"  OPEN {f.rule}  {f.path}\n       {f.description}")
        for f in acked:
            lines.append(f"  ack  {f.rule}  {f.path}\n       reason: {f.reason}")
    if result.stale_acknowledgements:
        lines.append(f"== stale acknowledgements (match no finding; remove them): {len(result.stale_acknowledgements)}")
        for path, rule, _ in result.stale_acknowledgements:
            lines.append(f"  STALE {rule}  {path}")
    for name, region in sorted(result.lint_regions.items()):
        found = [f for f in result.lint if f.template.startswith(name + ".")]
        lines.append(f"== cfn-lint {name} (region {region}): {len(found)} findings")
        for f in found:
            lines.append(f"  {f.severity.upper()} {f.rule} {f.template}:{f.line} {f.message}")
    for err in result.errors:
        lines.append(f"ERROR {err}")
    lines.append("AUDIT PASSED: no open findings" if result.ok else "AUDIT FAILED: open findings above")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacks.audit", description=__doc__.split("\n")[0])
    parser.add_argument("assembly", type=Path, help="cloud assembly directory (cdk.out)")
    args = parser.parse_args(argv)
    result = audit(args.assembly)
    print(render(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
