"""Cluster: execution role, lifecycle upload (content-hashed prefix) and the HyperPod Slurm cluster.

Slurm is configured through the API (Orchestrator.Slurm + a SlurmConfig per instance
group), not through the legacy provisioning_parameters.json written by lifecycle scripts.
Every group runs in HyperPod's Extended lifecycle mode (``LifeCycleConfig.OnInitComplete``):
HyperPod installs and starts Slurm (and Docker) itself, then runs our
``on_init_complete.sh``, which only adds the platform's layer (FSx layout, users, package,
envs, readiness). See ``lifecycle_config`` below for the schema text this relies on.
The lifecycle scripts and the training package are uploaded under
``s3://<lifecycle bucket>/lifecycle/<hash>/`` where <hash> is a content hash of both trees and
of the node settings (platform-settings.json less the account/region values): any change to
either yields a new SourceS3Uri, so CloudFormation updates the cluster, nodes created afterwards
run the new code and settings (lifecycle_scripts/settings.sh reads the settings file), and the
running nodes get both by a rollout (runbooks/rollout.md).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_deployment as s3deploy
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from stacks.accounting import AccountingDatabase
from stacks.agent_releases import DCGM_EXPORTER, AgentBundle, AgentReleaseError
from stacks.agent_releases import load as load_agent_releases
from stacks.cluster_logs import ClusterLogGroup
from stacks.common import acknowledge, ignore_cfn_lint
from stacks.config import FSX_MOUNT, ConfigError, PlatformConfig
from stacks.images import RegistryLogin, mirror_repository_name
from stacks.names import execution_role_name, mlflow_server_arn
from stacks.network import Network
from stacks.storage import StorageStack, bucket_names
from stacks.wheelhouse import ROOT as WHEELHOUSE_ROOT
from stacks.wheelhouse import Wheelhouse
from stacks.wheelhouse_upload import WheelhouseUpload, wheelhouses_for

REPO = Path(__file__).resolve().parents[1]
LIFECYCLE_DIR = REPO / "lifecycle_scripts"
TRAINING_DIR = REPO / "training"
# The entry script HyperPod runs in Extended mode (renamed from on_create.sh, which belonged to
# Customer Managed mode where the scripts themselves had to set up and start Slurm).
ON_INIT_COMPLETE = "on_init_complete.sh"
SETTINGS_FILE = "platform-settings.json"
# https://docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-eks-resiliency-deep-health-checks.html
DEEP_HEALTH_CHECKS = ["InstanceStress", "InstanceConnectivity"]


def _load_package_hash():
    """lifecycle_scripts/package_hash.py: ONE implementation of the content hash, shared with
    the nodes (rollout.sh recomputes it over a fetched prefix before installing it)."""
    spec = importlib.util.spec_from_file_location("sana_package_hash", LIFECYCLE_DIR / "package_hash.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HASH = _load_package_hash()
# Never uploaded: byte-code caches, tests, hidden files (editor/tool state).
EXCLUDED_NAMES = _HASH.EXCLUDED_NAMES
package_files = _HASH.package_files
package_hash = _HASH.package_hash


def deployment_package_hash(config: PlatformConfig, lifecycle_dir: Path = LIFECYCLE_DIR,
                            training_dir: Path = TRAINING_DIR, wheelhouse_root: Path = WHEELHOUSE_ROOT) -> str:
    """The hash `cdk deploy` uploads this configuration's package under (code + node settings,
    the wheelhouses of a private cluster included)."""
    return package_hash(lifecycle_dir, training_dir,
                        config.node_settings(wheelhouse_settings(config, wheelhouse_root),
                                             offline_agent_settings(config, agent_bundle(config, wheelhouse_root))))


def wheelhouse_settings(config: PlatformConfig, root: Path) -> dict[str, dict[str, str]]:
    """env kind -> {prefix, lock_sha256, python} of the wheelhouses a private cluster installs from."""
    if not config.privateNetwork:
        return {}
    return {kind: w.settings() for kind, w in wheelhouses_for(config, root).items()}


def agent_bundle(config: PlatformConfig, root: Path) -> AgentBundle | None:
    """The observability agents' release archives a private cluster installs from (stacks/agent_releases.py);
    None where the nodes download them themselves (or run no agents). One-line ConfigError if not built."""
    if not (config.privateNetwork and config.observability):
        return None
    try:
        return load_agent_releases(root)
    except AgentReleaseError as err:
        raise ConfigError("privateNetwork", True, f"the nodes' observability agents cannot come from GitHub: {err}; "
                                                  "or set observability=false") from None


def offline_agent_settings(config: PlatformConfig, bundle: AgentBundle | None) -> dict[str, Any]:
    """platform-settings.json ``observability`` additions of a private cluster: the agents' bundle and
    the ECR repository its GPU nodes pull the DCGM exporter from (lifecycle_scripts/observability.sh)."""
    if bundle is None:
        return {}
    return {"agents": bundle.settings(),
            "dcgm_exporter_repository": mirror_repository_name(config.retained_prefix, DCGM_EXPORTER.repository)}


@dataclass(kw_only=True, frozen=True)
class ClusterProps:
    config: PlatformConfig
    network: Network
    storage: StorageStack
    accounting: AccountingDatabase | None = None
    #: observability=true: the Prometheus workspace the controller's collector writes to
    metrics_workspace_arn: str | None = None
    remote_write_url: str = ""
    lifecycle_dir: Path = LIFECYCLE_DIR
    training_dir: Path = TRAINING_DIR
    wheelhouse_root: Path = WHEELHOUSE_ROOT
    """Where ``make wheelhouse`` keeps the wheelhouses (stacks/wheelhouse.py) and the observability agents'
    archives (stacks/agent_releases.py) a private cluster uploads."""


class PlatformBuckets(Construct):
    """The storage stack's buckets, referenced by their deterministic names (no exports)."""

    def __init__(self, scope: Construct, id: str, *, name_prefix: str, key: kms.IKey) -> None:
        super().__init__(scope, id)
        self.key = key
        self.names = bucket_names(name_prefix)
        self.data, self.artefacts, self.lifecycle = (
            s3.Bucket.from_bucket_attributes(self, kind.capitalize(), bucket_name=self.names[kind], encryption_key=key)
            for kind in ("data", "artefacts", "lifecycle"))


def nag_partition(scope: Construct) -> str:
    """The partition as cdk-nag prints it in ARNs of ``scope``'s stack.

    With cdk.json's @aws-cdk/core:enablePartitionLiterals (a recommended flag), a stack pinned
    to a region renders ARNs that CDK formats with the literal partition (``aws``); an
    environment-agnostic stack keeps the ``AWS::Partition`` pseudo parameter.
    """
    partition = cdk.Stack.of(scope).partition
    return "<AWS::Partition>" if cdk.Token.is_unresolved(partition) else partition


def nag_bucket_arn(name_prefix: str, kind: str, partition: str = "<AWS::Partition>") -> str:
    """A platform bucket's ARN as cdk-nag prints it in finding IDs (pseudo parameters in <>)."""
    name = bucket_names(name_prefix)[kind]
    for token, text in ((cdk.Aws.ACCOUNT_ID, "<AWS::AccountId>"), (cdk.Aws.REGION, "<AWS::Region>")):
        name = name.replace(token, text)
    return f"arn:{partition}:s3:::{name}"


class ExecutionRole(Construct):
    """The role every HyperPod node assumes: the HyperPod managed policy + this platform only."""

    def __init__(self, scope: Construct, id: str, *, props: ClusterProps, buckets: PlatformBuckets) -> None:
        super().__init__(scope, id)
        net = props.network
        # Pseudo parameters rather than stack.account/region: the ARNs (and so the audit's
        # finding IDs) read the same whether or not the stacks are pinned to an environment.
        ec2_arn = f"arn:{cdk.Aws.PARTITION}:ec2:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}"
        eni_arn = f"{ec2_arn}:network-interface/*"
        subnet_arn = f"{ec2_arn}:subnet/{net.cluster_subnet.ref}"
        sg_arn = f"{ec2_arn}:security-group/{net.security_group.security_group_id}"
        # A private cluster's env step also fetches its wheelhouse (stacks/wheelhouse_upload.py).
        lifecycle_prefixes = ["lifecycle/*"] + (["wheelhouse/*"] if props.config.privateNetwork else [])
        self.policy = iam.ManagedPolicy(self, "PlatformAccess", statements=[
            iam.PolicyStatement(
                sid="ReadLifecycleScripts",
                actions=["s3:GetObject"],
                resources=[buckets.lifecycle.arn_for_objects(prefix) for prefix in lifecycle_prefixes]),
            iam.PolicyStatement(
                sid="ListPlatformBuckets",
                actions=["s3:ListBucket", "s3:GetBucketLocation"],
                resources=[buckets.lifecycle.bucket_arn, buckets.data.bucket_arn, buckets.artefacts.bucket_arn]),
            iam.PolicyStatement(
                sid="ReadWriteDataAndArtefacts",
                actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                         "s3:ListMultipartUploadParts"],
                resources=[buckets.data.arn_for_objects("*"), buckets.artefacts.arn_for_objects("*")]),
            iam.PolicyStatement(
                sid="UsePlatformKey",
                actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
                resources=[buckets.key.key_arn]),
            # Customer-managed-key EBS encryption: HyperPod creates KMS grants for the nodes'
            # volumes as the execution role when it scales, adds nodes or patches
            # (docs.aws.amazon.com/sagemaker/latest/dg/smcluster-cmk.html, "Permissions").
            iam.PolicyStatement(
                sid="GrantPlatformKeyToNodeVolumes",
                actions=["kms:CreateGrant"],
                resources=[buckets.key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": f"sagemaker.{cdk.Aws.REGION}.amazonaws.com"},
                            "Bool": {"kms:GrantIsForAWSResource": "true"}}),
            # HyperPod attaches the nodes' ENIs in the customer VPC as this role
            # (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-prerequisites-iam.html).
            iam.PolicyStatement(
                sid="CreateNodeInterfacesInClusterSubnet",
                actions=["ec2:CreateNetworkInterface"],
                resources=[eni_arn, subnet_arn, sg_arn]),
            # Only the interfaces in the cluster subnet: ec2:Subnet is a condition key of the
            # network-interface resource type (Service Authorization Reference, Amazon EC2,
            # "Resource types defined by Amazon EC2": "Filters access by the ARN of the subnet").
            iam.PolicyStatement(
                sid="ManageNodeInterfaces",
                actions=["ec2:AssignPrivateIpAddresses", "ec2:CreateNetworkInterfacePermission",
                         "ec2:DeleteNetworkInterface", "ec2:DeleteNetworkInterfacePermission",
                         "ec2:DetachNetworkInterface"],
                resources=[eni_arn],
                conditions={"ArnEquals": {"ec2:Subnet": subnet_arn}}),
            # On ENIs, without an ec2:CreateAction condition: AWS's reference execution-role
            # policy grants it so (awslabs/awsome-distributed-ai, 1.architectures/
            # 5.sagemaker-hyperpod/1.AmazonSageMakerClustersExecutionRolePolicy.json, Sid
            # Addition2ToEnableVpcConfig), and HyperPod may tag an interface after creating it,
            # which a CreateAction condition would refuse.
            iam.PolicyStatement(
                sid="TagNodeInterfaces",
                actions=["ec2:CreateTags"],
                resources=[eni_arn]),
            iam.PolicyStatement(
                sid="DescribeNetwork",
                actions=["ec2:DescribeNetworkInterfaces", "ec2:DescribeVpcs", "ec2:DescribeDhcpOptions",
                         "ec2:DescribeSubnets", "ec2:DescribeSecurityGroups"],
                resources=["*"]),
        ])
        if props.metrics_workspace_arn is not None:
            # The controller's collector remote-writes as this role (SigV4): aps:RemoteWrite on this
            # one workspace, not the AWS managed AmazonPrometheusRemoteWriteAccess (aps:RemoteWrite on
            # every workspace) that AWS's observability sample attaches (awslabs/awsome-distributed-ai,
            # 1.architectures/5.sagemaker-hyperpod/Extensions/observability/README.md, "Add required
            # permissions"). No ECR pull either: the exporters are release binaries, not HyperPod's
            # images (lifecycle_scripts/observability.sh).
            self.policy.add_statements(iam.PolicyStatement(
                sid="RemoteWriteToThePlatformWorkspace", actions=["aps:RemoteWrite"],
                resources=[props.metrics_workspace_arn]))
        if props.config.mlflowTrackingServer:
            # Training jobs log runs to the platform's tracking server through the sagemaker-mlflow
            # plugin (SigV4 as this role; docs.aws.amazon.com/sagemaker/latest/dg/mlflow-track-experiments.html);
            # the artifacts go to the artefacts bucket, granted above.
            self.policy.add_statements(iam.PolicyStatement(
                sid="TrackRunsOnThePlatformMlflow", actions=["sagemaker-mlflow:*"],
                resources=[mlflow_server_arn(props.config.projectName)]))
        if props.accounting is not None:
            # slurmdbd's own database login (ClusterAccountingDatabase.SecretArn), a user with
            # rights on the accounting schema only; the admin login stays with RDS
            # (stacks/accounting.py). The secret is on the platform key, granted above.
            self.policy.add_statements(iam.PolicyStatement(
                sid="ReadAccountingDatabaseSecret",
                actions=["secretsmanager:GetSecretValue", "secretsmanager:DescribeSecret"],
                resources=[props.accounting.secret_arn]))
        # Trust: SageMaker, for this account's clusters. aws:SourceAccount / aws:SourceArn are
        # the keys AWS gives against the confused deputy
        # (https://docs.aws.amazon.com/sagemaker/latest/dg/security-confused-deputy-prevention.html);
        # that page lists them per SageMaker feature and not for HyperPod clusters, so they are
        # ...IfExists: enforced whenever SageMaker passes them, and a cluster whose request
        # lacks them still starts (a plain StringEquals on a missing key denies, and the nodes
        # would get no credentials).
        cluster_arns = f"arn:{cdk.Aws.PARTITION}:sagemaker:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:cluster/*"
        self.role = iam.Role(
            self, "Role",
            role_name=execution_role_name(props.config.projectName),
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com", conditions={
                "StringEqualsIfExists": {"aws:SourceAccount": cdk.Aws.ACCOUNT_ID},
                "ArnLikeIfExists": {"aws:SourceArn": cluster_arns}}),
            description="HyperPod cluster nodes: managed instance policy + this platform's buckets and key",
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSageMakerClusterInstanceRolePolicy"),
                self.policy,
            ],
        )
        acknowledge(self.role, "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/"
                    "AmazonSageMakerClusterInstanceRolePolicy]",
                    "HyperPod requires this AWS managed policy on the cluster execution role (node agent, "
                    "CloudWatch logs/metrics under /aws/sagemaker/Clusters, lifecycle buckets named "
                    "sagemaker-*); AWS maintains it as the service evolves.")
        self.policy_has_mlflow = props.config.mlflowTrackingServer
        self._acknowledge_wildcards(props.config.retained_prefix, private=props.config.privateNetwork)

    def _acknowledge_wildcards(self, name_prefix: str, *, private: bool) -> None:
        """Each object/ENI wildcard is scoped to exactly one platform bucket or to ENIs of this account/region."""
        reasons = {
            "Resource::*": "ec2:Describe* actions do not support resource-level permissions "
                           "(Service Authorization Reference, Amazon EC2); they are read-only.",
            "Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:<AWS::AccountId>:network-interface/*":
                "HyperPod creates node ENIs whose IDs are not known in advance; scoped to ENIs in this "
                "account and region, and creation is further limited to the cluster subnet and group.",
        }
        for kind, what in (("lifecycle", "lifecycle/"), ("data", ""), ("artefacts", "")):
            reasons[f"Resource::{nag_bucket_arn(name_prefix, kind, nag_partition(self))}/{what}*"] = (
                "Object-level access within exactly one platform bucket (the objects are created by "
                "training jobs at run time); the bucket itself is named, never s3:*.")
        if private:
            reasons[f"Resource::{nag_bucket_arn(name_prefix, 'lifecycle', nag_partition(self))}/wheelhouse/*"] = (
                "Read-only, the wheelhouses the cluster stack uploads under wheelhouse/<kind>-<key>/ of the "
                "platform's lifecycle bucket (keys named by content hashes not known to the role).")
        if self.policy_has_mlflow:
            reasons["Action::sagemaker-mlflow:*"] = (
                "The MLflow REST API of exactly one tracking server (the platform's, by ARN); its action "
                "list follows MLflow's API (log runs, metrics, params, artifacts, search).")
        for finding, reason in reasons.items():
            acknowledge(self.policy, f"AwsSolutions::AwsSolutions-IAM5[{finding}]", reason)


class LifecycleUpload(Construct):
    """Uploads lifecycle_scripts/ + training/ + platform-settings.json under lifecycle/<hash>/.

    BucketDeployment (a CDK-managed Lambda) is used because HyperPod needs the scripts as
    plain objects under an S3 prefix in a sagemaker-* bucket, while CDK file assets land
    zipped in the bootstrap bucket. prune=False: the two deployments share one prefix and
    the prefix is immutable per hash, so there is nothing to prune.
    """

    def __init__(self, scope: Construct, id: str, *, props: ClusterProps, buckets: PlatformBuckets,
                 wheelhouses: dict[str, Wheelhouse], agents: AgentBundle | None = None) -> None:
        super().__init__(scope, id)
        cfg = props.config
        if not (props.lifecycle_dir / ON_INIT_COMPLETE).is_file():
            raise FileNotFoundError(f"{props.lifecycle_dir / ON_INIT_COMPLETE} is missing: every instance group's "
                                    "LifeCycleConfig.OnInitComplete names it")
        wheels = {kind: w.settings() for kind, w in wheelhouses.items()}
        offline_agents = offline_agent_settings(cfg, agents)
        node_settings = cfg.node_settings(wheels, offline_agents)
        if cdk.Token.is_unresolved(json.dumps(node_settings)):
            raise ValueError("PlatformConfig.node_settings() holds a CDK token: the nodes could not recompute the "
                             "package hash; put values of the account or region in package_hash.ENVIRONMENT_KEYS")
        # Code + node settings: a clusterUsers change alone is a new prefix, rolled out like code.
        self.package_hash = package_hash(props.lifecycle_dir, props.training_dir, node_settings)
        self.prefix = f"lifecycle/{self.package_hash}/"
        self.source_s3_uri = f"s3://{buckets.lifecycle.bucket_name}/{self.prefix}"
        self.settings = cfg.settings(
            region=cdk.Stack.of(self).region, data_bucket=buckets.data.bucket_name,
            artefacts_bucket=buckets.artefacts.bucket_name, lifecycle_bucket=buckets.lifecycle.bucket_name,
            package_hash=self.package_hash,
            image_registry=f"{cdk.Aws.ACCOUNT_ID}.dkr.ecr.{cdk.Aws.REGION}.{cdk.Aws.URL_SUFFIX}",
            wheelhouses=wheels, offline_agents=offline_agents, remote_write_url=props.remote_write_url)
        common = dict(destination_bucket=buckets.lifecycle, prune=False, retain_on_delete=True,
                      memory_limit=512)
        self.scripts = s3deploy.BucketDeployment(
            self, "Scripts",
            sources=[s3deploy.Source.asset(str(props.lifecycle_dir), exclude=list(EXCLUDED_NAMES)),
                     s3deploy.Source.json_data(SETTINGS_FILE, self.settings)],
            destination_key_prefix=self.prefix, **common)
        self.package = s3deploy.BucketDeployment(
            self, "TrainingPackage",
            sources=[s3deploy.Source.asset(str(props.training_dir), exclude=list(EXCLUDED_NAMES))],
            destination_key_prefix=f"{self.prefix}{props.training_dir.name}/", **common)


class Cluster(Construct):
    """AWS::SageMaker::Cluster with Slurm orchestration and the controller/login/gpu/trn groups."""

    def __init__(self, scope: Construct, id: str, *, props: ClusterProps) -> None:
        super().__init__(scope, id)
        cfg = props.config
        self.buckets = PlatformBuckets(self, "Buckets", name_prefix=cfg.retained_prefix, key=props.storage.buckets.key)
        self.execution_role = ExecutionRole(self, "ExecutionRole", props=props, buckets=self.buckets)
        wheelhouses = wheelhouses_for(cfg, props.wheelhouse_root) if cfg.privateNetwork else {}
        agents = agent_bundle(cfg, props.wheelhouse_root)
        self.upload = LifecycleUpload(self, "Lifecycle", props=props, buckets=self.buckets, wheelhouses=wheelhouses,
                                      agents=agents)
        # The agents' archives travel with the wheelhouses (same prefix family, same read grant).
        uploads = {**wheelhouses, **({"agents": agents} if agents is not None else {})}
        self.wheelhouses = None if not uploads else WheelhouseUpload(
            self, "Wheelhouses", wheelhouses=uploads, bucket=self.buckets.lifecycle)
        fs = props.storage.file_system
        self.fsx_mount = sagemaker.CfnCluster.ClusterInstanceStorageConfigProperty(
            fsx_lustre_config=sagemaker.CfnCluster.ClusterFsxLustreConfigProperty(
                dns_name=fs.dns_name, mount_name=fs.mount_name, mount_path=FSX_MOUNT))
        specs = {
            "controller": (cfg.controllerInstanceType, cfg.controllerInstanceCount, cfg.controllerEbsGiB,
                           "Controller", None),
            "login": (cfg.loginInstanceType, cfg.loginInstanceCount, cfg.loginEbsGiB, "Login", None),
            "gpu": (cfg.gpuInstanceType, cfg.gpuInstanceCount, cfg.gpuEbsGiB, "Compute", "gpu"),
            "trn": (cfg.trnInstanceType, cfg.trnInstanceCount, cfg.trnEbsGiB, "Compute", "trn"),
        }
        groups = [self._group(name, *specs[name], cfg=cfg, vpc_override=self._controller_vpc(props) if
                              name == "controller" else None) for name in cfg.groups]
        self.cluster = sagemaker.CfnCluster(
            self, "Resource",
            cluster_name=cfg.clusterName,
            instance_groups=groups,
            orchestrator=sagemaker.CfnCluster.OrchestratorProperty(
                # Managed: HyperPod owns slurm.conf (nodes, partitions) from the SlurmConfig
                # below and keeps it in sync as groups scale.
                slurm=sagemaker.CfnCluster.ClusterOrchestratorSlurmConfigProperty(
                    slurm_config_strategy="Managed",
                    accounting_database=self._accounting_database(props.accounting))),
            # Schema: "When set to 'Continuous', enables continuous scaling which dynamically
            # manages node provisioning"; the cluster is InService once the controller (and a
            # login node) is up and worker launches are retried asynchronously
            # (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-scaling-slurm.html).
            # Customer-managed-key volumes and AccountingDatabase both require it.
            node_provisioning_mode="Continuous" if cfg.continuousProvisioning else None,
            node_recovery=cfg.nodeRecovery,
            vpc_config=sagemaker.CfnCluster.VpcConfigProperty(
                security_group_ids=[props.network.security_group.security_group_id],
                subnets=[props.network.cluster_subnet.ref]),
        )
        # The cluster must not be created before its lifecycle objects (and wheelhouses) exist in S3.
        self.cluster.node.add_dependency(self.upload.scripts, self.upload.package)
        if self.wheelhouses is not None:
            self.cluster.node.add_dependency(*self.wheelhouses.deployments)

    @staticmethod
    def _controller_vpc(props: ClusterProps) -> sagemaker.CfnCluster.VpcConfigProperty | None:
        """With accounting, the controller alone also carries the database's client security group
        (the database admits nothing else): the instance group's OverrideVpcConfig (resource schema,
        ClusterInstanceGroup.OverrideVpcConfig), same subnet, the cluster group kept for EFA/Lustre."""
        accounting = props.network.accounting
        if accounting is None:
            return None
        return sagemaker.CfnCluster.VpcConfigProperty(
            security_group_ids=[props.network.security_group.security_group_id,
                                accounting.client_security_group.security_group_id],
            subnets=[props.network.cluster_subnet.ref])

    @staticmethod
    def _accounting_database(db: AccountingDatabase | None) -> sagemaker.CfnCluster.ClusterAccountingDatabaseProperty | None:
        """Orchestrator.Slurm.AccountingDatabase, field names as the resource schema has them.

        Schema (ClusterAccountingDatabase): "External MySQL-compatible accounting database that
        a Slurm cluster's slurmdbd connects to. Database credentials are supplied out-of-band
        through the referenced Secrets Manager secret. Supported only with Continuous node
        provisioning." (PlatformConfig refuses accounting without Continuous at synth.)
        """
        if db is None:
            return None
        return sagemaker.CfnCluster.ClusterAccountingDatabaseProperty(
            endpoint=db.endpoint, secret_arn=db.secret_arn, port=db.port, name=db.schema_name)

    def _storage(self, ebs_gib: int, *, cfg: PlatformConfig,
                 key_arn: str) -> list[sagemaker.CfnCluster.ClusterInstanceStorageConfigProperty]:
        """Root + secondary EBS on the platform key (Continuous mode only), then the FSx mount.

        docs.aws.amazon.com/sagemaker/latest/dg/smcluster-cmk.html: "Customer managed key
        encryption is only supported for clusters using the continuous node provisioning
        mode"; a root-volume entry has RootVolume=True and VolumeKmsKeyId but no size (HyperPod
        sizes it); the secondary entry has the size and, optionally, the key. Without
        Continuous both volumes fall back to AWS owned keys (the service default).
        """
        ebs = sagemaker.CfnCluster.ClusterEbsVolumeConfigProperty
        storage = sagemaker.CfnCluster.ClusterInstanceStorageConfigProperty
        if not cfg.continuousProvisioning:
            return [storage(ebs_volume_config=ebs(volume_size_in_gb=ebs_gib)), self.fsx_mount]
        return [storage(ebs_volume_config=ebs(root_volume=True, volume_kms_key_id=key_arn)),
                storage(ebs_volume_config=ebs(volume_size_in_gb=ebs_gib, volume_kms_key_id=key_arn)),
                self.fsx_mount]

    def _group(self, name: str, instance_type: str, count: int, ebs_gib: int, node_type: str,
               partition: str | None, *, cfg: PlatformConfig,
               vpc_override: sagemaker.CfnCluster.VpcConfigProperty | None = None,
               ) -> sagemaker.CfnCluster.ClusterInstanceGroupProperty:
        accelerator = partition is not None
        return sagemaker.CfnCluster.ClusterInstanceGroupProperty(
            instance_group_name=name,
            instance_type=instance_type,
            instance_count=count,
            execution_role=self.execution_role.role.role_arn,
            # Schema (ClusterLifeCycleConfig): "When provided with SourceS3Uri and OnCreate, uses
            # Customer Managed mode. When provided with SourceS3Uri and OnInitComplete, uses
            # Extended mode." OnInitComplete: "This script runs after HyperPod configures the
            # default software on the instance. Mutually exclusive with OnCreate."
            # (cfnlint/data/schemas: the AWS::SageMaker::Cluster resource schema cfn-lint ships.)
            # The pinned aws-cdk-lib's ClusterLifeCycleConfigProperty has on_init_complete, and
            # ClusterEbsVolumeConfigProperty root_volume/volume_kms_key_id: no escape hatch needed.
            life_cycle_config=sagemaker.CfnCluster.ClusterLifeCycleConfigProperty(
                on_init_complete=ON_INIT_COMPLETE, source_s3_uri=self.upload.source_s3_uri),
            slurm_config=sagemaker.CfnCluster.ClusterSlurmConfigProperty(
                node_type=node_type, partition_names=[partition] if partition else None),
            instance_storage_configs=self._storage(ebs_gib, cfg=cfg, key_arn=self.buckets.key.key_arn),
            # One thread per core on accelerator hosts: training is accelerator-bound and the
            # host cores feed data loaders; SMT adds jitter (HyperPod's own recommendation).
            threads_per_core=1 if accelerator else None,
            on_start_deep_health_checks=DEEP_HEALTH_CHECKS if accelerator and cfg.deepHealthChecks else None,
            override_vpc_config=vpc_override,
        )


class ClusterStack(cdk.Stack):
    """The expensive part; `cdk destroy <project>-cluster` removes it and keeps data and network."""

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, network: Network,
                 storage: StorageStack, wheelhouse_root: Path = WHEELHOUSE_ROOT,
                 metrics_workspace_arn: str | None = None, remote_write_url: str = "", **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        self.cluster = Cluster(self, "Cluster", props=ClusterProps(
            config=config, network=network, storage=storage, accounting=storage.accounting,
            wheelhouse_root=wheelhouse_root, metrics_workspace_arn=metrics_workspace_arn,
            remote_write_url=remote_write_url))
        self._acknowledge_deployment_handler(config)
        buckets, upload = self.cluster.buckets, self.cluster.upload
        # The log group HyperPod writes the nodes' logs to: retention and the platform key.
        self.cluster_logs = ClusterLogGroup(self, "ClusterLogs", cluster=self.cluster.cluster,
                                            cluster_name=config.clusterName, key=buckets.key,
                                            retention_days=config.logRetentionDays)
        # The image repositories are the storage stack's (kept with the data); the nodes' role
        # may get the registry login token.
        self.registry_login = RegistryLogin(self, "RegistryLogin", role=self.cluster.execution_role.role)
        outputs = {
            "ClusterName": (config.clusterName, "HyperPod cluster name (aws sagemaker describe-cluster --cluster-name ...)"),
            "ClusterArn": (self.cluster.cluster.attr_cluster_arn, "HyperPod cluster ARN"),
            "DataBucket": (buckets.data.bucket_name, "Raw data and precomputed feature shards (/fsx/data on FSx)"),
            "ArtefactsBucket": (buckets.artefacts.bucket_name,
                                "Checkpoints, exports, reports, compile caches (/fsx/artefacts on FSx)"),
            "LifecycleBucket": (buckets.lifecycle.bucket_name, "Lifecycle scripts and the training package"),
            "LifecycleUri": (upload.source_s3_uri, "LifeCycleConfig.SourceS3Uri of every instance group: the package "
                                                   "to roll out (runbooks/rollout.md)"),
            "FeaturesUri": (f"s3://{buckets.data.bucket_name}/features/",
                            "Where precomputed shards go in S3; jobs read them as /fsx/data/features"),
            "CheckpointsUri": (f"s3://{buckets.artefacts.bucket_name}/checkpoints/",
                               "S3 copy of /fsx/artefacts/checkpoints (FSx exports every run directory)"),
        }
        for key, (value, description) in outputs.items():
            cdk.CfnOutput(self, key, value=value, description=description)

    def _acknowledge_deployment_handler(self, config: PlatformConfig) -> None:
        """Findings on the Lambda that BucketDeployment brings (see runbooks/compliance.md).

        The handler is CDK's own singleton; its role and grants are generated by aws-cdk-lib.
        """
        for handler in [c for c in self.node.children if c.node.id.startswith("Custom::CDKBucketDeployment")]:
            self._acknowledge_handler(handler, config)

    def _acknowledge_handler(self, handler: Construct, config: PlatformConfig) -> None:
        """One BucketDeployment singleton (one per memory/storage size: the wheelhouses' is bigger)."""
        fn = handler.node.default_child
        role = handler.node.find_child("ServiceRole")
        policy = role.node.find_child("DefaultPolicy").node.default_child
        deploy_only = ("CDK's BucketDeployment handler runs only during `cdk deploy` to copy the lifecycle "
                       "scripts, training package and wheelhouses into S3; it handles no PHI or training data. ")
        ignore_cfn_lint(fn, "W3005")
        acknowledge(fn, "AwsSolutions::AwsSolutions-L1", deploy_only +
                    "Its runtime is chosen and updated by the pinned aws-cdk-lib release.")
        acknowledge(fn, "HIPAA.Security::HIPAA.Security-LambdaConcurrency", deploy_only +
                    "It is invoked once per deployment by CloudFormation; reserved concurrency adds nothing.")
        acknowledge(fn, "HIPAA.Security::HIPAA.Security-LambdaDLQ", deploy_only +
                    "CloudFormation invokes it synchronously and fails the deployment on error; "
                    "there is no asynchronous event to dead-letter.")
        acknowledge(fn, "HIPAA.Security::HIPAA.Security-LambdaInsideVPC", deploy_only +
                    "It only talks to S3 and the CloudFormation response URL; placing it in the cluster "
                    "VPC would add a path into the VPC for no benefit.")
        acknowledge(role.node.default_child,
                    "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/"
                    "AWSLambdaBasicExecutionRole]", deploy_only +
                    "The AWS managed basic execution policy only lets it write its own CloudWatch logs.")
        acknowledge(policy, "HIPAA.Security::HIPAA.Security-IAMNoInlinePolicy", deploy_only +
                    "aws-cdk-lib attaches its generated grants as the role's inline default policy; the "
                    "role is used by nothing else.")
        account = config.account or "<AWS::AccountId>"
        region = config.region or "<AWS::Region>"
        partition = nag_partition(self)
        assets = f"arn:{partition}:s3:::cdk-hnb659fds-assets-{account}-{region}/*"
        wildcards = {
            "Action::s3:GetBucket*": "CDK grant: read the bootstrap asset bucket and the lifecycle bucket.",
            "Action::s3:GetObject*": "CDK grant: read the zipped asset and the lifecycle objects.",
            "Action::s3:List*": "CDK grant: list the bootstrap asset bucket and the lifecycle bucket.",
            "Action::s3:Abort*": "CDK grant: abort its own multipart uploads into the lifecycle bucket.",
            "Action::s3:DeleteObject*": "CDK grant on the lifecycle bucket (used only when pruning, which is off).",
            "Action::kms:GenerateDataKey*": "CDK grant: encrypt uploads with the platform key of the lifecycle bucket.",
            "Action::kms:ReEncrypt*": "CDK grant on the platform key of the lifecycle bucket (copy between prefixes).",
            f"Resource::{assets}": "Objects of the CDK bootstrap asset bucket, where `cdk deploy` puts the zipped "
                                   "scripts (asset object keys are content hashes not known in advance).",
            f"Resource::{nag_bucket_arn(config.retained_prefix, 'lifecycle', partition)}/*":
                "Objects of exactly the platform's lifecycle bucket (the destination).",
        }
        for finding, reason in wildcards.items():
            acknowledge(policy, f"AwsSolutions::AwsSolutions-IAM5[{finding}]", deploy_only + reason)
        # cdk.json's @aws-cdk/aws-lambda:useCdkManagedLogGroup (a recommended flag) gives the
        # handler a log group in the template instead of one Lambda creates on first run; it gets
        # the platform's retention and key like every platform log group (the key policy admits
        # CloudWatch Logs for /aws/lambda/<project>-cluster-*, stacks/key_policy.py).
        log_group = handler.node.find_child("LogGroup").node.default_child
        log_group.retention_in_days = config.logRetentionDays
        log_group.kms_key_id = self.cluster.buckets.key.key_arn
