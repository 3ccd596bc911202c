"""The platform KMS key's policy: named administrators and users, every AWS service only for what it serves.

CDK's default key policy gives the account root `kms:*`, which lets ANY principal whose IAM
policy allows `kms:Decrypt` on `*` read the platform's data. Here the account keeps only what
keeps the key manageable (AWS: "Allows access to the AWS account and enables IAM policies",
https://docs.aws.amazon.com/kms/latest/developerguide/key-policy-default.html, is what prevents
an unmanageable key; administrators need the management actions, not the cryptographic ones,
https://docs.aws.amazon.com/kms/latest/developerguide/key-policy-default.html#key-policy-default-allow-administrators),
and every use of the key is a statement naming who and through what:

- administrators (``keyAdministrators``, else the account): management actions only, no
  encrypt/decrypt and no CreateGrant (a grant would hand them decrypt);
- users: the cluster execution role (its fixed name, stacks/storage.py execution_role_name) and
  the ``keyUsers`` ARNs, matched with aws:PrincipalArn on the account principal;
- the FSx data repositories' service-linked role, only through S3 and only for the data and
  artefacts buckets (the encryption context S3 passes, aws:s3:arn); the bucket policies pin it to
  this file system (stacks/storage.py), which the key cannot name (the file system is encrypted
  with this key, so naming it here would be a cycle);
- the BucketDeployment handler of the cluster stack, only through S3 for the lifecycle bucket;
- with ``serving=true``: the serving model's role (stacks/names.py serving_role_name) as a user
  (it decrypts the model archive and encrypts captured requests), and grants for AWS resources
  through SageMaker for whoever deploys the endpoint (its volume on this key; SageMaker API
  reference, CreateEndpointConfig ``KmsKeyId``);
- AWS services creating encrypted resources for CloudFormation (FSx, RDS, ECR, Secrets Manager,
  and SageMaker for the node volumes): grants for AWS resources only (kms:GrantIsForAWSResource);
- Secrets Manager for the account's principals (reading a secret is then decided by the
  secret's own IAM permissions);
- CloudWatch Logs for the platform's log groups and CloudTrail for its trail, each pinned by
  the encryption context the service passes.

Condition keys, as the Service Authorization Reference lists them:
kms:CallerAccount, kms:ViaService, kms:GrantIsForAWSResource, kms:EncryptionContext:${Key}
(https://docs.aws.amazon.com/service-authorization/latest/reference/list_awskeymanagementservice.html,
https://docs.aws.amazon.com/kms/latest/developerguide/conditions-kms.html); aws:PrincipalArn,
aws:SourceArn (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_condition-keys.html).
The encryption contexts: S3 aws:s3:arn, the bucket ARN with S3 Bucket Keys on
(https://docs.aws.amazon.com/AmazonS3/latest/userguide/UsingKMSEncryption.html#encryption-context);
CloudWatch Logs aws:logs:arn (https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/encrypt-log-data-kms.html);
CloudTrail aws:cloudtrail:arn (https://docs.aws.amazon.com/awscloudtrail/latest/userguide/create-kms-key-policy-for-cloudtrail.html).
"""

from __future__ import annotations

from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_iam as iam

#: Management of the key, nothing that encrypts, decrypts or grants (AWS's list for key
#: administrators, with kms:Create* narrowed to CreateAlias: Create* includes CreateGrant).
ADMIN_ACTIONS = [
    "kms:CreateAlias", "kms:UpdateAlias", "kms:DeleteAlias", "kms:Describe*", "kms:Enable*", "kms:List*",
    "kms:Put*", "kms:Update*", "kms:Revoke*", "kms:Disable*", "kms:Get*", "kms:TagResource",
    "kms:UntagResource", "kms:ScheduleKeyDeletion", "kms:CancelKeyDeletion", "kms:RotateKeyOnDemand",
]
USE_ACTIONS = ["kms:Decrypt", "kms:Encrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"]
#: Services that create encrypted resources from CloudFormation, through grants for themselves.
GRANTING_SERVICES = ("fsx", "rds", "ecr", "secretsmanager")


@dataclass(kw_only=True, frozen=True)
class KeyPolicyProps:
    project: str
    execution_role_arn: str
    bucket_arns: dict[str, str]
    """data / artefacts / lifecycle -> bucket ARN."""
    administrators: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    trail_arn: str | None = None
    log_group_arns: tuple[str, ...] = ()
    """ARN patterns (arn:...:log-group:NAME) of the log groups encrypted with the key."""
    serving_role_arn: str | None = None
    """Set with serving=true: the serving model's role (a key user), and endpoint volume grants."""
    observability: bool = False
    """observability=true: the Prometheus workspace's grants and the alerts topic's publisher."""
    alerts_topic_arn: str = ""
    """The alerts topic (stacks/names.py alerts_topic_arn), the encryption context SNS passes."""
    mlflow_role_arn: str | None = None
    """mlflowTrackingServer=true: the tracking server's role (a key user: its artifacts in S3)."""


def _account() -> str:
    return f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:root"


def _via(service: str) -> str:
    return f"{service}.{cdk.Aws.REGION}.amazonaws.com"


def platform_key_policy(p: KeyPolicyProps) -> iam.PolicyDocument:
    account = iam.ArnPrincipal(_account())
    in_account = {"kms:CallerAccount": cdk.Aws.ACCOUNT_ID}
    s3_context = "kms:EncryptionContext:aws:s3:arn"
    statements = [
        iam.PolicyStatement(
            sid="KeyAdministration",
            principals=[iam.ArnPrincipal(a) for a in p.administrators] or [account],
            actions=ADMIN_ACTIONS, resources=["*"]),
        iam.PolicyStatement(
            sid="KeyUsers",
            principals=[account], actions=USE_ACTIONS, resources=["*"],
            conditions={"ArnEquals": {"aws:PrincipalArn": [
                p.execution_role_arn, *p.users,
                *(arn for arn in (p.serving_role_arn, p.mlflow_role_arn) if arn)]}}),
        # HyperPod node volumes (smcluster-cmk.html "Permissions"): the execution role creates
        # grants for the volumes through SageMaker (stacks/cluster.py ExecutionRole does the same).
        iam.PolicyStatement(
            sid="NodeVolumeGrants",
            principals=[account], actions=["kms:CreateGrant"], resources=["*"],
            conditions={"StringEquals": {**in_account, "kms:ViaService": _via("sagemaker")},
                        "Bool": {"kms:GrantIsForAWSResource": "true"},
                        "ArnEquals": {"aws:PrincipalArn": p.execution_role_arn}}),
        iam.PolicyStatement(
            sid="ServicesCreateEncryptedResources",
            principals=[account], actions=["kms:CreateGrant", "kms:DescribeKey"], resources=["*"],
            conditions={"StringEquals": {**in_account, "kms:ViaService": [_via(s) for s in GRANTING_SERVICES]},
                        "Bool": {"kms:GrantIsForAWSResource": "true"}}),
        iam.PolicyStatement(
            sid="DescribeKeyInAccount",
            principals=[account], actions=["kms:DescribeKey"], resources=["*"],
            conditions={"StringEquals": in_account}),
        iam.PolicyStatement(
            sid="SecretsThroughSecretsManager",
            principals=[account], actions=["kms:Decrypt", "kms:GenerateDataKey*", "kms:DescribeKey"],
            resources=["*"],
            conditions={"StringEquals": {**in_account, "kms:ViaService": _via("secretsmanager")}}),
        # The FSx S3 service-linked role (AWSServiceRoleForFSxS3Access_<fs-id>) exists only once
        # the file system does, and a key policy cannot name a principal that does not exist yet:
        # matched by aws:PrincipalArn, with "*" as the principal.
        iam.PolicyStatement(
            sid="FsxDataRepositories",
            principals=[iam.AnyPrincipal()],
            actions=["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey"],
            resources=["*"],
            conditions={
                "StringEquals": {**in_account, "kms:ViaService": _via("s3")},
                "ArnLike": {"aws:PrincipalArn": (
                    f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/aws-service-role/"
                    "s3.data-source.lustre.fsx.amazonaws.com/AWSServiceRoleForFSxS3Access_*")},
                "StringLike": {s3_context: [arn for kind in ("data", "artefacts") for arn in _bucket_context(p, kind)]},
            }),
        iam.PolicyStatement(
            sid="LifecycleUploads",
            principals=[account], actions=["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*"],
            resources=["*"],
            conditions={
                "StringEquals": {**in_account, "kms:ViaService": _via("s3")},
                "ArnLike": {"aws:PrincipalArn": (f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/"
                                                 f"{p.project}-cluster-CustomCDKBucketDeploy*")},
                "StringLike": {s3_context: _bucket_context(p, "lifecycle")},
            }),
    ]
    if p.serving_role_arn:
        statements.append(iam.PolicyStatement(
            sid="EndpointVolumeGrants",
            principals=[account], actions=["kms:CreateGrant", "kms:DescribeKey"], resources=["*"],
            conditions={"StringEquals": {**in_account, "kms:ViaService": _via("sagemaker")},
                        "Bool": {"kms:GrantIsForAWSResource": "true"}}))
    if p.observability:
        statements += [
            # A workspace on a customer managed key: Amazon Managed Service for Prometheus uses the
            # key through grants it creates as the principal that creates the workspace, through APS
            # only (https://docs.aws.amazon.com/prometheus/latest/userguide/encryption-at-rest-Amazon-Service-Prometheus.html).
            iam.PolicyStatement(
                sid="PrometheusWorkspaceGrants",
                principals=[account], actions=["kms:CreateGrant", "kms:DescribeKey", "kms:Decrypt",
                                               "kms:GenerateDataKey"], resources=["*"],
                conditions={"StringEquals": {**in_account, "kms:ViaService": _via("aps")}}),
            # The alerts topic is encrypted with this key: the workspace's alert manager publishes to
            # it as aps.amazonaws.com, which needs these two actions on the topic's key
            # (https://docs.aws.amazon.com/prometheus/latest/userguide/AMP-alertmanager-receiver-AMPpermission.html),
            # for this account's workspaces and the alerts topic only: SNS passes the topic's ARN as
            # the encryption context aws:sns:topicArn
            # (https://docs.aws.amazon.com/sns/latest/dg/sns-key-management.html).
            iam.PolicyStatement(
                sid="PrometheusAlertsToEncryptedTopic",
                principals=[iam.ServicePrincipal("aps.amazonaws.com")],
                actions=["kms:GenerateDataKey*", "kms:Decrypt"], resources=["*"],
                conditions={"StringEquals": {"aws:SourceAccount": cdk.Aws.ACCOUNT_ID,
                                             "kms:EncryptionContext:aws:sns:topicArn": p.alerts_topic_arn},
                            "ArnLike": {"aws:SourceArn": f"arn:{cdk.Aws.PARTITION}:aps:{cdk.Aws.REGION}:"
                                                         f"{cdk.Aws.ACCOUNT_ID}:workspace/*"}}),
        ]
    if p.log_group_arns:
        statements.append(iam.PolicyStatement(
            sid="CloudWatchLogsForPlatformLogGroups",
            principals=[iam.ServicePrincipal(f"logs.{cdk.Aws.REGION}.amazonaws.com")],
            actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
            resources=["*"],
            conditions={"ArnLike": {"kms:EncryptionContext:aws:logs:arn": list(p.log_group_arns)}}))
    if p.trail_arn:
        trail_context = f"arn:{cdk.Aws.PARTITION}:cloudtrail:*:{cdk.Aws.ACCOUNT_ID}:trail/*"
        statements += [
            iam.PolicyStatement(
                sid="CloudTrailEncryptsLogs",
                principals=[iam.ServicePrincipal("cloudtrail.amazonaws.com")],
                actions=["kms:GenerateDataKey*"], resources=["*"],
                conditions={"StringLike": {"kms:EncryptionContext:aws:cloudtrail:arn": trail_context},
                            "StringEquals": {"aws:SourceArn": p.trail_arn}}),
            iam.PolicyStatement(
                sid="CloudTrailDescribesKey",
                principals=[iam.ServicePrincipal("cloudtrail.amazonaws.com")],
                actions=["kms:DescribeKey"], resources=["*"],
                conditions={"StringEquals": {"aws:SourceArn": p.trail_arn}}),
            # Reading the trail's log files (AWS's "Enable log file decryption" statement): only
            # objects whose context is a trail of this account, never the data.
            iam.PolicyStatement(
                sid="AccountReadsTrailLogs",
                principals=[account], actions=["kms:Decrypt", "kms:ReEncryptFrom"], resources=["*"],
                conditions={"StringEquals": in_account,
                            "StringLike": {"kms:EncryptionContext:aws:cloudtrail:arn": trail_context}}),
        ]
    return iam.PolicyDocument(statements=statements)


def _bucket_context(p: KeyPolicyProps, kind: str) -> list[str]:
    """S3's aws:s3:arn encryption context for a bucket: its ARN with Bucket Keys, an object ARN without."""
    arn = p.bucket_arns[kind]
    return [arn, f"{arn}/*"]
