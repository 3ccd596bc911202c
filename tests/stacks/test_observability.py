"""The <project>-observability stack: the Prometheus workspace on the platform key, the rule
groups from observability/rules/alerts.yaml (the file promtool tests), the alert manager to an
SNS topic on the platform key that only the workspace may publish to, the nodes' role limited to
remote-writing into that one workspace; Grafana and MLflow when asked (``accounting`` variant);
nothing of it with observability=false (``trn_only``)."""

from __future__ import annotations

import json

import pytest

from stacks.config import ConfigError, PlatformConfig
from stacks.observability_rules import RULES_FILE, alertmanager_definition, render_rules

pytestmark = pytest.mark.slow


def one(synth, stack: str, type_: str) -> tuple[str, dict]:
    (item,) = synth.resources(stack, type_).items()
    return item[0], item[1]["Properties"]


def imported(synth, stack: str, value) -> dict:
    (name,) = [out["Export"]["Name"] for out in synth.templates[stack]["Outputs"].values()
               if "Export" in out and out["Value"] == value]
    return {"Fn::ImportValue": name}


def platform_key(synth) -> dict:
    (key_id,) = synth.resources("Storage", "AWS::KMS::Key")
    return imported(synth, "Storage", {"Fn::GetAtt": [key_id, "Arn"]})


def statements(synth, stack: str, policy_id_part: str) -> dict[str, dict]:
    (policy,) = [p for k, p in synth.resources(stack, "AWS::IAM::ManagedPolicy").items() if policy_id_part in k]
    return {st["Sid"]: st for st in policy["Properties"]["PolicyDocument"]["Statement"]}


def key_policy(synth) -> dict[str, dict]:
    (key,) = synth.resources("Storage", "AWS::KMS::Key").values()
    return {st.get("Sid", ""): st for st in key["Properties"]["KeyPolicy"]["Statement"]}


def test_workspace_rules_and_alerts_topic_are_on_the_platform_key(default):
    workspace_id, workspace = one(default, "Observability", "AWS::APS::Workspace")
    assert workspace["KmsKeyArn"] == platform_key(default)
    _, rules = one(default, "Observability", "AWS::APS::RuleGroupsNamespace")
    assert rules["Workspace"] == {"Fn::GetAtt": [workspace_id, "Arn"]}
    assert rules["Data"] == RULES_FILE.read_text()  # the file promtool tests, as it is (stallMinutes 30)
    topic_id, topic = one(default, "Observability", "AWS::SNS::Topic")
    assert topic["KmsMasterKeyId"] == platform_key(default)
    body, variables = workspace["AlertManagerDefinition"]["Fn::Sub"]
    assert body == alertmanager_definition() and variables == {"SnsTopicArn": {"Ref": topic_id}}
    _, policy = one(default, "Observability", "AWS::SNS::TopicPolicy")
    publish = [st for st in policy["PolicyDocument"]["Statement"] if st.get("Sid") == "PrometheusWorkspacePublishes"]
    assert publish == [{
        "Sid": "PrometheusWorkspacePublishes", "Effect": "Allow", "Principal": {"Service": "aps.amazonaws.com"},
        "Action": ["sns:GetTopicAttributes", "sns:Publish"], "Resource": {"Ref": topic_id},
        "Condition": {"ArnEquals": {"aws:SourceArn": {"Fn::GetAtt": [workspace_id, "Arn"]}},
                      "StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}}}]
    # The key admits the service for exactly what the workspace and the topic need.
    keys = key_policy(default)
    assert keys["PrometheusWorkspaceGrants"]["Condition"]["StringEquals"]["kms:ViaService"] == \
        {"Fn::Join": ["", ["aps.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}
    assert keys["PrometheusAlertsToEncryptedTopic"]["Principal"] == {"Service": "aps.amazonaws.com"}
    assert not synth_types(default) & {"AWS::Grafana::Workspace", "AWS::SageMaker::MlflowTrackingServer"}


def synth_types(synth) -> set[str]:
    return {r["Type"] for r in synth.templates["Observability"]["Resources"].values()}


def test_the_nodes_may_only_remote_write_to_the_platform_workspace(default):
    workspace_id, _ = one(default, "Observability", "AWS::APS::Workspace")
    policy = statements(default, "Cluster", "PlatformAccess")
    write = policy["RemoteWriteToThePlatformWorkspace"]
    assert write["Action"] == "aps:RemoteWrite"
    assert write["Resource"] == imported(default, "Observability", {"Fn::GetAtt": [workspace_id, "Arn"]})
    everything = json.dumps(default.templates["Cluster"])
    assert "AmazonPrometheusRemoteWriteAccess" not in everything and '"aps:*"' not in everything
    assert not [st for st in policy.values() if any(a.startswith("ecr:") for a in
                                                    (st["Action"] if isinstance(st["Action"], list) else [st["Action"]]))]


def test_grafana_mlflow_email_and_the_stall_window_when_asked(accounting):
    _, rules = one(accounting, "Observability", "AWS::APS::RuleGroupsNamespace")
    assert rules["Data"] == render_rules(45)
    assert "changes(sana_training_last_step[45m]) == 0" in rules["Data"] and "> 2700" in rules["Data"]
    _, grafana = one(accounting, "Observability", "AWS::Grafana::Workspace")
    assert grafana["AuthenticationProviders"] == ["AWS_SSO"] and grafana["DataSources"] == ["PROMETHEUS"]
    assert grafana["PermissionType"] == "CUSTOMER_MANAGED"
    reads = statements(accounting, "Observability", "GrafanaReadWorkspace")["QueryThePlatformWorkspace"]
    assert "aps:RemoteWrite" not in reads["Action"] and "aps:QueryMetrics" in reads["Action"]
    _, server = one(accounting, "Observability", "AWS::SageMaker::MlflowTrackingServer")
    assert server["TrackingServerName"] == "sana-mlflow"
    assert server["ArtifactStoreUri"] == {"Fn::Join": ["", ["s3://sana-artefacts-", {"Ref": "AWS::AccountId"}, "-",
                                                            {"Ref": "AWS::Region"}, "/mlflow"]]}
    assert server["AutomaticModelRegistration"] is False
    store = statements(accounting, "Observability", "MlflowArtifactStore")
    assert json.dumps(store["ReadWriteMlflowArtifacts"]["Resource"]).endswith('/mlflow/*"]]}')
    users = key_policy(accounting)["KeyUsers"]["Condition"]["ArnEquals"]["aws:PrincipalArn"]
    assert any("sana-mlflow-" in json.dumps(u) for u in users)
    mlflow = statements(accounting, "Cluster", "PlatformAccess")["TrackRunsOnThePlatformMlflow"]
    assert json.dumps(mlflow["Resource"]).endswith(':mlflow-tracking-server/sana-mlflow"]]}')
    _, subscription = one(accounting, "Observability", "AWS::SNS::Subscription")
    assert subscription["Protocol"] == "email" and subscription["Endpoint"] == "oncall@example.com"


def test_observability_off_leaves_no_stack_and_no_permission(trn_only):
    assert "Observability" not in trn_only.templates
    assert "aps:" not in json.dumps(trn_only.templates["Cluster"])
    assert "PrometheusWorkspaceGrants" not in key_policy(trn_only)


@pytest.mark.parametrize("context,key", [
    ({"stallMinutes": "2"}, "stallMinutes"),
    ({"observability": "false", "grafana": "true"}, "grafana"),
    ({"observability": "false", "mlflowTrackingServer": "true"}, "mlflowTrackingServer"),
    ({"alertEmail": "not-an-address"}, "alertEmail"),
])
def test_bad_observability_keys_fail_in_one_line(context, key):
    with pytest.raises(ConfigError) as err:
        PlatformConfig.from_context(context)
    assert err.value.key == key and "\n" not in str(err.value)
