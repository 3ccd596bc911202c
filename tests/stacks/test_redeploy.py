"""Tear down, then deploy again: what a real CloudFormation redeploy collides on.

CloudFormation names a resource itself unless the template gives it a custom name ("By default,
CloudFormation generates a unique physical ID to name a resource",
https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-properties-name.html),
and a stack's deletion keeps what has ``DeletionPolicy: Retain`` ("CloudFormation keeps the
resource without deleting the resource or its contents when its stack is deleted",
https://docs.aws.amazon.com/AWSCloudFormation/latest/TemplateReference/aws-attribute-deletionpolicy.html).
A kept resource with a custom name is still there when the next deployment creates one with the
same name: that create fails ("already exists"). So: synthesize deploy 1, take what each
destroy keeps under a fixed name, synthesize deploy 2 as the runbook says to deploy again, and
look for the same name of the same type.

- ``make teardown`` (serving + cluster stacks): deploy 2 is the same configuration.
- ``make teardown-all`` (every stack): deploy 2 raises deploymentGeneration (runbooks/teardown.md).
"""

from __future__ import annotations

import pytest

#: The custom-name property of each resource type the stacks create with a name, as each type's
#: page of the CloudFormation Template Reference names it.
NAME_PROPERTY = {
    "AWS::S3::Bucket": "BucketName",
    "AWS::ECR::Repository": "RepositoryName",
    "AWS::Logs::LogGroup": "LogGroupName",
    "AWS::SecretsManager::Secret": "Name",
    "AWS::RDS::DBCluster": "DBClusterIdentifier",
    "AWS::RDS::DBInstance": "DBInstanceIdentifier",
    "AWS::KMS::Alias": "AliasName",
    "AWS::IAM::Role": "RoleName",
    "AWS::IAM::ManagedPolicy": "ManagedPolicyName",
    "AWS::CloudTrail::Trail": "TrailName",
    "AWS::SageMaker::Cluster": "ClusterName",
    "AWS::SageMaker::Endpoint": "EndpointName",
    "AWS::SageMaker::EndpointConfig": "EndpointConfigName",
    "AWS::SageMaker::Model": "ModelName",
    "AWS::Lambda::Function": "FunctionName",
}
#: Kept by a stack deletion. Snapshot deletes the resource after the snapshot (whose name
#: CloudFormation generates); the accounting database's deletion protection is turned off
#: first by the runbook's teardown (runbooks/teardown.md), or the deletion fails.
KEPT = ("Retain", "RetainExceptOnCreate")
PSEUDO = {"AWS::AccountId": "123456789012", "AWS::Region": "us-east-1", "AWS::Partition": "aws",
          "AWS::URLSuffix": "amazonaws.com"}
CLUSTER_STACKS = ("Cluster", "Serving")


def physical_name(value) -> str | None:
    """The name CloudFormation gives the resource, or None where it is generated (the value
    refers to another resource: e.g. a log group named after a function CloudFormation names)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and set(value) == {"Ref"}:
        return PSEUDO.get(value["Ref"])
    if isinstance(value, dict) and set(value) == {"Fn::Join"}:
        sep, parts = value["Fn::Join"]
        rendered = [physical_name(p) for p in parts]
        return None if None in rendered else sep.join(rendered)
    return None


def named(synth, stacks, *, kept_only: bool) -> dict[tuple[str, str], str]:
    """(type, physical name) -> "stack/logical id" for the custom-named resources of ``stacks``."""
    found = {}
    for stack in stacks:
        for logical_id, res in synth.templates.get(stack, {}).get("Resources", {}).items():
            if kept_only and res.get("DeletionPolicy") not in KEPT:
                continue
            prop = NAME_PROPERTY.get(res["Type"])
            name = physical_name(res.get("Properties", {}).get(prop)) if prop else None
            if name is not None:
                found[(res["Type"], name)] = f"{stack}/{logical_id}"
    return found


def collisions(first, destroyed, second) -> list[str]:
    kept = named(first, destroyed, kept_only=True)
    created = named(second, second.templates, kept_only=False)
    return sorted(f"{type_} {name!r}: kept from {kept[(type_, name)]}, created again by {created[(type_, name)]}"
                  for type_, name in set(kept) & set(created))


@pytest.mark.parametrize("variant", ["default", "accounting"])
def test_every_kept_resource_type_has_its_name_property_known(synthesized, variant):
    """A retained type this module does not know the name property of would be a blind spot."""
    synth = synthesized(variant)
    unknown = {res["Type"] for template in synth.templates.values() for res in template["Resources"].values()
               if res.get("DeletionPolicy") in KEPT and res["Type"] not in NAME_PROPERTY
               and res["Type"] not in ("AWS::KMS::Key", "AWS::FSx::FileSystem")}  # no custom name to give
    assert not unknown


@pytest.mark.parametrize("variant", ["default", "accounting"])
def test_teardown_of_the_cluster_then_deploy_collides_on_nothing(synthesized, variant):
    """`make teardown` removes the serving and cluster stacks; `make deploy` with the same
    cdk.json brings them back onto the same network and storage."""
    synth = synthesized(variant)
    assert collisions(synth, CLUSTER_STACKS, synth) == []


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["default", "accounting"])
def test_full_teardown_then_deploy_of_the_next_generation_collides_on_nothing(synthesized, variant):
    """`make teardown-all` keeps the data (dataRemovalPolicy=retain); the next deployment with
    deploymentGeneration 2 creates everything beside it."""
    first, second = synthesized(variant), synthesized(f"{variant}_g2")
    assert collisions(first, first.templates, second) == []
    # Not vacuous: the same generation again would collide on every kept name.
    again = collisions(first, first.templates, first)
    kept_types = {line.split()[0] for line in again}
    assert {"AWS::S3::Bucket", "AWS::ECR::Repository"} <= kept_types, again
    if variant == "accounting":
        assert {"AWS::Logs::LogGroup", "AWS::SecretsManager::Secret"} <= kept_types, again
