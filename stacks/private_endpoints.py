"""PrivateEndpoints: the interface endpoints of a private cluster and the security group in front of them.

Which services and why: stacks/endpoints.py. Each endpoint sits in the cluster subnet with private
DNS, so the SDKs and the AWS CLI on a node resolve the usual regional names
(``logs.<region>.amazonaws.com``) to the endpoint's addresses in the subnet
(https://docs.aws.amazon.com/vpc/latest/privatelink/privatelink-access-aws-services.html,
"Private DNS"). Their security group admits HTTPS from the cluster security group only and sends
nothing anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from constructs import Construct

from stacks.endpoints import Endpoint, endpoint_policy

HTTPS = 443


@dataclass(kw_only=True, frozen=True)
class PrivateEndpointsProps:
    vpc: ec2.IVpc
    subnet: ec2.CfnSubnet
    cluster_security_group: ec2.ISecurityGroup
    endpoints: tuple[Endpoint, ...]


def logical_id(service: str) -> str:
    """``ecr.api`` -> ``EcrApi``, ``aws.sagemaker.experiments`` -> ``AwsSagemakerExperiments``: a stable
    construct id per service."""
    return "".join(part.capitalize() for part in service.replace("-", ".").split("."))


class PrivateEndpoints(Construct):
    """``endpoints[id]`` (Endpoint.id): one interface endpoint per entry, behind ``security_group``."""

    def __init__(self, scope: Construct, id: str, *, props: PrivateEndpointsProps) -> None:
        super().__init__(scope, id)
        self.security_group = ec2.SecurityGroup(
            self, "SecurityGroup", vpc=props.vpc, allow_all_outbound=False,
            description="Interface endpoints of the private cluster: HTTPS from the cluster security group only")
        self.ingress = ec2.CfnSecurityGroupIngress(
            self, "HttpsFromCluster", group_id=self.security_group.security_group_id, ip_protocol="tcp",
            from_port=HTTPS, to_port=HTTPS,
            source_security_group_id=props.cluster_security_group.security_group_id,
            description="AWS API calls from the cluster nodes")
        self.endpoints: dict[str, ec2.CfnVPCEndpoint] = {}
        for endpoint in props.endpoints:
            policy = endpoint_policy(endpoint, account=cdk.Aws.ACCOUNT_ID, region=cdk.Aws.REGION,
                                     partition=cdk.Aws.PARTITION)
            self.endpoints[endpoint.id] = ec2.CfnVPCEndpoint(
                self, logical_id(endpoint.id), vpc_id=props.vpc.vpc_id, vpc_endpoint_type="Interface",
                service_name=f"{endpoint.prefix}.{cdk.Aws.REGION}.{endpoint.service}",
                subnet_ids=[props.subnet.ref], security_group_ids=[self.security_group.security_group_id],
                private_dns_enabled=True, policy_document=policy)
