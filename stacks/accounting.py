"""Optional Slurm accounting (``slurmAccounting=true``): an Aurora MySQL Serverless v2 database.

HyperPod's own default is a MariaDB on the controller instance; an external database keeps
job history, fair-share and QOS data through controller replacement and cluster updates
(docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-external-accounting-db-slurm.html).
"HyperPod does not create, host, or manage the database": this module does, and the cluster
stack hands it to HyperPod through ``Orchestrator.Slurm.AccountingDatabase`` (Endpoint,
Port, Name, SecretArn). The same page: it "requires continuous provisioning", and "after you
attach an external accounting database to a cluster, you cannot revert that cluster to the
internal MariaDB database".

Two pieces, in the stacks that own their kind of resource:

- :class:`AccountingNetwork` (network stack): two small private subnets in two AZs (an
  Aurora DB subnet group must span at least two) with no route out of the VPC, and the
  database security group, which admits MySQL only from the cluster security group.
- :class:`AccountingDatabase` (storage stack, so ``cdk destroy <project>-cluster`` keeps the
  history): the Aurora cluster on the platform KMS key and its Secrets Manager credentials.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_rds as rds
from constructs import Construct

from stacks.common import acknowledge

# Aurora MySQL 3 (MySQL 8.0-compatible), a Slurm-supported MySQL server
# (slurm.schedmd.com/accounting.html, "MySQL Configuration").
ENGINE_VERSION = rds.AuroraMysqlEngineVersion.VER_3_10_0
MYSQL_PORT = 3306
ADMIN_USER = "slurm"
# Serverless v2 capacity in ACUs: slurmdbd's load is a few writes per job; 0.5 is the floor.
MIN_ACU, MAX_ACU = 0.5, 4
BACKUP_DAYS = 14
# Every log type Aurora MySQL can export to CloudWatch Logs.
LOG_EXPORTS = ["audit", "error", "general", "slowquery"]


def schema_name(project: str) -> str:
    """The accounting schema (ClusterAccountingDatabase.Name, pattern ^[a-zA-Z0-9$_]+$).

    Named per project rather than left to HyperPod's per-cluster default
    (slurm_acct_db_<cluster id>), so a replaced cluster keeps writing the same history.
    """
    return "slurm_acct_db_" + re.sub(r"[^a-zA-Z0-9_]", "_", project)


@dataclass(kw_only=True, frozen=True)
class AccountingNetworkProps:
    vpc: ec2.IVpc
    subnet_cidrs: tuple[str, str]
    cluster_security_group: ec2.ISecurityGroup


class AccountingNetwork(Construct):
    """Two isolated DB subnets (AZs 0 and 1 of the region) + the database security group."""

    def __init__(self, scope: Construct, id: str, *, props: AccountingNetworkProps) -> None:
        super().__init__(scope, id)
        vpc_id = props.vpc.vpc_id
        # Isolated: a route table with only the VPC-local route. The database is reached from
        # the cluster subnet over the VPC's local routing and needs no internet path.
        self.route_table = route_table = ec2.CfnRouteTable(self, "RouteTable", vpc_id=vpc_id)
        self.subnets: list[ec2.CfnSubnet] = []
        for index, cidr in enumerate(props.subnet_cidrs):
            # AZ names by index (Fn::GetAZs): two distinct AZs whatever the cluster's AZ ID is.
            subnet = ec2.CfnSubnet(
                self, f"Subnet{index}", vpc_id=vpc_id, cidr_block=cidr, map_public_ip_on_launch=False,
                availability_zone=cdk.Fn.select(index, cdk.Fn.get_azs()),
                tags=[cdk.CfnTag(key="Name", value=f"slurm-accounting-{index}")])
            ec2.CfnSubnetRouteTableAssociation(self, f"Subnet{index}RouteTable", subnet_id=subnet.ref,
                                               route_table_id=route_table.ref)
            self.subnets.append(subnet)
        self.security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=props.vpc, allow_all_outbound=False,
            description="Slurm accounting database: MySQL from the HyperPod cluster security group only")
        self.ingress = ec2.CfnSecurityGroupIngress(
            self, "FromCluster", group_id=self.security_group.security_group_id, ip_protocol="tcp",
            from_port=MYSQL_PORT, to_port=MYSQL_PORT,
            source_security_group_id=props.cluster_security_group.security_group_id,
            description="slurmdbd on the HyperPod controller -> Aurora MySQL")


@dataclass(kw_only=True, frozen=True)
class AccountingDatabaseProps:
    project: str
    vpc: ec2.IVpc
    network: AccountingNetwork
    key: kms.IKey
    removal_policy: cdk.RemovalPolicy


class AccountingDatabase(Construct):
    """Aurora MySQL Serverless v2 (writer + a reader in the other AZ), KMS-encrypted, private."""

    def __init__(self, scope: Construct, id: str, *, props: AccountingDatabaseProps) -> None:
        super().__init__(scope, id)
        subnets = [ec2.Subnet.from_subnet_attributes(self, f"Subnet{i}", subnet_id=s.ref,
                                                     availability_zone=s.attr_availability_zone,
                                                     route_table_id=props.network.route_table.ref)
                   for i, s in enumerate(props.network.subnets)]
        retain = props.removal_policy == cdk.RemovalPolicy.RETAIN
        self.schema_name = schema_name(props.project)
        self.port = MYSQL_PORT
        self.cluster = rds.DatabaseCluster(
            self, "Cluster",
            engine=rds.DatabaseClusterEngine.aurora_mysql(version=ENGINE_VERSION),
            # A generated password in Secrets Manager, encrypted with the platform key; the
            # secret holds username + password, which is what ClusterAccountingDatabase.
            # SecretArn must contain (API_ClusterAccountingDatabase: "the user name and password
            # for the accounting database"). The user owns the cluster, so it can create the schema.
            credentials=rds.Credentials.from_generated_secret(
                ADMIN_USER, encryption_key=props.key, secret_name=f"{props.project}/slurm-accounting"),
            writer=rds.ClusterInstance.serverless_v2("Writer", auto_minor_version_upgrade=True),
            # A reader in the second AZ: Aurora promotes it if the writer's AZ fails.
            readers=[rds.ClusterInstance.serverless_v2("Reader", scale_with_writer=True,
                                                       auto_minor_version_upgrade=True)],
            serverless_v2_min_capacity=MIN_ACU, serverless_v2_max_capacity=MAX_ACU,
            vpc=props.vpc, vpc_subnets=ec2.SubnetSelection(subnets=subnets),
            security_groups=[props.network.security_group],
            port=MYSQL_PORT,
            storage_encrypted=True, storage_encryption_key=props.key,
            backup=rds.BackupProps(retention=cdk.Duration.days(BACKUP_DAYS)),
            deletion_protection=retain,
            removal_policy=cdk.RemovalPolicy.SNAPSHOT if retain else cdk.RemovalPolicy.DESTROY,
            cloudwatch_logs_exports=LOG_EXPORTS,
            iam_authentication=True,
            monitoring_interval=cdk.Duration.seconds(60),
            copy_tags_to_snapshot=True,
        )
        assert self.cluster.secret is not None
        self.secret = self.cluster.secret
        self._acknowledge()

    @property
    def endpoint(self) -> str:
        return self.cluster.cluster_endpoint.hostname

    @property
    def secret_arn(self) -> str:
        return self.secret.secret_arn

    def _acknowledge(self) -> None:
        """Findings that a fix would break or that do not apply (runbooks/compliance.md, accounting)."""
        rotation = ("slurmdbd reads this password from the secret when HyperPod configures the controller; "
                    "HyperPod's docs do not say it re-reads a rotated secret, so automatic rotation could "
                    "lock slurmdbd out. Rotate as a planned change (rotate, then replace the controller "
                    "node). The secret is KMS-encrypted and readable only by the cluster execution role.")
        secret = self.cluster.node.find_child("Secret").node.default_child
        acknowledge(secret, "AwsSolutions::AwsSolutions-SMG4", rotation)
        acknowledge(secret, "HIPAA.Security::HIPAA.Security-SecretsManagerRotationEnabled", rotation)
        acknowledge(self.cluster.node.find_child("MonitoringRole").node.default_child,
                    "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/"
                    "AmazonRDSEnhancedMonitoringRole]",
                    "RDS Enhanced Monitoring requires a role with this AWS managed policy (it only lets RDS "
                    "publish OS metrics to the RDSOSMetrics log group); AWS maintains it.")
        for instance in ("Writer", "Reader"):
            acknowledge(self.cluster.node.find_child(instance).node.default_child,
                        "HIPAA.Security::HIPAA.Security-RDSInBackupPlan",
                        f"Aurora automated backups ({BACKUP_DAYS} days, point-in-time restore, KMS-encrypted) "
                        "and a final snapshot on deletion protect the cluster; enrolling it in an AWS Backup "
                        "plan is an organisation-level choice that needs no change here (tag-based selection).")
        cfn = self.cluster.node.default_child
        acknowledge(cfn, "AwsSolutions::AwsSolutions-RDS11",
                    "HyperPod's slurmdbd is configured with ClusterAccountingDatabase.Port; the database "
                    "is reachable only from the cluster security group in private subnets, so a "
                    "non-default port would add no protection.")
        acknowledge(cfn, "AwsSolutions::AwsSolutions-RDS14",
                    "Backtrack is not used: the accounting data is protected by 14-day automated backups "
                    "(point-in-time restore) and a final snapshot on deletion; slurmdbd history is "
                    "append-mostly and restore-by-snapshot is the recovery path.")
