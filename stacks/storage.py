"""Storage: the platform KMS key, the data / artefacts / lifecycle buckets, FSx for Lustre and the image repositories.

Data flow: S3 features -> FSx `/data` (imported automatically) -> training on
`/fsx`; checkpoints, reports and other artefacts under FSx `/artefacts` are exported to the
artefacts bucket automatically (a cluster user's job has no S3 credentials of its own).
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

from stacks.accounting import AccountingDatabase, AccountingDatabaseProps, cluster_identifier
from stacks.common import acknowledge, removal_policy
from stacks.config import PlatformConfig
from stacks.images import ImageRepositories
from stacks.key_policy import KeyPolicyProps, platform_key_policy
from stacks.names import (
    alerts_topic_arn,
    bucket_arn,
    bucket_names,
    endpoint_name,
    execution_role_arn,
    log_group_arn,
    mlflow_role_arn,
    serving_role_arn,
    trail_arn,
)
from stacks.network import ACCESS_LOG_PREFIX, Network
from stacks.trail import DataEventsTrail, DataEventsTrailProps

FSX_DATA_PATH = "/data"
FSX_ARTEFACTS_PATH = "/artefacts"
ALL_EVENTS = ["NEW", "CHANGED", "DELETED"]


def platform_log_groups(cfg: PlatformConfig) -> tuple[str, ...]:
    """Name patterns of every log group on the platform key: the Lambda handlers of the cluster
    and storage stacks (CloudFormation names a function <stack name>-<logical id>-<suffix>), the
    HyperPod cluster's (/aws/sagemaker/Clusters/<cluster name>/<cluster id>) and the accounting
    database's (/aws/rds/cluster/<identifier>/<log type>)."""
    p = cfg.projectName
    serving = (f"/aws/sagemaker/Endpoints/{endpoint_name(p)}",) if cfg.serving else ()  # stacks/serving.py
    return (f"/aws/lambda/{p}-cluster-*", f"/aws/lambda/{p}-storage-*",
            f"/aws/sagemaker/Clusters/{cfg.clusterName}/*",
            f"/aws/rds/cluster/{cluster_identifier(cfg.retained_prefix)}/*", *serving)


@dataclass(kw_only=True, frozen=True)
class BucketsProps:
    config: PlatformConfig
    access_logs: s3.IBucket
    removal_policy: cdk.RemovalPolicy
    s3_endpoint_id: str
    """The VPC's S3 gateway endpoint: the nodes' role reaches the data only through it."""


class Buckets(Construct):
    """KMS key + the three platform buckets, all SSE-KMS, versioned, SSL-only, private, logged."""

    def __init__(self, scope: Construct, id: str, *, props: BucketsProps) -> None:
        super().__init__(scope, id)
        cfg = props.config
        project = cfg.projectName
        names = bucket_names(cfg.retained_prefix)
        # Named principals only (stacks/key_policy.py): no kms:* for the account.
        self.key = kms.Key(
            self, "Key", enable_key_rotation=True, removal_policy=props.removal_policy,
            alias=f"alias/{project}-platform",
            description=f"{project}: encrypts the platform buckets, FSx, node EBS volumes and accounting DB",
            policy=platform_key_policy(KeyPolicyProps(
                project=project, execution_role_arn=execution_role_arn(project),
                bucket_arns={kind: bucket_arn(name) for kind, name in names.items()},
                administrators=cfg.keyAdministrators, users=cfg.keyUsers,
                trail_arn=trail_arn(project) if cfg.cloudTrail else None,
                log_group_arns=tuple(log_group_arn(n) for n in platform_log_groups(cfg)),
                serving_role_arn=serving_role_arn(project) if cfg.serving else None,
                observability=cfg.observability, alerts_topic_arn=alerts_topic_arn(project),
                mlflow_role_arn=mlflow_role_arn(project) if cfg.mlflowTrackingServer else None)))
        self.data = self._bucket("Data", props, "data", names["data"])
        self.artefacts = self._bucket("Artefacts", props, "artefacts", names["artefacts"])
        self.lifecycle = self._bucket("Lifecycle", props, "lifecycle", names["lifecycle"])
        for bucket in (self.data, self.artefacts):
            self._nodes_only_through_the_endpoint(bucket, project, props.s3_endpoint_id)

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
        # Objects only under the platform key: an upload naming another KMS key, another
        # algorithm, or a customer-provided key (SSE-C, which S3 cannot audit or rotate) is
        # refused. Condition keys of s3:PutObject (Service Authorization Reference, Amazon S3:
        # s3:x-amz-server-side-encryption, s3:x-amz-server-side-encryption-aws-kms-key-id,
        # s3:x-amz-server-side-encryption-customer-algorithm); IfExists: an upload that names
        # nothing gets the bucket's default, the platform key.
        objects = bucket.arn_for_objects("*")
        bucket.add_to_resource_policy(iam.PolicyStatement(
            sid="DenyOtherEncryption", effect=iam.Effect.DENY, principals=[iam.AnyPrincipal()],
            actions=["s3:PutObject"], resources=[objects],
            conditions={"StringNotEqualsIfExists": {"s3:x-amz-server-side-encryption": "aws:kms"}}))
        bucket.add_to_resource_policy(iam.PolicyStatement(
            sid="DenyForeignKmsKey", effect=iam.Effect.DENY, principals=[iam.AnyPrincipal()],
            actions=["s3:PutObject"], resources=[objects],
            conditions={"StringNotEqualsIfExists": {"s3:x-amz-server-side-encryption-aws-kms-key-id": self.key.key_arn}}))
        bucket.add_to_resource_policy(iam.PolicyStatement(
            sid="DenySseC", effect=iam.Effect.DENY, principals=[iam.AnyPrincipal()],
            actions=["s3:PutObject"], resources=[objects],
            conditions={"Null": {"s3:x-amz-server-side-encryption-customer-algorithm": "false"}}))
        acknowledge(bucket, "Annotation::@aws-cdk/aws-s3:accessLogsPolicyNotAdded",
                    "The access-log bucket's own policy (network stack, AccessLogBucket) admits "
                    "logging.s3.amazonaws.com for exactly these buckets under s3-access-logs/.")
        acknowledge(bucket.node.default_child, "HIPAA.Security::HIPAA.Security-S3BucketReplicationEnabled",
                    "Versioning + retention protect objects in-region; cross-region replication is an "
                    "organisation-level DR decision (S3 Replication can be added without code changes). "
                    "Training features and checkpoints are reproducible from the raw data.")
        return bucket

    @staticmethod
    def _nodes_only_through_the_endpoint(bucket: s3.Bucket, project: str, endpoint_id: str) -> None:
        """The nodes' role reads and writes the data only from inside the VPC: its credentials,
        taken off a node, are useless elsewhere. aws:SourceVpce is present only on requests
        through a VPC endpoint (IAM global condition keys), so StringNotEquals also matches a
        request from outside; aws:ViaAWSService exempts calls an AWS service makes with the
        role's credentials. The lifecycle bucket is left out: HyperPod itself reads the
        lifecycle scripts for the cluster (SourceS3Uri), from outside this VPC."""
        bucket.add_to_resource_policy(iam.PolicyStatement(
            sid="NodesOnlyThroughTheVpcEndpoint", effect=iam.Effect.DENY, principals=[iam.AnyPrincipal()],
            actions=["s3:*"], resources=[bucket.bucket_arn, bucket.arn_for_objects("*")],
            conditions={"ArnEquals": {"aws:PrincipalArn": execution_role_arn(project)},
                        "StringNotEquals": {"aws:SourceVpce": endpoint_id},
                        "Bool": {"aws:ViaAWSService": "false"}}))

    def pin_file_system(self, file_system_id: str) -> None:
        """Only THIS file system's FSx S3 service-linked role may use the data buckets (the key
        policy admits FSx's role only by name pattern: it cannot name a file system encrypted
        with itself). The role is AWSServiceRoleForFSxS3Access_<file system id>
        (https://docs.aws.amazon.com/fsx/latest/LustreGuide/using-service-linked-roles.html)."""
        fsx_roles = (f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/aws-service-role/"
                     "s3.data-source.lustre.fsx.amazonaws.com/AWSServiceRoleForFSxS3Access_")
        for bucket in (self.data, self.artefacts):
            bucket.add_to_resource_policy(iam.PolicyStatement(
                sid="OnlyThisFileSystemsDataRepositories", effect=iam.Effect.DENY,
                principals=[iam.AnyPrincipal()], actions=["s3:*"],
                resources=[bucket.bucket_arn, bucket.arn_for_objects("*")],
                conditions={"ArnLike": {"aws:PrincipalArn": f"{fsx_roles}*"},
                            "ArnNotEquals": {"aws:PrincipalArn": f"{fsx_roles}{file_system_id}"}}))


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
            config=config, access_logs=logs, removal_policy=removal, s3_endpoint_id=network.s3_endpoint.ref))
        self.file_system = FileSystem(self, "FileSystem", props=FileSystemProps(
            storage_gib=config.fsxStorageGiB, throughput_per_tib=config.fsxThroughputPerTiB,
            subnet=network.cluster_subnet, security_group=network.security_group,
            security_group_rules=(network.self_ingress, network.self_egress),
            key=self.buckets.key, data=self.buckets.data, artefacts=self.buckets.artefacts,
            removal_policy=removal))
        self.buckets.pin_file_system(self.file_system.file_system.ref)
        self.trail = DataEventsTrail(self, "Trail", props=DataEventsTrailProps(
            project=config.projectName, key=self.buckets.key, destination=logs,
            buckets=(self.buckets.data, self.buckets.artefacts, self.buckets.lifecycle))) if config.cloudTrail else None
        self.accounting = None if network.accounting is None else AccountingDatabase(
            self, "SlurmAccounting", props=AccountingDatabaseProps(
                project=config.projectName, name_prefix=config.retained_prefix, vpc=network.vpc,
                network=network.accounting, key=self.buckets.key,
                removal_policy=removal, log_retention_days=config.logRetentionDays))
        # Training images (containers/, runbooks/containers.md) and mirrored third-party images,
        # kept with the data: pulled by the nodes' role only, which the cluster stack creates under
        # its fixed name.
        self.images = ImageRepositories(self, "Images", name_prefix=config.retained_prefix,
                                        pull_role_arn=execution_role_arn(config.projectName), key=self.buckets.key,
                                        removal_policy=removal)
        for kind, label in (("gpu", "Gpu"), ("neuron", "Neuron")):
            cdk.CfnOutput(self, f"{label}ImageRepositoryUri", value=self.images.repositories[kind].repository_uri,
                          description=f"ECR repository of the {label} training image (make push-image IMAGE={kind})")
        cdk.CfnOutput(self, "DcgmExporterRepositoryUri", value=self.images.repositories["dcgm-exporter"].repository_uri,
                      description="ECR mirror of the DCGM exporter image a private cluster's GPU nodes pull "
                                  "(make mirror-dcgm-image)")
        # Outputs live where the values are made (an output re-exporting an import is W6001).
        cdk.CfnOutput(self, "FsxDnsName", value=self.file_system.dns_name, description="FSx for Lustre DNS name")
        cdk.CfnOutput(self, "FsxMountName", value=self.file_system.mount_name,
                      description="FSx for Lustre mount name (HyperPod mounts it at /fsx on every node)")
        cdk.CfnOutput(self, "FsxFileSystemId", value=self.file_system.file_system.ref,
                      description="FSx for Lustre file system ID")
