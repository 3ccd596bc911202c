"""The alert rules and the alert manager configuration, with the real tools: ``promtool test
rules`` proves every alert fires on a synthetic series of its failure and stays quiet on a
healthy one (observability/rules/alerts_test.yaml), for the file as deployed by default and
with another stallMinutes; ``amtool check-config`` reads the alert manager configuration as the
stack fills it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stacks.observability_rules import ALERTMANAGER_FILE, RULES_FILE, render_rules
from tests.observability.servers import binary

TESTS_FILE = RULES_FILE.with_name("alerts_test.yaml")
ALERTS = ("GpuXidError", "GpuIdleWhileJobHoldsNode", "NeuronCoreIdleWhileJobHoldsNode", "TrainingJobStalled",
          "FsxAlmostFull", "SlurmNodeDown")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_every_alert_fires_on_its_failure_and_not_on_a_healthy_series() -> None:
    checked = promtool("check", "rules", str(RULES_FILE), cwd=RULES_FILE.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    done = promtool("test", "rules", TESTS_FILE.name, cwd=RULES_FILE.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    tests = TESTS_FILE.read_text()
    for alert in ALERTS:  # each alert has a firing expectation and a quiet one
        assert re.search(rf"alertname: {alert}\n\s+exp_alerts:\n\s+- exp_labels", tests), alert
        assert re.search(rf"alertname: {alert}\n\s+exp_alerts: \[\]", tests), alert
    assert set(re.findall(r"- alert: (\w+)", RULES_FILE.read_text())) == set(ALERTS)


def test_the_tests_fail_when_an_alert_is_broken(tmp_path: Path) -> None:
    """The same tests against a rule file whose stall alert never fires: promtool says so."""
    broken = RULES_FILE.read_text().replace("changes(sana_training_last_step[30m]) == 0",
                                            "changes(sana_training_last_step[30m]) < 0")
    (tmp_path / "alerts.yaml").write_text(broken)
    shutil.copy(TESTS_FILE, tmp_path / TESTS_FILE.name)
    done = promtool("test", "rules", TESTS_FILE.name, cwd=tmp_path)
    assert done.returncode != 0 and "TrainingJobStalled" in done.stdout + done.stderr


def test_the_stall_window_follows_stall_minutes(tmp_path: Path) -> None:
    """stallMinutes=10: a job silent for 12 minutes alerts, one silent for 8 does not."""
    (tmp_path / "alerts.yaml").write_text(render_rules(10))
    (tmp_path / "stall_test.yaml").write_text("""rule_files: [alerts.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'sana_training_last_step{job_id="1", user="u", run_name="r", node="n"}'
        values: '0+1x20 20x40'
      - series: 'sana_training_start_time_seconds{job_id="1", user="u", run_name="r", node="n"}'
        values: '0x60'
    alert_rule_test:
      - eval_time: 28m
        alertname: TrainingJobStalled
        exp_alerts: []
      - eval_time: 32m
        alertname: TrainingJobStalled
        exp_alerts:
          - exp_labels: {severity: critical, job_id: "1", user: u, run_name: r, node: n}
            exp_annotations:
              summary: "job 1 (u, run r) made no step for the stall window"
              runbook: runbooks/observability.md#trainingjobstalled
""")
    done = promtool("test", "rules", "stall_test.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    with pytest.raises(ValueError, match="TrainingJobStalled must hold"):
        render_rules(10, text=RULES_FILE.read_text().replace("[30m]", "[20m]"))


def test_the_alert_manager_configuration_is_valid_as_the_stack_fills_it(tmp_path: Path) -> None:
    filled = ALERTMANAGER_FILE.read_text().replace("${SnsTopicArn}", "arn:aws:sns:us-east-1:123456789012:sana-alerts") \
        .replace("${AWS::Region}", "us-east-1")
    assert "${" not in filled
    (tmp_path / "alertmanager.yml").write_text(filled)
    done = subprocess.run([binary("amtool"), "check-config", str(tmp_path / "alertmanager.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout and "1 receivers" in done.stdout, done.stdout
