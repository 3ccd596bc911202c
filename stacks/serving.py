"""Serving: a SageMaker real-time endpoint for a packaged model (``-c serving=true``).

What it deploys (runbooks/serving.md walks through compile, package, deploy, invoke, scale,
roll back and tear down):

- an execution role SageMaker assumes for the model: read exactly the model object, decrypt
  it with the platform key, pull the one DLC repository, write the endpoint's logs and
  metrics, manage its network interfaces in the cluster subnet; with data capture on, write
  ``serving-capture/`` in the artefacts bucket;
- ``AWS::SageMaker::Model``: the inference DLC image (stacks/serving_config.py, one table by
  region; or ``servingImage``) with ``ModelDataUrl`` = ``servingModelDataUrl``, in the cluster's
  private subnet and security group (``VpcConfig``), reaching S3 through the VPC's gateway
  endpoint and PyPI (``code/requirements.txt``) through the NAT gateway;
- ``AWS::SageMaker::EndpointConfig``: one variant ``main`` on ``servingInstanceType``, the
  volume encrypted with the platform KMS key, except on instance types with NVMe instance
  storage (ml.g6.*), where CreateEndpointConfig refuses a ``KmsKeyId`` and the local volume is
  encrypted by the instance's hardware module (SageMaker API reference, CreateEndpointConfig
  ``KmsKeyId``); data capture only with ``servingDataCapture=true`` (prompts may be PHI), then
  encrypted with the platform key;
- ``AWS::SageMaker::Endpoint`` named ``<project>-serving``: blue/green updates that roll back by
  themselves when the new fleet answers 5XX (``DeploymentConfig``); the scaled instance count
  kept across model updates (``RetainAllVariantProperties``);
- Application Auto Scaling on ``SageMakerVariantInvocationsPerInstance`` between 1 and
  ``servingMaxInstances`` instances.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_iam as iam
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from stacks.cluster import nag_bucket_arn
from stacks.common import acknowledge, log_group
from stacks.config import PlatformConfig
from stacks.names import bucket_names, endpoint_name, serving_role_name
from stacks.network import Network
from stacks.serving_config import (
    DLC_ACCOUNTS,
    DLC_IMAGES,
    dlc_image_uri,
    has_local_storage,
    image_kind,
    model_data_location,
)
from stacks.storage import StorageStack

VARIANT = "main"
CAPTURE_PREFIX = "serving-capture/"
#: seconds SageMaker waits for /ping after the container starts (max 3600): pip-installing
#: code/requirements.txt, loading ~9 GB of weights or Neuron graphs and warming up take minutes
STARTUP_HEALTH_CHECK_S = 1800
MODEL_DOWNLOAD_S = 1800
#: EBS volume for EBS-only instance types (model.tar.gz is downloaded and extracted onto it)
VOLUME_GB = 64
#: the container environment the inference toolkit reads (sagemaker-inference-toolkit parameters.py)
CONTAINER_ENV = {
    "SAGEMAKER_PROGRAM": "inference.py",
    "SAGEMAKER_SUBMIT_DIRECTORY": "/opt/ml/model/code",
    # one pipeline per instance: SanaPipeline runs one request at a time (training/serve/runtime.py)
    "SAGEMAKER_MODEL_SERVER_WORKERS": "1",
    "SAGEMAKER_MODEL_SERVER_TIMEOUT": "60",
    "SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT": "application/json",
}


class ServingStack(cdk.Stack):
    """The endpoint; ``cdk destroy <project>-serving`` removes it (it holds no data)."""

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, network: Network,
                 storage: StorageStack, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        cfg = config
        key = storage.buckets.key
        kind = image_kind(cfg.servingInstanceType)
        image, repository_arn = self._image(cfg, kind)
        model_bucket, model_key = model_data_location(cfg.servingModelDataUrl)
        artefacts = bucket_names(cfg.retained_prefix)["artefacts"]
        part = cdk.Aws.PARTITION
        ec2_arn = f"arn:{part}:ec2:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}"
        statements = [
            iam.PolicyStatement(sid="ReadModelData", actions=["s3:GetObject"],
                                resources=[f"arn:{part}:s3:::{model_bucket}/{model_key}"]),
            iam.PolicyStatement(sid="DecryptWithPlatformKey", actions=["kms:Decrypt", "kms:DescribeKey"],
                                resources=[key.key_arn]),
            iam.PolicyStatement(sid="PullInferenceImage", resources=[repository_arn],
                                actions=["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
                                         "ecr:BatchCheckLayerAvailability"]),
            iam.PolicyStatement(sid="RegistryLogin", actions=["ecr:GetAuthorizationToken"], resources=["*"]),
            iam.PolicyStatement(
                sid="EndpointLogs", actions=["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents",
                                             "logs:DescribeLogStreams"],
                resources=[f"arn:{part}:logs:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:log-group:/aws/sagemaker/Endpoints/*"]),
            iam.PolicyStatement(sid="EndpointMetrics", actions=["cloudwatch:PutMetricData"], resources=["*"],
                                conditions={"StringLike": {"cloudwatch:namespace": "/aws/sagemaker/*"}}),
            # A model in a VPC: SageMaker creates its ENIs as this role (docs.aws.amazon.com/sagemaker/
            # latest/dg/host-vpc.html, "Give SageMaker AI Access to Resources in your Amazon VPC").
            iam.PolicyStatement(
                sid="CreateEndpointInterfacesInClusterSubnet",
                actions=["ec2:CreateNetworkInterface", "ec2:CreateNetworkInterfacePermission"],
                resources=[f"{ec2_arn}:network-interface/*", f"{ec2_arn}:subnet/{network.cluster_subnet.ref}",
                           f"{ec2_arn}:security-group/{network.security_group.security_group_id}"]),
            iam.PolicyStatement(sid="ManageEndpointInterfaces",
                                actions=["ec2:DeleteNetworkInterface", "ec2:DeleteNetworkInterfacePermission"],
                                resources=[f"{ec2_arn}:network-interface/*"]),
            iam.PolicyStatement(sid="DescribeNetwork", resources=["*"],
                                actions=["ec2:DescribeNetworkInterfaces", "ec2:DescribeVpcs", "ec2:DescribeDhcpOptions",
                                         "ec2:DescribeSubnets", "ec2:DescribeSecurityGroups"]),
        ]
        if cfg.servingDataCapture:
            statements.append(iam.PolicyStatement(
                sid="WriteDataCapture", actions=["s3:PutObject"],
                resources=[f"arn:{part}:s3:::{artefacts}/{CAPTURE_PREFIX}*"]))
            statements.append(iam.PolicyStatement(sid="EncryptDataCapture", resources=[key.key_arn],
                                                  actions=["kms:GenerateDataKey", "kms:Encrypt"]))
        self.policy = iam.ManagedPolicy(self, "ModelAccess", statements=statements)
        # A fixed name: the platform key's policy (storage stack) names this role as a key user.
        self.role = iam.Role(self, "ModelRole", assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
                             role_name=serving_role_name(cfg.projectName), managed_policies=[self.policy],
                             description=f"{cfg.projectName} serving: the model's data, image, logs and VPC ENIs only")
        self._acknowledge_policy(cfg, model_bucket)

        self.model = sagemaker.CfnModel(
            self, "Model", execution_role_arn=self.role.role_arn,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image, model_data_url=cfg.servingModelDataUrl, environment=dict(CONTAINER_ENV)),
            vpc_config=sagemaker.CfnModel.VpcConfigProperty(
                security_group_ids=[network.security_group.security_group_id], subnets=[network.cluster_subnet.ref]))
        local = has_local_storage(cfg.servingInstanceType)
        variant = sagemaker.CfnEndpointConfig.ProductionVariantProperty(
            variant_name=VARIANT, model_name=self.model.attr_model_name, initial_instance_count=1,
            initial_variant_weight=1.0, instance_type=cfg.servingInstanceType,
            container_startup_health_check_timeout_in_seconds=STARTUP_HEALTH_CHECK_S,
            model_data_download_timeout_in_seconds=MODEL_DOWNLOAD_S,
            # instance storage has a fixed size: no EBS volume is attached to size
            volume_size_in_gb=None if local else VOLUME_GB)
        capture = None
        if cfg.servingDataCapture:
            capture = sagemaker.CfnEndpointConfig.DataCaptureConfigProperty(
                enable_capture=True, initial_sampling_percentage=100,
                destination_s3_uri=f"s3://{artefacts}/{CAPTURE_PREFIX}", kms_key_id=key.key_arn,
                capture_options=[sagemaker.CfnEndpointConfig.CaptureOptionProperty(capture_mode="Input"),
                                 sagemaker.CfnEndpointConfig.CaptureOptionProperty(capture_mode="Output")])
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self, "EndpointConfig", production_variants=[variant], data_capture_config=capture,
            kms_key_id=None if local else key.key_arn)
        if local:
            acknowledge(self.endpoint_config, "HIPAA.Security::HIPAA.Security-SageMakerEndpointConfigurationKMSKeyConfigured",
                        f"{cfg.servingInstanceType} has NVMe instance storage, which its hardware module encrypts; "
                        "CreateEndpointConfig fails when a KmsKeyId is given for such an instance type (SageMaker "
                        "API reference, CreateEndpointConfig KmsKeyId). Use ml.inf2.* for a volume on the platform key.")

        name = endpoint_name(cfg.projectName)
        # SageMaker writes the endpoint's container logs to /aws/sagemaker/Endpoints/<name>, a group
        # it would create itself, never expiring and without the platform key: made here first,
        # with the platform's retention and key (the key policy admits CloudWatch Logs for it).
        self.log_group = log_group(self, "EndpointLogs", retention_days=cfg.logRetentionDays, key=key,
                                   removal=cdk.RemovalPolicy.DESTROY, name=f"/aws/sagemaker/Endpoints/{name}")
        self.errors_alarm = cloudwatch.Alarm(
            self, "Errors5xx", alarm_description=f"{name}: the endpoint answers 5XX (rolls a deployment back)",
            metric=cloudwatch.Metric(namespace="AWS/SageMaker", metric_name="Invocation5XXErrors",
                                     dimensions_map={"EndpointName": name, "VariantName": VARIANT},
                                     statistic="Sum", period=cdk.Duration.minutes(1)),
            threshold=1, evaluation_periods=2, datapoints_to_alarm=2,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING)
        acknowledge(self.errors_alarm.node.default_child, "HIPAA.Security::HIPAA.Security-CloudWatchAlarmAction",
                    "This alarm's consumer is the endpoint's deployment guardrail: SageMaker reads its state to roll "
                    "a blue/green update back (Endpoint DeploymentConfig AutoRollbackConfiguration), not through an "
                    "alarm action. Paging on it is an organisation choice (add an SNS action to the alarm).")
        self.endpoint = sagemaker.CfnEndpoint(
            self, "Endpoint", endpoint_name=name, endpoint_config_name=self.endpoint_config.attr_endpoint_config_name,
            # An update (new model, new endpoint config) keeps the instance count auto scaling set
            # (SageMaker API reference, UpdateEndpoint RetainAllVariantProperties).
            retain_all_variant_properties=True,
            deployment_config=sagemaker.CfnEndpoint.DeploymentConfigProperty(
                blue_green_update_policy=sagemaker.CfnEndpoint.BlueGreenUpdatePolicyProperty(
                    traffic_routing_configuration=sagemaker.CfnEndpoint.TrafficRoutingConfigProperty(
                        type="ALL_AT_ONCE", wait_interval_in_seconds=0),
                    termination_wait_in_seconds=600, maximum_execution_timeout_in_seconds=3600),
                auto_rollback_configuration=sagemaker.CfnEndpoint.AutoRollbackConfigProperty(
                    alarms=[sagemaker.CfnEndpoint.AlarmProperty(alarm_name=self.errors_alarm.alarm_name)])))

        self.endpoint.node.add_dependency(self.log_group)  # the group exists before SageMaker writes to it
        # Target tracking on invocations per instance per minute; the service-linked role
        # AWSServiceRoleForApplicationAutoScaling_SageMakerEndpoint acts (no RoleARN given).
        self.scaling_target = appscaling.CfnScalableTarget(
            self, "ScalingTarget", service_namespace="sagemaker", scalable_dimension="sagemaker:variant:DesiredInstanceCount",
            resource_id=f"endpoint/{self.endpoint.attr_endpoint_name}/variant/{VARIANT}",
            min_capacity=1, max_capacity=cfg.servingMaxInstances)
        self.scaling_policy = appscaling.CfnScalingPolicy(
            self, "ScalingPolicy", policy_name=f"{name}-invocations-per-instance", policy_type="TargetTrackingScaling",
            scaling_target_id=self.scaling_target.ref,
            target_tracking_scaling_policy_configuration=appscaling.CfnScalingPolicy.TargetTrackingScalingPolicyConfigurationProperty(
                target_value=float(cfg.servingInvocationsPerInstance),
                predefined_metric_specification=appscaling.CfnScalingPolicy.PredefinedMetricSpecificationProperty(
                    predefined_metric_type="SageMakerVariantInvocationsPerInstance"),
                scale_in_cooldown=600, scale_out_cooldown=300))
        for key_, (value, description) in {
            "EndpointName": (self.endpoint.attr_endpoint_name, "aws sagemaker-runtime invoke-endpoint --endpoint-name ..."),
            "EndpointInstanceType": (cfg.servingInstanceType, "instance type of variant main"),
            "ModelDataUrl": (cfg.servingModelDataUrl, "the model.tar.gz this endpoint serves"),
            "ServingImage": (image, "inference container image"),
        }.items():
            cdk.CfnOutput(self, key_, value=value, description=description)

    def _image(self, cfg: PlatformConfig, kind: str) -> tuple[str, str]:
        """(image URI, ECR repository ARN) from servingImage or the DLC table (a mapping when the
        stack is region-agnostic, so the image resolves to the deploy region's registry)."""
        part = cdk.Aws.PARTITION
        if cfg.servingImage:
            registry, _, rest = cfg.servingImage.partition("/")
            account, region = registry.split(".")[0], registry.split(".")[3]
            repository = rest.split("@")[0].split(":")[0]
            return cfg.servingImage, f"arn:{part}:ecr:{region}:{account}:repository/{repository}"
        repository, tag = DLC_IMAGES[kind]
        if cfg.region:
            return dlc_image_uri(cfg.region, kind), (
                f"arn:{part}:ecr:{cfg.region}:{DLC_ACCOUNTS[cfg.region]}:repository/{repository}")
        mapping = cdk.CfnMapping(self, "DlcRegistry", mapping={
            region: {"account": account, "domain": "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"}
            for region, account in sorted(DLC_ACCOUNTS.items())})
        account = mapping.find_in_map(cdk.Aws.REGION, "account")
        domain = mapping.find_in_map(cdk.Aws.REGION, "domain")
        return (f"{account}.dkr.ecr.{cdk.Aws.REGION}.{domain}/{repository}:{tag}",
                f"arn:{part}:ecr:{cdk.Aws.REGION}:{account}:repository/{repository}")

    def _acknowledge_policy(self, cfg: PlatformConfig, model_bucket: str) -> None:
        reasons = {
            "Resource::*": "ecr:GetAuthorizationToken, cloudwatch:PutMetricData (limited to the /aws/sagemaker/* "
                           "namespaces by condition) and the ec2:Describe* actions do not support resource-level "
                           "permissions (Service Authorization Reference); none of them reads or changes data.",
            "Resource::arn:<AWS::Partition>:logs:<AWS::Region>:<AWS::AccountId>:log-group:/aws/sagemaker/Endpoints/*":
                "SageMaker names the endpoint's log group and streams at deploy time; scoped to endpoint log "
                "groups of this account and region.",
            "Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:<AWS::AccountId>:network-interface/*":
                "SageMaker creates the endpoint's ENIs with IDs not known in advance; creation is limited to the "
                "cluster subnet and security group.",
        }
        # (the ARNs above are built from the AWS::Partition pseudo parameter, so cdk-nag prints it
        # as <AWS::Partition> whether or not the stack is pinned to a region)
        if cfg.servingDataCapture:
            reasons[f"Resource::{nag_bucket_arn(cfg.retained_prefix, 'artefacts')}/{CAPTURE_PREFIX}*"] = (
                "Captured requests/responses are new objects under one prefix of the artefacts bucket.")
        for finding, reason in reasons.items():
            acknowledge(self.policy, f"AwsSolutions::AwsSolutions-IAM5[{finding}]", reason)
