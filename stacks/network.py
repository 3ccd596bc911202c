"""Network: VPC, the cluster subnet in one AZ, NAT egress, S3 endpoint, flow logs, the EFA security group.

With ``privateNetwork`` there is no egress at all: no public subnet, internet gateway or NAT, and the
cluster route table holds only the VPC's local route and the S3 gateway endpoint's prefix list; the
AWS APIs the nodes call are reached through interface endpoints (stacks/endpoints.py says which
and why) and S3 through the gateway endpoint, each with an endpoint policy.

All nodes and the FSx file system sit in ONE private subnet of ONE availability zone: EFA
traffic does not cross AZs and HyperPod places an instance group in the subnets it is given.
The subnet is pinned by AZ *ID* (e.g. use1-az4) rather than AZ name because AZ names are
shuffled per account while capacity (p5, trn) is stated per AZ ID. ec2.Vpc's L2 subnets only
take AZ names, so the subnets, routes and NAT are L1 resources; the L2 Vpc still provides
the closed default security group and the flow log.
"""

from __future__ import annotations

from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.accounting import AccountingNetwork, AccountingNetworkProps
from stacks.common import acknowledge, ignore_cfn_lint, removal_policy
from stacks.config import PlatformConfig
from stacks.endpoints import Endpoint, required_endpoints, s3_gateway_policy
from stacks.key_policy import ADMIN_ACTIONS
from stacks.names import bucket_arn, bucket_names, log_group_arn, trail_arn
from stacks.private_endpoints import PrivateEndpoints, PrivateEndpointsProps

ACCESS_LOG_PREFIX = "s3-access-logs/"
TRAIL_PREFIX = "cloudtrail"  # stacks/trail.py writes under it
FLOW_LOG_PREFIX = "vpc-flow-logs/"


@dataclass(kw_only=True, frozen=True)
class NetworkProps:
    cidr: str
    az_id: str
    cluster_subnet_cidr: str
    nat_subnet_cidr: str
    removal_policy: cdk.RemovalPolicy
    project: str
    bucket_prefix: str
    """PlatformConfig.retained_prefix: the platform buckets' names start with it (stacks/names.py)."""
    cloud_trail: bool
    log_retention_days: int
    accounting_subnet_cidrs: tuple[str, str] | None = None
    """Set only with slurmAccounting: the two DB subnets Aurora needs (two AZs)."""
    private_endpoints: tuple[Endpoint, ...] | None = None
    """Set only with privateNetwork: no NAT or internet gateway; these interface endpoints instead."""


class AccessLogBucket(Construct):
    """The one bucket that receives S3 server access logs and VPC flow logs.

    SSE-S3, not SSE-KMS: S3 server access log delivery only supports SSE-S3 destinations
    (docs.aws.amazon.com/AmazonS3/latest/userguide/enable-server-access-logging.html).
    """

    def __init__(self, scope: Construct, id: str, *, removal: cdk.RemovalPolicy, project: str, bucket_prefix: str,
                 cloud_trail: bool) -> None:
        super().__init__(scope, id)
        self.bucket = s3.Bucket(
            self, "Bucket",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            enforce_ssl=True,
            versioned=True,
            removal_policy=removal,
            lifecycle_rules=[s3.LifecycleRule(
                id="archive-after-90-days",
                transitions=[s3.Transition(storage_class=s3.StorageClass.GLACIER_INSTANT_RETRIEVAL,
                                           transition_after=cdk.Duration.days(90))],
            )],
        )
        # Server access logs from exactly the platform's buckets (storage stack), named by their
        # deterministic names (stacks/names.py) rather than referenced: a reference would make
        # this stack depend on the storage stack, which depends on this one. The two condition
        # keys AWS gives for the logging service principal: aws:SourceArn (the source bucket)
        # and aws:SourceAccount
        # (https://docs.aws.amazon.com/AmazonS3/latest/userguide/enable-server-access-logging.html,
        # "Grant permissions to the logging service principal by using a bucket policy").
        self.bucket.add_to_resource_policy(iam.PolicyStatement(
            sid="S3ServerAccessLogsFromThePlatformBuckets",
            principals=[iam.ServicePrincipal("logging.s3.amazonaws.com")],
            actions=["s3:PutObject"],
            resources=[self.bucket.arn_for_objects(ACCESS_LOG_PREFIX + "*")],
            conditions={"StringEquals": {"aws:SourceAccount": cdk.Aws.ACCOUNT_ID},
                        "ArnEquals": {"aws:SourceArn": [bucket_arn(n) for n in bucket_names(bucket_prefix).values()]}},
        ))
        if cloud_trail:
            # The platform's trail (stacks/trail.py) writes here; CloudTrail's own bucket policy,
            # with aws:SourceArn naming the trail
            # (https://docs.aws.amazon.com/awscloudtrail/latest/userguide/create-s3-bucket-policy-for-cloudtrail.html).
            trail = {"StringEquals": {"aws:SourceArn": trail_arn(project)}}
            self.bucket.add_to_resource_policy(iam.PolicyStatement(
                sid="CloudTrailAclCheck", principals=[iam.ServicePrincipal("cloudtrail.amazonaws.com")],
                actions=["s3:GetBucketAcl"], resources=[self.bucket.bucket_arn], conditions=trail))
            self.bucket.add_to_resource_policy(iam.PolicyStatement(
                sid="CloudTrailWrite", principals=[iam.ServicePrincipal("cloudtrail.amazonaws.com")],
                actions=["s3:PutObject"],
                resources=[self.bucket.arn_for_objects(f"{TRAIL_PREFIX}/AWSLogs/{cdk.Aws.ACCOUNT_ID}/*")],
                conditions={"StringEquals": {**trail["StringEquals"], "s3:x-amz-acl": "bucket-owner-full-control"}}))
        cfn = self.bucket.node.default_child
        acknowledge(cfn, "AwsSolutions::AwsSolutions-S1",
                    "This is the access-log destination bucket; logging it into itself would loop. "
                    "Reads of it are recorded by CloudTrail data events where the account enables them.")
        acknowledge(cfn, "HIPAA.Security::HIPAA.Security-S3BucketLoggingEnabled",
                    "This is the access-log destination bucket; logging it into itself would loop.")
        acknowledge(cfn, "HIPAA.Security::HIPAA.Security-S3DefaultEncryptionKMS",
                    "S3 server access log delivery only supports SSE-S3 destination buckets; the "
                    "bucket is encrypted with SSE-S3 (AES-256), SSL-only and blocks public access.")
        acknowledge(cfn, "HIPAA.Security::HIPAA.Security-S3BucketReplicationEnabled",
                    "Logs are versioned and retained in-region; cross-region replication is an "
                    "organisation-level DR decision (S3 Replication can be added without code changes).")


class HandlerLogGroup(Construct):
    """The log group of a CDK-generated Lambda that runs during deployment, made before it first
    runs (Lambda would otherwise create /aws/lambda/<name> itself: never expiring, no CMK), with
    the platform's retention and a key of this stack's own (the platform key lives in the storage
    stack, which depends on this one)."""

    def __init__(self, scope: Construct, id: str, *, handler: cdk.CfnResource, retention_days: int,
                 removal: cdk.RemovalPolicy) -> None:
        super().__init__(scope, id)
        name = cdk.Fn.join("", ["/aws/lambda/", handler.ref])
        self.key = kms.Key(
            self, "Key", enable_key_rotation=True, removal_policy=removal,
            description="Encrypts the network stack's deployment-time Lambda log group",
            policy=iam.PolicyDocument(statements=[
                iam.PolicyStatement(sid="KeyAdministration", principals=[iam.AccountRootPrincipal()],
                                    actions=ADMIN_ACTIONS, resources=["*"]),
                iam.PolicyStatement(
                    sid="CloudWatchLogsForThisLogGroup",
                    principals=[iam.ServicePrincipal(f"logs.{cdk.Aws.REGION}.amazonaws.com")],
                    actions=["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"],
                    resources=["*"],
                    conditions={"ArnLike": {"kms:EncryptionContext:aws:logs:arn": log_group_arn("/aws/lambda/*")}}),
            ]))
        self.log_group = logs.CfnLogGroup(self, "Resource", log_group_name=name, retention_in_days=retention_days,
                                          kms_key_id=self.key.key_arn)
        self.log_group.apply_removal_policy(removal)


class Network(Construct):
    """VPC with one private cluster subnet (+ a /28 public subnet for the NAT gateway, unless private)."""

    def __init__(self, scope: Construct, id: str, *, props: NetworkProps) -> None:
        super().__init__(scope, id)
        self.access_logs = AccessLogBucket(self, "AccessLogs", removal=props.removal_policy, project=props.project,
                                           bucket_prefix=props.bucket_prefix, cloud_trail=props.cloud_trail).bucket
        self.vpc = ec2.Vpc(
            self, "Vpc",
            ip_addresses=ec2.IpAddresses.cidr(props.cidr),
            subnet_configuration=[],
            nat_gateways=0,
            restrict_default_security_group=True,
            enable_dns_hostnames=True,
            enable_dns_support=True,
        )
        restrict_provider = cdk.Stack.of(self).node.find_child("Custom::VpcRestrictDefaultSGCustomResourceProvider")
        handler = restrict_provider.node.find_child("Handler")
        ignore_cfn_lint(handler, "W3005")
        self.handler_logs = HandlerLogGroup(self, "RestrictDefaultSecurityGroupLogs", handler=handler,
                                            retention_days=props.log_retention_days,
                                            removal=props.removal_policy)
        restrict = self.vpc.node.find_child("RestrictDefaultSecurityGroupCustomResource")
        restrict.node.add_dependency(self.handler_logs)
        self.flow_log = self.vpc.add_flow_log(
            "FlowLog",
            destination=ec2.FlowLogDestination.to_s3(self.access_logs, FLOW_LOG_PREFIX),
            traffic_type=ec2.FlowLogTrafficType.ALL,
        )
        vpc_id = self.vpc.vpc_id
        private = props.private_endpoints is not None
        nat = None if private else self._nat_egress(props)

        # Private subnet: every HyperPod node and the FSx file system.
        self.cluster_subnet = ec2.CfnSubnet(
            self, "ClusterSubnet", vpc_id=vpc_id, cidr_block=props.cluster_subnet_cidr,
            availability_zone_id=props.az_id, map_public_ip_on_launch=False,
            tags=[cdk.CfnTag(key="Name", value="cluster")])
        private_rt = ec2.CfnRouteTable(self, "ClusterRouteTable", vpc_id=vpc_id)
        ec2.CfnSubnetRouteTableAssociation(self, "ClusterRouteTableAssociation",
                                           subnet_id=self.cluster_subnet.ref, route_table_id=private_rt.ref)
        if nat is not None:
            ec2.CfnRoute(self, "ClusterDefaultRoute", route_table_id=private_rt.ref,
                         destination_cidr_block="0.0.0.0/0", nat_gateway_id=nat.ref)
        # S3 traffic (datasets, checkpoints, FSx is separate) stays on the AWS network and
        # avoids NAT data-processing charges. Private: the only way to S3, bounded by its policy.
        self.s3_endpoint = ec2.CfnVPCEndpoint(
            self, "S3Endpoint", vpc_id=vpc_id, vpc_endpoint_type="Gateway",
            service_name=f"com.amazonaws.{cdk.Aws.REGION}.s3",
            route_table_ids=[private_rt.ref] + ([] if private else [self.public_route_table.ref]),
            policy_document=s3_gateway_policy(account=cdk.Aws.ACCOUNT_ID, region=cdk.Aws.REGION,
                                               partition=cdk.Aws.PARTITION) if private else None)

        # EFA requires a security group that allows ALL traffic from and to itself, inbound
        # AND outbound; the EFA health checks fail without both
        # (docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html#efa-start-security).
        # The same rules cover Lustre (TCP 988) between nodes and FSx.
        self.security_group = ec2.SecurityGroup(
            self, "ClusterSecurityGroup", vpc=self.vpc, allow_all_outbound=True,
            description="HyperPod nodes and FSx for Lustre: all traffic within the group (EFA, Lustre 988)")
        sg_id = self.security_group.security_group_id
        self.self_ingress = ec2.CfnSecurityGroupIngress(
            self, "SelfIngress", group_id=sg_id, source_security_group_id=sg_id, ip_protocol="-1",
            description="EFA/NCCL, Slurm, Lustre between members of this group")
        self.self_egress = ec2.CfnSecurityGroupEgress(
            self, "SelfEgress", group_id=sg_id, destination_security_group_id=sg_id, ip_protocol="-1",
            description="EFA requires an explicit self-referencing egress rule")
        acknowledge(self.self_ingress, "HIPAA.Security::HIPAA.Security-EC2RestrictedCommonPorts",
                    "The rule admits all ports only from this same security group (no CIDR, nothing from "
                    "outside the group), as EFA requires; no port is open to the internet or the VPC.")
        self.accounting = None if props.accounting_subnet_cidrs is None else AccountingNetwork(
            self, "Accounting", props=AccountingNetworkProps(
                vpc=self.vpc, subnet_cidrs=props.accounting_subnet_cidrs, cluster_security_group=self.security_group))
        self.private_endpoints = None if not private else PrivateEndpoints(
            self, "Endpoints", props=PrivateEndpointsProps(
                vpc=self.vpc, subnet=self.cluster_subnet, cluster_security_group=self.security_group,
                endpoints=props.private_endpoints))

    def _nat_egress(self, props: NetworkProps) -> ec2.CfnNatGateway:
        """A public /28 holding only the NAT gateway, its internet gateway and route. No public IPs
        are ever auto-assigned."""
        vpc_id = self.vpc.vpc_id
        self.nat_subnet = ec2.CfnSubnet(
            self, "NatSubnet", vpc_id=vpc_id, cidr_block=props.nat_subnet_cidr,
            availability_zone_id=props.az_id, map_public_ip_on_launch=False,
            tags=[cdk.CfnTag(key="Name", value="nat")])
        igw = ec2.CfnInternetGateway(self, "InternetGateway")
        attach = ec2.CfnVPCGatewayAttachment(self, "InternetGatewayAttachment", vpc_id=vpc_id,
                                             internet_gateway_id=igw.ref)
        self.public_route_table = ec2.CfnRouteTable(self, "NatRouteTable", vpc_id=vpc_id)
        ec2.CfnSubnetRouteTableAssociation(self, "NatRouteTableAssociation",
                                           subnet_id=self.nat_subnet.ref, route_table_id=self.public_route_table.ref)
        to_igw = ec2.CfnRoute(self, "NatDefaultRoute", route_table_id=self.public_route_table.ref,
                              destination_cidr_block="0.0.0.0/0", gateway_id=igw.ref)
        to_igw.node.add_dependency(attach)
        acknowledge(to_igw, "HIPAA.Security::HIPAA.Security-VPCNoUnrestrictedRouteToIGW",
                    "Only the NAT gateway's /28 subnet routes to the internet gateway; no instance "
                    "runs there and no public IP is auto-assigned. Cluster nodes sit in the private "
                    "subnet and reach the internet (Neuron/PyPI repositories, AWS APIs) only through NAT.")
        eip = ec2.CfnEIP(self, "NatAddress", domain="vpc")
        nat = ec2.CfnNatGateway(self, "NatGateway", subnet_id=self.nat_subnet.ref,
                                allocation_id=eip.attr_allocation_id)
        nat.node.add_dependency(to_igw)
        return nat


class NetworkStack(cdk.Stack):
    """Deployed first; the storage and cluster stacks reference its subnet and security group."""

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        self.network = Network(self, "Network", props=NetworkProps(
            cidr=config.vpcCidr, az_id=config.availabilityZoneId,
            cluster_subnet_cidr=config.private_subnet_cidr, nat_subnet_cidr=config.public_subnet_cidr,
            removal_policy=removal_policy(config), project=config.projectName,
            bucket_prefix=config.retained_prefix, cloud_trail=config.cloudTrail,
            log_retention_days=config.logRetentionDays,
            accounting_subnet_cidrs=config.accounting_subnet_cidrs if config.slurmAccounting else None,
            private_endpoints=required_endpoints(config) if config.privateNetwork else None))
