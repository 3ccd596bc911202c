"""Storage: the platform KMS key, the data / artefacts / lifecycle buckets and FSx for Lustre.

Data flow (DESIGN.md): S3 features -> FSx `/data` (imported automatically) -> training on
`/fsx`; reports and other artefacts under FSx `/artefacts` are exported to the artefacts
bucket automatically. Checkpoints are mirrored to S3 by the training package itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.accounting import AccountingDatabase, AccountingDatabaseProps
from stacks.common import acknowledge, removal_policy
from stacks.config import PlatformConfig
from stacks.network import ACCESS_LOG_PREFIX, Network

FSX_DATA_PATH = "/data"
FSX_ARTEFACTS_PATH = "/artefacts"
ALL_EVENTS = ["NEW", "CHANGED", "DELETED"]


def bucket_names(project: str) -> dict[str, str]:
    """Deterministic bucket names (with the account/region pseudo parameters as tokens).

    Named rather than generated so that other stacks, IAM statements and the nodes'
    platform-settings.json refer to them without cross-stack exports, and so that audit
    findings show readable ARNs. HyperPod's managed instance policy
    (AmazonSageMakerClusterInstanceRolePolicy) only reaches buckets named sagemaker-*,
    hence the lifecycle bucket's prefix.
    """
    suffix = f"{cdk.Aws.ACCOUNT_ID}-{cdk.Aws.REGION}"
    return {"data": f"{project}-data-{suffix}", "artefacts": f"{project}-artefacts-{suffix}",
            "lifecycle": f"sagemaker-{project}-lc-{suffix}"}


@dataclass(kw_only=True, frozen=True)
class BucketsProps:
    project: str
    access_logs: s3.IBucket
    removal_policy: cdk.RemovalPolicy


class Buckets(Construct):
    """KMS key + the three platform buckets, all SSE-KMS, versioned, SSL-only, private, logged."""

    def __init__(self, scope: Construct, id: str, *, props: BucketsProps) -> None:
        super().__init__(scope, id)
        self.key = kms.Key(
            self, "Key", enable_key_rotation=True, removal_policy=props.removal_policy,
            alias=f"alias/{props.project}-platform",
            description=f"{props.project}: encrypts the platform buckets, FSx, node EBS volumes and accounting DB")
        # FSx data repository associations read/write the SSE-KMS buckets as the FSx service-
        # linked role AWSServiceRoleForFSxS3Access_<fs-id>, which needs the key through S3
        # (docs.aws.amazon.com/fsx/latest/LustreGuide/s3-server-side-encryption-support.html).
        # That role only exists once the file system does and a key policy cannot name a
        # principal that does not exist yet, so the statement matches it by ARN pattern.
        self.key.add_to_resource_policy(iam.PolicyStatement(
            sid="FsxS3DataRepositoryServiceLinkedRole",
            principals=[iam.AnyPrincipal()],
            actions=["kms:Encrypt", "kms:Decrypt", "kms:ReEncryptFrom", "kms:ReEncryptTo",
                     "kms:GenerateDataKey", "kms:DescribeKey"],
            resources=["*"],
            conditions={
                "StringEquals": {"kms:CallerAccount": cdk.Aws.ACCOUNT_ID,
                                 "kms:ViaService": f"s3.{cdk.Aws.REGION}.amazonaws.com"},
                "ArnLike": {"aws:PrincipalArn": (
                    f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/aws-service-role/"
                    "s3.data-source.lustre.fsx.amazonaws.com/AWSServiceRoleForFSxS3Access_*")},
            },
        ))
        # HyperPod node volumes on this key (VolumeKmsKeyId): the key policy lets the cluster
        # execution role create grants for AWS resources through SageMaker and describe the
        # key, as docs.aws.amazon.com/sagemaker/latest/dg/smcluster-cmk.html ("Permissions")
        # lists. The role lives in the cluster stack, created after this key, and a key policy
        # cannot name a principal that does not exist yet (nor may this stack import from the
        # cluster stack), so the role is matched by the name CloudFormation gives it
        # (<cluster stack name>-<logical id>-<suffix>). The execution role's own policy grants
        # the same two actions (stacks/cluster.py, ExecutionRole).
        execution_role_arn = (f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/"
                              f"{props.project}-cluster-*")
        self.key.add_to_resource_policy(iam.PolicyStatement(
            sid="HyperPodNodeVolumesCreateGrant",
            principals=[iam.AnyPrincipal()],
            actions=["kms:CreateGrant"],
            resources=["*"],
            conditions={
                "StringEquals": {"kms:CallerAccount": cdk.Aws.ACCOUNT_ID,
                                 "kms:ViaService": f"sagemaker.{cdk.Aws.REGION}.amazonaws.com"},
                "Bool": {"kms:GrantIsForAWSResource": "true"},
                "ArnLike": {"aws:PrincipalArn": execution_role_arn},
            },
        ))
        self.key.add_to_resource_policy(iam.PolicyStatement(
            sid="HyperPodNodeVolumesDescribeKey",
            principals=[iam.AnyPrincipal()],
            actions=["kms:DescribeKey"],
            resources=["*"],
            conditions={
                "StringEquals": {"kms:CallerAccount": cdk.Aws.ACCOUNT_ID,
                                 "kms:ViaService": f"sagemaker.{cdk.Aws.REGION}.amazonaws.com"},
                "ArnLike": {"aws:PrincipalArn": execution_role_arn},
            },
        ))
        names = bucket_names(props.project)
        self.data = self._bucket("Data", props, "data", names["data"])
        self.artefacts = self._bucket("Artefacts", props, "artefacts", names["artefacts"])
        self.lifecycle = self._bucket("Lifecycle", props, "lifecycle", names["lifecycle"])

    def _bucket(self, id: str, props: BucketsProps, log_name: str, bucket_name: str) -> s3.Bucket:
        bucket = s3.Bucket(
            self, id,
            bucket_name=bucket_name,
            encryption=s3.BucketEncryption.KMS,
            encryption_key=self.key,
            bucket_key_enabled=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            enforce_ssl=True,
            versioned=True,
            server_access_logs_bucket=props.access_logs,
            server_access_logs_prefix=f"{ACCESS_LOG_PREFIX}{log_name}/",
            removal_policy=props.removal_policy,
            lifecycle_rules=[s3.LifecycleRule(
                id="abort-incomplete-multipart-uploads",
                abort_incomplete_multipart_upload_after=cdk.Duration.days(7))],
        )
        acknowledge(bucket, "Annotation::@aws-cdk/aws-s3:accessLogsPolicyNotAdded",
                    "The access-log bucket's own policy (network stack, AccessLogBucket) admits "
                    "logging.s3.amazonaws.com for this account under s3-access-logs/.")
        acknowledge(bucket.node.default_child, "HIPAA.Security::HIPAA.Security-S3BucketReplicationEnabled",
                    "Versioning + retention protect objects in-region; cross-region replication is an "
                    "organisation-level DR decision (S3 Replication can be added without code changes). "
                    "Training features and checkpoints are reproducible from the raw data.")
        return bucket


@dataclass(kw_only=True, frozen=True)
class FileSystemProps:
    storage_gib: int
    throughput_per_tib: int
    subnet: ec2.CfnSubnet
    security_group: ec2.ISecurityGroup
    security_group_rules: tuple[Construct, ...]
    key: kms.IKey
    data: s3.IBucket
    artefacts: s3.IBucket
    removal_policy: cdk.RemovalPolicy


class FileSystem(Construct):
    """FSx for Lustre PERSISTENT_2 + data repository associations to the two data buckets."""

    def __init__(self, scope: Construct, id: str, *, props: FileSystemProps) -> None:
        super().__init__(scope, id)
        self.file_system = fsx.CfnFileSystem(
            self, "Lustre",
            file_system_type="LUSTRE",
            file_system_type_version="2.15",
            storage_capacity=props.storage_gib,
            storage_type="SSD",
            subnet_ids=[props.subnet.ref],
            security_group_ids=[props.security_group.security_group_id],
            kms_key_id=props.key.key_arn,
            lustre_configuration=fsx.CfnFileSystem.LustreConfigurationProperty(
                deployment_type="PERSISTENT_2",
                per_unit_storage_throughput=props.throughput_per_tib,
                data_compression_type="LZ4",
            ),
        )
        self.file_system.apply_removal_policy(props.removal_policy)
        # FSx checks at creation that its security group admits Lustre (TCP 988) from
        # itself; the self-referencing rules are separate resources, so wait for them.
        for rule in props.security_group_rules:
            self.file_system.node.add_dependency(rule)
        self.data_association = fsx.CfnDataRepositoryAssociation(
            self, "DataAssociation",
            file_system_id=self.file_system.ref,
            file_system_path=FSX_DATA_PATH,
            data_repository_path=f"s3://{props.data.bucket_name}/",
            batch_import_meta_data_on_create=True,
            # Inputs: objects written to S3 (precompute output) appear on /fsx/data.
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(events=ALL_EVENTS)),
        )
        self.artefacts_association = fsx.CfnDataRepositoryAssociation(
            self, "ArtefactsAssociation",
            file_system_id=self.file_system.ref,
            file_system_path=FSX_ARTEFACTS_PATH,
            data_repository_path=f"s3://{props.artefacts.bucket_name}/",
            batch_import_meta_data_on_create=True,
            # Outputs both ways: reports/exports written on /fsx/artefacts reach S3, and
            # objects put in S3 (e.g. a shared compile cache) appear on the file system.
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(events=ALL_EVENTS),
                auto_export_policy=fsx.CfnDataRepositoryAssociation.AutoExportPolicyProperty(events=ALL_EVENTS)),
        )

    @property
    def dns_name(self) -> str:
        return self.file_system.attr_dns_name

    @property
    def mount_name(self) -> str:
        return self.file_system.attr_lustre_mount_name


class StorageStack(cdk.Stack):
    """Buckets, key and FSx. Kept apart from the cluster so the cluster can be torn down alone."""

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, network: Network, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        removal = removal_policy(config)
        # Imported by name: passing the Bucket object would make S3 add a logging statement to
        # its policy that names this stack's buckets, a reference cycle between the stacks.
        logs = s3.Bucket.from_bucket_attributes(self, "AccessLogs", bucket_arn=network.access_logs.bucket_arn,
                                                bucket_name=network.access_logs.bucket_name)
        self.buckets = Buckets(self, "Buckets", props=BucketsProps(
            project=config.projectName, access_logs=logs, removal_policy=removal))
        self.file_system = FileSystem(self, "FileSystem", props=FileSystemProps(
            storage_gib=config.fsxStorageGiB, throughput_per_tib=config.fsxThroughputPerTiB,
            subnet=network.cluster_subnet, security_group=network.security_group,
            security_group_rules=(network.self_ingress, network.self_egress),
            key=self.buckets.key, data=self.buckets.data, artefacts=self.buckets.artefacts,
            removal_policy=removal))
        self.accounting = None if network.accounting is None else AccountingDatabase(
            self, "SlurmAccounting", props=AccountingDatabaseProps(
                project=config.projectName, vpc=network.vpc, network=network.accounting, key=self.buckets.key,
                removal_policy=removal))
        # Outputs live where the values are made (an output re-exporting an import is W6001).
        cdk.CfnOutput(self, "FsxDnsName", value=self.file_system.dns_name, description="FSx for Lustre DNS name")
        cdk.CfnOutput(self, "FsxMountName", value=self.file_system.mount_name,
                      description="FSx for Lustre mount name (HyperPod mounts it at /fsx on every node)")
        cdk.CfnOutput(self, "FsxFileSystemId", value=self.file_system.file_system.ref,
                      description="FSx for Lustre file system ID")
