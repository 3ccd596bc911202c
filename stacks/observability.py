"""Observability (``observability=true``, the default): metrics, alerts and experiment tracking.

What it deploys (runbooks/observability.md says how each part is used):

- ``AWS::APS::Workspace`` (Amazon Managed Service for Prometheus) on the platform KMS key: the
  controller's collector remote-writes every node's and every training job's metrics there
  (lifecycle_scripts/observability.sh; the nodes' role may write to this workspace only,
  stacks/cluster.py);
- ``AWS::APS::RuleGroupsNamespace`` from observability/rules/alerts.yaml (GPU XID errors, GPU or
  NeuronCore idle while a job holds the node, a job without step progress for ``stallMinutes``,
  FSx above 85 %, a Slurm node down), the file promtool tests;
- the workspace's alert manager definition (observability/alertmanager.yaml) sending to an SNS
  topic on the platform key, which only this workspace may publish to; ``alertEmail`` subscribes
  an address;
- with ``grafana=true``: an Amazon Managed Grafana workspace (IAM Identity Center sign-in, which
  must be enabled in the account first) whose role may only read this Prometheus workspace; the
  dashboards are observability/dashboards/*.json, importable into any Grafana;
- with ``mlflowTrackingServer=true``: ``AWS::SageMaker::MlflowTrackingServer`` with its artifact
  store under ``mlflow/`` of the artefacts bucket (training's ``tracking.uri`` = its ARN).

The stack holds no training data; ``cdk destroy <project>-observability`` deletes the metrics
history with the workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_aps as aps
from aws_cdk import aws_grafana as grafana
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sagemaker as sagemaker
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from stacks.common import acknowledge
from stacks.config import PlatformConfig
from stacks.names import alerts_topic_name, bucket_arn, bucket_names, mlflow_role_name, mlflow_server_name
from stacks.observability_rules import alertmanager_definition, render_rules
from stacks.storage import StorageStack

MLFLOW_PREFIX = "mlflow"
#: what a Grafana data source reads from a workspace (the Prometheus-compatible query APIs,
#: https://docs.aws.amazon.com/prometheus/latest/userguide/AMP-APIReference-Prometheus-Compatible-Apis.html)
QUERY_ACTIONS = ["aps:QueryMetrics", "aps:GetSeries", "aps:GetLabels", "aps:GetMetricMetadata",
                 "aps:DescribeWorkspace"]


@dataclass(kw_only=True, frozen=True)
class ObservabilityProps:
    config: PlatformConfig
    key: kms.IKey


class AlertsTopic(Construct):
    """SNS topic on the platform key; only the workspace's alert manager publishes to it."""

    def __init__(self, scope: Construct, id: str, *, props: ObservabilityProps) -> None:
        super().__init__(scope, id)
        cfg = props.config
        self.topic = sns.Topic(self, "Topic", topic_name=alerts_topic_name(cfg.projectName), master_key=props.key,
                               enforce_ssl=True, display_name=f"{cfg.projectName} platform alerts")
        if cfg.alertEmail:
            self.topic.add_subscription(subscriptions.EmailSubscription(cfg.alertEmail))

    def allow_workspace(self, workspace_arn: str) -> None:
        """AMP publishes as aps.amazonaws.com (docs.aws.amazon.com/prometheus/latest/userguide/
        AMP-alertmanager-receiver-AMPpermission.html), pinned to this workspace."""
        self.topic.add_to_resource_policy(iam.PolicyStatement(
            sid="PrometheusWorkspacePublishes", principals=[iam.ServicePrincipal("aps.amazonaws.com")],
            actions=["sns:Publish", "sns:GetTopicAttributes"], resources=[self.topic.topic_arn],
            conditions={"ArnEquals": {"aws:SourceArn": workspace_arn},
                        "StringEquals": {"aws:SourceAccount": cdk.Aws.ACCOUNT_ID}}))


class MetricsWorkspace(Construct):
    """The Prometheus workspace, its rule groups and its alert manager definition."""

    def __init__(self, scope: Construct, id: str, *, props: ObservabilityProps, topic_arn: str) -> None:
        super().__init__(scope, id)
        cfg = props.config
        self.workspace = aps.CfnWorkspace(
            self, "Workspace", alias=f"{cfg.projectName}-{cfg.clusterName}", kms_key_arn=props.key.key_arn,
            alert_manager_definition=cdk.Fn.sub(alertmanager_definition(), {"SnsTopicArn": topic_arn}))
        self.rules = aps.CfnRuleGroupsNamespace(self, "Rules", name=f"{cfg.projectName}-alerts",
                                                workspace=self.workspace.attr_arn,
                                                data=render_rules(cfg.stallMinutes))

    @property
    def remote_write_url(self) -> str:
        # The workspace's PrometheusEndpoint ends with a slash (.../workspaces/ws-.../).
        return cdk.Fn.join("", [self.workspace.attr_prometheus_endpoint, "api/v1/remote_write"])


class ManagedGrafana(Construct):
    """Amazon Managed Grafana signed in through IAM Identity Center; its role reads one workspace."""

    def __init__(self, scope: Construct, id: str, *, props: ObservabilityProps, workspace_arn: str) -> None:
        super().__init__(scope, id)
        cfg = props.config
        self.policy = iam.ManagedPolicy(self, "ReadWorkspace", statements=[
            iam.PolicyStatement(sid="QueryThePlatformWorkspace", actions=QUERY_ACTIONS, resources=[workspace_arn]),
            iam.PolicyStatement(sid="FindWorkspaces", actions=["aps:ListWorkspaces"], resources=["*"]),
            iam.PolicyStatement(sid="DecryptThroughPrometheus", actions=["kms:Decrypt", "kms:DescribeKey"],
                                resources=[props.key.key_arn],
                                conditions={"StringEquals": {"kms:ViaService": f"aps.{cdk.Aws.REGION}.amazonaws.com"}}),
        ])
        acknowledge(self.policy, "AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                    "aps:ListWorkspaces does not support resource-level permissions (Service Authorization "
                    "Reference, Amazon Managed Service for Prometheus); it lists workspace names only.")
        self.role = iam.Role(self, "Role", managed_policies=[self.policy],
                             assumed_by=iam.ServicePrincipal("grafana.amazonaws.com", conditions={
                                 "StringEquals": {"aws:SourceAccount": cdk.Aws.ACCOUNT_ID}}),
                             description=f"{cfg.projectName} Grafana: read the platform's Prometheus workspace")
        self.workspace = grafana.CfnWorkspace(
            self, "Workspace", name=f"{cfg.projectName}-grafana", account_access_type="CURRENT_ACCOUNT",
            authentication_providers=["AWS_SSO"], permission_type="CUSTOMER_MANAGED", role_arn=self.role.role_arn,
            data_sources=["PROMETHEUS"], notification_destinations=["SNS"],
            description=f"{cfg.projectName}: cluster, accelerator and training dashboards")


class MlflowTracking(Construct):
    """SageMaker managed MLflow; artifacts under mlflow/ in the artefacts bucket, on the platform key."""

    def __init__(self, scope: Construct, id: str, *, props: ObservabilityProps) -> None:
        super().__init__(scope, id)
        cfg = props.config
        artefacts = bucket_arn(bucket_names(cfg.projectName)["artefacts"])
        self.policy = iam.ManagedPolicy(self, "ArtifactStore", statements=[
            iam.PolicyStatement(sid="ListArtefactsBucket", actions=["s3:ListBucket", "s3:GetBucketLocation"],
                                resources=[artefacts]),
            iam.PolicyStatement(sid="ReadWriteMlflowArtifacts",
                                actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                                resources=[f"{artefacts}/{MLFLOW_PREFIX}/*"]),
            iam.PolicyStatement(sid="UsePlatformKey", resources=[props.key.key_arn],
                                actions=["kms:Decrypt", "kms:GenerateDataKey", "kms:DescribeKey"]),
        ])
        acknowledge(self.policy, "AwsSolutions::AwsSolutions-IAM5[Resource::arn:<AWS::Partition>:s3:::"
                    f"{cfg.projectName}-artefacts-<AWS::AccountId>-<AWS::Region>/{MLFLOW_PREFIX}/*]",
                    "MLflow names artifact objects per run at run time; scoped to the mlflow/ prefix of the "
                    "artefacts bucket.")
        # A fixed name: the platform key's policy names this role as a key user (stacks/key_policy.py).
        self.role = iam.Role(self, "Role", role_name=mlflow_role_name(cfg.projectName),
                             assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com", conditions={
                                 "StringEquals": {"aws:SourceAccount": cdk.Aws.ACCOUNT_ID}}),
                             managed_policies=[self.policy],
                             description=f"{cfg.projectName} MLflow tracking server: its artifact store only")
        self.server = sagemaker.CfnMlflowTrackingServer(
            self, "Server", tracking_server_name=mlflow_server_name(cfg.projectName),
            artifact_store_uri=f"s3://{bucket_names(cfg.projectName)['artefacts']}/{MLFLOW_PREFIX}",
            role_arn=self.role.role_arn, tracking_server_size="Small", automatic_model_registration=False)


class ObservabilityStack(cdk.Stack):
    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, storage: StorageStack, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        props = ObservabilityProps(config=config, key=storage.buckets.key)
        self.alerts = AlertsTopic(self, "Alerts", props=props)
        self.metrics = MetricsWorkspace(self, "Metrics", props=props, topic_arn=self.alerts.topic.topic_arn)
        self.alerts.allow_workspace(self.metrics.workspace.attr_arn)
        self.grafana = ManagedGrafana(self, "Grafana", props=props, workspace_arn=self.metrics.workspace.attr_arn) \
            if config.grafana else None
        self.mlflow = MlflowTracking(self, "Mlflow", props=props) if config.mlflowTrackingServer else None
        outputs = {
            "PrometheusWorkspaceId": (self.metrics.workspace.attr_workspace_id, "Amazon Managed Prometheus workspace"),
            "PrometheusRemoteWriteUrl": (self.metrics.remote_write_url, "where the controller's collector writes"),
            "PrometheusQueryUrl": (cdk.Fn.join("", [self.metrics.workspace.attr_prometheus_endpoint, "api/v1/query"]),
                                   "PromQL queries (SigV4, e.g. awscurl --service aps)"),
            "AlertsTopicArn": (self.alerts.topic.topic_arn, "SNS topic the alerts go to (subscribe on-call here)"),
        }
        if self.grafana is not None:
            outputs["GrafanaUrl"] = (cdk.Fn.join("", ["https://", self.grafana.workspace.attr_endpoint]),
                                     "Amazon Managed Grafana (import observability/dashboards/*.json)")
        if self.mlflow is not None:
            outputs["MlflowTrackingServerArn"] = (self.mlflow.server.attr_tracking_server_arn,
                                                  "training config tracking.uri (sagemaker-mlflow plugin)")
        for key, (value, description) in outputs.items():
            cdk.CfnOutput(self, key, value=value, description=description)
