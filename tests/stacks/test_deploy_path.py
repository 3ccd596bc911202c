"""The deploy path from any laptop: `make synth` / `make audit` / `make deploy` need Python,
Node and the CDK only (requirements-deploy.txt), never apt, sudo or the training stack; the
test targets keep installing everything they need.

The slow test builds that lean venv with the Makefile's own recipe (pip from the configured
index or cache) and runs the real `make audit` in it: the CDK CLI synthesizes the app with the
lean venv's Python and the audit runs cdk-nag + cfn-lint there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import skip_or_fail

REPO = Path(__file__).resolve().parents[2]
DEPLOY_TARGETS = ("setup-deploy", "synth", "audit", "deploy", "teardown", "teardown-all")


def dry_run(*targets: str, stamps: Path, venv: Path) -> str:
    """`make -n`: the commands a target would run on a fresh clone (no stamp yet), none run."""
    proc = subprocess.run(["make", "-n", *targets, f"STAMPS={stamps}", f"VENV={venv}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_deploy_targets_install_only_the_deploy_requirements(tmp_path):
    out = dry_run(*DEPLOY_TARGETS, stamps=tmp_path / "stamps", venv=tmp_path / "venv")
    assert f"{tmp_path}/venv/bin/python -m pip install --quiet -r requirements-deploy.txt" in out
    assert "npm ci" in out  # the CDK CLI, pinned by package-lock.json
    for forbidden in ("install-system-packages", "apt-get", "sudo", "-r requirements.txt", "requirements-gpu",
                      ".venv-xla", "requirements-xla"):
        assert forbidden not in out, forbidden
    # synth runs the app with the target's venv whatever cdk.json's "app" names.
    assert f'npx --no-install cdk synth --quiet --app "{tmp_path}/venv/bin/python app.py" --output cdk.out' in out
    assert "npx --no-install cdk deploy --all --app cdk.out --require-approval broadening" in out


def test_the_test_targets_still_install_everything(tmp_path):
    out = dry_run("test-platform", stamps=tmp_path / "stamps", venv=tmp_path / "venv")
    assert "bash scripts/install-system-packages.sh" in out and "-r requirements.txt" in out
    assert "requirements-xla-test.txt" in out


def test_teardown_destroys_the_compute_stacks_then_lists_what_stays(tmp_path):
    """runbooks/teardown.md's order: serving, cluster, (accounting protection off), storage +
    network; after each step, what still bills."""
    out = dry_run("teardown-all", stamps=tmp_path / "stamps", venv=tmp_path / "venv")
    steps = [line.strip() for line in out.splitlines()
             if "cdk destroy" in line or "-m stacks.cost" in line or "-m stacks.teardown" in line]
    assert [s.split("app.py\"")[-1].split("-m ")[-1].strip() for s in steps] == [
        "sana-serving ; fi", "sana-cluster", "stacks.cost kept --after teardown", "stacks.teardown unprotect-accounting",
        "sana-storage sana-network", "stacks.cost kept --after teardown-all"], steps


def test_requirements_txt_includes_the_deploy_pins():
    """One place pins the CDK app's packages: the test venv gets exactly the laptop's versions."""
    lines = (REPO / "requirements.txt").read_text().splitlines()
    assert "-r requirements-deploy.txt" in lines
    pins = [line for line in (REPO / "requirements-deploy.txt").read_text().splitlines() if "==" in line]
    assert {p.split("==")[0] for p in pins} == {"aws-cdk-lib", "constructs", "cdk-nag", "cfn-lint"}
    assert not [line for line in lines if line.split("==")[0] in {p.split("==")[0] for p in pins}]


@pytest.mark.slow
def test_a_lean_venv_synthesizes_and_audits_without_the_training_stack(tmp_path):
    stamps, venv = tmp_path / "stamps", tmp_path / "venv"
    stamps.mkdir()
    # The CDK CLI is installed (node_modules); a stamp newer than package.json/package-lock.json
    # keeps this test from running `npm ci` over the checkout's node_modules.
    (stamps / "npm").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["CDK_DISABLE_CLI_TELEMETRY"] = "true"
    setup = subprocess.run(["make", "setup-deploy", f"STAMPS={stamps}", f"VENV={venv}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=1800)
    if setup.returncode != 0:
        skip_or_fail(f"pip could not install requirements-deploy.txt: {setup.stderr.strip().splitlines()[-1:]}",
                     required_by="SANA_REQUIRE_ALL")
    python = venv / "bin" / "python"
    for module in ("torch", "numpy", "diffusers", "pytest", "boto3"):
        probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True)
        assert probe.returncode != 0, f"{module} is importable in the deploy venv"
    out = tmp_path / "cdk.out"
    audit = subprocess.run(["make", "audit", f"STAMPS={stamps}", f"VENV={venv}", f"CDK_OUT={out}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=1800)
    assert audit.returncode == 0, (audit.stdout + audit.stderr)[-4000:]
    assert {p.name for p in out.glob("*.template.json")} == {
        "sana-network.template.json", "sana-storage.template.json", "sana-cluster.template.json",
        "sana-observability.template.json"}
    assert "AUDIT PASSED: no open findings" in audit.stdout, audit.stdout[-2000:]
    # What `make teardown` runs after its destroys works there too.
    kept = subprocess.run([str(python), "-m", "stacks.cost", "kept", "--after", "teardown"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert kept.returncode == 0 and "fixed total: $" in kept.stdout, kept.stderr[-2000:]
    shutil.rmtree(venv)


def test_teardown_all_turns_off_the_accounting_databases_protection_only_where_there_is_one(tmp_path):
    """runbooks/teardown.md, step 1. The AWS CLI is a stand-in that records its arguments (no
    AWS account here); the command is what the runbook names."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "aws").write_text(f'#!/bin/sh\necho "$*" >>"{calls}"\n')
    (bin_dir / "aws").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = [str(REPO / ".venv/bin/python"), "-m", "stacks.teardown", "unprotect-accounting"]
    none = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert none.returncode == 0 and "no protected accounting database" in none.stdout and not calls.exists()
    db = subprocess.run([*run, "-c", "slurmAccounting=true", "-c", "deploymentGeneration=2"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
    assert db.returncode == 0, db.stderr
    assert calls.read_text() == ("rds modify-db-cluster --db-cluster-identifier sana-g2-slurm-accounting "
                                 "--no-deletion-protection --apply-immediately\n")
    (bin_dir / "aws").write_text('#!/bin/sh\necho "An error occurred (AccessDenied) when calling ModifyDBCluster" >&2\n'
                                 "exit 254\n")
    denied = subprocess.run([*run, "-c", "slurmAccounting=true"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert denied.returncode == 1
    assert denied.stderr == ("error: turning off the accounting database's deletion protection failed: An error "
                             "occurred (AccessDenied) when calling ModifyDBCluster; the storage stack cannot be "
                             "deleted while it is on\n")
