"""Small helpers shared by the stack modules."""

from __future__ import annotations

import aws_cdk as cdk
from constructs import IConstruct

from stacks.config import PlatformConfig


def removal_policy(cfg: PlatformConfig) -> cdk.RemovalPolicy:
    """dataRemovalPolicy -> the CDK removal policy for buckets, the key and FSx."""
    return cdk.RemovalPolicy.RETAIN if cfg.dataRemovalPolicy == "retain" else cdk.RemovalPolicy.DESTROY


def acknowledge(construct: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one cdk-nag finding on exactly this construct (listed in runbooks/compliance.md).

    ``rule`` is the finding ID as the validation report prints it, e.g.
    ``AwsSolutions::AwsSolutions-S1`` or ``AwsSolutions::AwsSolutions-IAM5[Resource::*]``
    (cdk-nag 3 acknowledges each finding separately; there is no rule-wide wildcard).
    """
    cdk.Validations.of(construct).acknowledge(cdk.Acknowledgment(id=rule, reason=reason))


def ignore_cfn_lint(resource: IConstruct, rule: str) -> None:
    """Silence one cfn-lint rule on one resource via template metadata (cfn-lint's narrowest scope).

    Only used for resources aws-cdk-lib generates (listed in runbooks/compliance.md), where
    changing the generated template would fight the library.
    """
    assert isinstance(resource, cdk.CfnResource), resource
    existing = resource.get_metadata("cfn-lint") or {"config": {"ignore_checks": []}}
    existing["config"]["ignore_checks"].append(rule)
    resource.add_metadata("cfn-lint", existing)


def log_group(scope, id: str, *, retention_days: int, key, removal: cdk.RemovalPolicy, name: str | None = None):
    """A platform log group: the platform's retention (logRetentionDays, any CloudWatch Logs value)
    and a customer-managed key. Returns the aws_logs.LogGroup."""
    from aws_cdk import aws_logs as logs  # noqa: PLC0415 - only the stacks that make log groups need it

    group = logs.LogGroup(scope, id, log_group_name=name, encryption_key=key, removal_policy=removal,
                          retention=logs.RetentionDays.INFINITE)
    group.node.default_child.retention_in_days = retention_days  # the L2 enum names only CDK's values
    return group
