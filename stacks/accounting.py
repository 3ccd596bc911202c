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

import json
import re
from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_kms as kms
from aws_cdk import aws_rds as rds
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from stacks.accounting_user import SLURMDBD_USER, SlurmdbdUser
from stacks.common import acknowledge, log_group

# Aurora MySQL 3 (MySQL 8.0-compatible), a Slurm-supported MySQL server
# (slurm.schedmd.com/accounting.html, "MySQL Configuration").
ENGINE_VERSION = rds.AuroraMysqlEngineVersion.VER_3_10_0
MYSQL_PORT = 3306
ADMIN_USER = "admin"
# The audit plugin's events: logins and schema/permission changes, not every statement slurmdbd
# makes (the job records themselves are in the accounting tables).
AUDIT_EVENTS = "CONNECT,QUERY_DCL,QUERY_DDL"
# Serverless v2 capacity in ACUs: slurmdbd's load is a few writes per job; 0.5 is the floor.
MIN_ACU, MAX_ACU = 0.5, 4
BACKUP_DAYS = 14
# Exported to CloudWatch Logs: the audit log, errors and slow queries. Not the general log: it
# records every statement slurmdbd makes, i.e. the accounting data a second time.
LOG_EXPORTS = ("audit", "error", "slowquery")


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
            description="Slurm accounting database: MySQL from the Slurm controller client group only")
        # Only the controller (slurmdbd) may reach the database, not every node of the cluster
        # security group (the login node included): the controller group alone carries this
        # group too (stacks/cluster.py, OverrideVpcConfig of the controller group).
        self.client_security_group = ec2.SecurityGroup(
            self, "ClientSecurityGroup", vpc=props.vpc, allow_all_outbound=False,
            description="The Slurm controller, client of the accounting database (MySQL out only)")
        self.ingress = ec2.CfnSecurityGroupIngress(
            self, "FromController", group_id=self.security_group.security_group_id, ip_protocol="tcp",
            from_port=MYSQL_PORT, to_port=MYSQL_PORT,
            source_security_group_id=self.client_security_group.security_group_id,
            description="slurmdbd on the HyperPod controller -> Aurora MySQL")
        ec2.CfnSecurityGroupEgress(
            self, "ToDatabase", group_id=self.client_security_group.security_group_id, ip_protocol="tcp",
            from_port=MYSQL_PORT, to_port=MYSQL_PORT,
            destination_security_group_id=self.security_group.security_group_id,
            description="slurmdbd -> Aurora MySQL")


@dataclass(kw_only=True, frozen=True)
class AccountingDatabaseProps:
    project: str
    name_prefix: str
    """PlatformConfig.retained_prefix: the cluster identifier and secret name carry it (both are kept
    or reserved after a destroy: the log groups, and a deleted secret's name for its recovery window)."""
    vpc: ec2.IVpc
    network: AccountingNetwork
    key: kms.IKey
    removal_policy: cdk.RemovalPolicy
    log_retention_days: int


def cluster_identifier(name_prefix: str) -> str:
    """Fixed, so the log groups RDS exports to can be made (with retention and the key) first."""
    return f"{name_prefix}-slurm-accounting"


class AccountingDatabase(Construct):
    """Aurora MySQL Serverless v2 (writer + a reader in the other AZ), KMS-encrypted, private.

    Two logins: the admin, whose password RDS generates, stores in Secrets Manager and rotates
    itself ("RDS-managed master password",
    https://docs.aws.amazon.com/AmazonRDS/latest/AuroraUserGuide/rds-secrets-manager.html) and
    which no node can read; and `slurm`, slurmdbd's, in a secret of its own that the execution
    role reads (ClusterAccountingDatabase.SecretArn), with all privileges on the accounting schema
    and none elsewhere ("GRANT ALL ON slurm_acct_db.* TO 'slurm'": slurm.schedmd.com/accounting.html,
    "MySQL Configuration"), created through the RDS Data API by a deploy-time function
    (SlurmdbdUser). TLS is required of every connection (the cluster parameter
    require_secure_transport, and REQUIRE SSL on the user); the audit log (connections, DDL,
    DCL: server_audit_logging / server_audit_events,
    https://docs.aws.amazon.com/AmazonRDS/latest/AuroraUserGuide/AuroraMySQL.Auditing.html) is on
    and exported with the error and slow-query logs into log groups made beforehand with the
    platform's retention and key.
    """

    def __init__(self, scope: Construct, id: str, *, props: AccountingDatabaseProps) -> None:
        super().__init__(scope, id)
        subnets = [ec2.Subnet.from_subnet_attributes(self, f"Subnet{i}", subnet_id=s.ref,
                                                     availability_zone=s.attr_availability_zone,
                                                     route_table_id=props.network.route_table.ref)
                   for i, s in enumerate(props.network.subnets)]
        retain = props.removal_policy == cdk.RemovalPolicy.RETAIN
        self.schema_name = schema_name(props.project)
        self.port = MYSQL_PORT
        identifier = cluster_identifier(props.name_prefix)
        engine = rds.DatabaseClusterEngine.aurora_mysql(version=ENGINE_VERSION)
        parameters = rds.ParameterGroup(self, "Parameters", engine=engine, description=(
            "Slurm accounting: TLS required, audit log of connections and DDL/DCL, slow queries"), parameters={
                "require_secure_transport": "ON",
                "server_audit_logging": "1",
                "server_audit_events": AUDIT_EVENTS,
                "slow_query_log": "1",
                "long_query_time": "5",
                "log_output": "FILE",
            })
        self.log_groups = {
            kind: log_group(self, f"{kind.capitalize()}Logs", name=f"/aws/rds/cluster/{identifier}/{kind}",
                            retention_days=props.log_retention_days, key=props.key, removal=props.removal_policy)
            for kind in LOG_EXPORTS}
        self.cluster = rds.DatabaseCluster(
            self, "Cluster",
            engine=engine,
            cluster_identifier=identifier,
            credentials=rds.Credentials.from_username(ADMIN_USER, encryption_key=props.key),
            manage_master_user_password=True,
            parameter_group=parameters,
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
            cloudwatch_logs_exports=list(LOG_EXPORTS),
            iam_authentication=True,
            enable_data_api=True,
            monitoring_interval=cdk.Duration.seconds(60),
            copy_tags_to_snapshot=True,
        )
        for group in self.log_groups.values():
            self.cluster.node.add_dependency(group)
        # slurmdbd's own login; the secret holds username + password, what
        # ClusterAccountingDatabase.SecretArn must contain (API_ClusterAccountingDatabase).
        self.secret = secretsmanager.Secret(
            self, "SlurmdbdSecret", secret_name=f"{props.name_prefix}/slurmdbd", encryption_key=props.key,
            description="slurmdbd's login to the Slurm accounting database (rights on its schema only)",
            removal_policy=props.removal_policy,
            generate_secret_string=secretsmanager.SecretStringGenerator(
                secret_string_template=json.dumps({"username": SLURMDBD_USER}, separators=(",", ":")),
                generate_string_key="password",
                exclude_characters=" %+~`#$&*()|[]{}:;<>?!'/@\"\\", password_length=30))
        self.user = SlurmdbdUser(self, "SlurmdbdUser", cluster=self.cluster, user_secret=self.secret,
                                 schema=self.schema_name, key=props.key, retention_days=props.log_retention_days)
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
                    "lock slurmdbd out. Rotate as a planned change (new password in the secret, run the "
                    "SlurmdbdUser function again, which converges, then replace the controller node). The secret is "
                    "KMS-encrypted and readable only by the cluster execution role; the admin login is "
                    "RDS-managed (rotated by RDS) and not readable by the nodes.")
        secret = self.secret.node.default_child
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
        acknowledge(cfn, "HIPAA.Security::HIPAA.Security-RDSLoggingEnabled[LogExport::general]",
                    "The general log records every statement slurmdbd makes, i.e. every job record a second "
                    "time outside the database; the audit log (connections, DDL, DCL), the error log and the "
                    "slow-query log are on and exported, with retention and the platform key.")
        acknowledge(cfn, "AwsSolutions::AwsSolutions-RDS11",
                    "HyperPod's slurmdbd is configured with ClusterAccountingDatabase.Port; the database "
                    "is reachable only from the cluster security group in private subnets, so a "
                    "non-default port would add no protection.")
        acknowledge(cfn, "AwsSolutions::AwsSolutions-RDS14",
                    "Backtrack is not used: the accounting data is protected by 14-day automated backups "
                    "(point-in-time restore) and a final snapshot on deletion; slurmdbd history is "
                    "append-mostly and restore-by-snapshot is the recovery path.")
