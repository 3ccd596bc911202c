"""cdk-nag (AWS Solutions + HIPAA Security) and cfn-lint on every synthesized template.

Open nag findings already fail the synth (cdk-nag 3 is a CDK validation plugin); these tests
run the same audit as `make audit` on the assemblies and additionally catch stale
acknowledgements and cfn-lint errors/warnings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stacks.audit import PACKS, audit, render

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("variant", ["default", "gpu_only", "trn_only", "accounting", "private"])
def test_audit_passes_with_zero_open_findings(synthesized, variant):
    synth = synthesized(variant)
    result = audit(synth.outdir)
    assert result.ok, render(result)
    assert not result.nag_open and not result.stale_acknowledgements and not result.lint_failures
    assert {f.pack for f in result.nag_acknowledged} == set(PACKS)
    optional = {"Serving": "sana-serving", "Observability": "sana-observability"}
    stacks = {"sana-network", "sana-storage", "sana-cluster"} | {name for stack, name in optional.items()
                                                                 if stack in synth.templates}
    assert set(result.lint_regions) == stacks
    if variant == "trn_only":
        assert set(result.lint_regions.values()) == {"us-east-2"}


def test_every_acknowledgement_has_a_real_reason(default):
    result = audit(default.outdir, lint=False)
    assert len(result.nag_acknowledged) >= 20
    for finding in result.nag_acknowledged:
        assert finding.reason and len(finding.reason) > 60, finding


@pytest.mark.parametrize("variant", ["default", "accounting", "private"])
def test_compliance_runbook_lists_every_acknowledged_rule(synthesized, variant):
    runbook = (REPO / "runbooks" / "compliance.md").read_text()
    result = audit(synthesized(variant).outdir, lint=False)
    for finding in result.nag_acknowledged:
        rule = re.sub(r"\[.*", "", finding.rule)
        assert rule in runbook, rule


def test_audit_fails_on_an_open_finding(tmp_path, default):
    import json
    import shutil

    copy = tmp_path / "cdk.out"
    shutil.copytree(default.outdir, copy, ignore=shutil.ignore_patterns("asset.*"))
    report = json.loads((copy / "validation-report.json").read_text())
    moved = report["pluginReports"][0]["suppressedViolations"].pop()
    report["pluginReports"][0]["violations"].append(moved)
    (copy / "validation-report.json").write_text(json.dumps(report))
    result = audit(copy, lint=False)
    assert not result.ok
    assert [f.rule for f in result.nag_open] == [moved["ruleName"]]
    assert len(result.stale_acknowledgements) == 1  # its acknowledgement now matches nothing
    assert "AUDIT FAILED" in render(result)


def test_audit_fails_without_a_nag_report(tmp_path, default):
    import shutil

    copy = tmp_path / "cdk.out"
    shutil.copytree(default.outdir, copy, ignore=shutil.ignore_patterns("asset.*", "validation-report.json"))
    result = audit(copy, lint=False)
    assert not result.ok and "validation-report.json is missing" in result.errors[0]
