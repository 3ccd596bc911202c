"""ECR repositories for the training images (containers/gpu.Dockerfile, containers/neuron.Dockerfile),
and for the third-party images a private cluster pulls from this account instead of their registry.

One repository per image, named ``<project>/sana-<kind>`` (a mirrored image: ``<project>/<image>``) (``<project>-g<N>/sana-<kind>`` from
deploymentGeneration 2 on; what ``python -m containers.image push`` pushes to): scan on push, immutable tags (a tag is ``<package hash>-<recipe hash>`` and must
always mean the same bytes; pyxis/enroot imports are cached by it on /fsx/images), encrypted
with the platform KMS key, a lifecycle rule that expires untagged images beyond the last
``KEEP_UNTAGGED`` (tagged images are the record of what ran and are kept), and a repository
policy that lets only the cluster execution role pull (no ``*`` principal; pushes come from the
platform team's own IAM identities, which the account grants, not this policy).

The repositories live in the storage stack, kept with the data by ``cdk destroy <project>-cluster``
(a retained repository with a fixed name in the cluster stack made every redeploy of that stack
collide with it). The policy names the execution role, which the cluster stack creates later, by
its fixed name (stacks/names.py) through aws:PrincipalArn on the account principal, as the key
policy does: a resource policy naming a role that does not exist yet is refused. The registry
login (ecr:GetAuthorizationToken) is a policy of the role's own stack (:class:`RegistryLogin`).
Properties: AWS::ECR::Repository (CloudFormation User Guide): ImageScanningConfiguration.ScanOnPush,
ImageTagMutability IMMUTABLE, EncryptionConfiguration {EncryptionType: KMS, KmsKey},
LifecyclePolicy, RepositoryPolicyText.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct

from stacks.common import acknowledge

IMAGE_KINDS = ("gpu", "neuron")
#: Third-party images a private cluster pulls from this account's ECR instead of their registry
#: (``make mirror-dcgm-image`` copies the pinned tag in: containers/image.py ``mirror``); the pins
#: are lifecycle_scripts/agent_releases.py's.
MIRRORED_IMAGES = ("dcgm-exporter",)
KEEP_UNTAGGED = 5
# What `enroot import docker://...` (and docker/podman pull) calls on a repository
# (Amazon ECR User Guide, "Repository policy examples": pull = these three).
PULL_ACTIONS = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]


def repository_name(name_prefix: str, kind: str) -> str:
    """``name_prefix``: PlatformConfig.retained_prefix (the project, and its generation from 2 on)."""
    return f"{name_prefix}/sana-{kind}"


def mirror_repository_name(name_prefix: str, image: str) -> str:
    """The repository holding a mirrored third-party image (MIRRORED_IMAGES): ``<prefix>/<image>``."""
    return f"{name_prefix}/{image}"


class ImageRepositories(Construct):
    """``repositories[kind]`` for every image kind and mirrored image, pullable by the cluster execution role only."""

    def __init__(self, scope: Construct, id: str, *, name_prefix: str, pull_role_arn: str, key: kms.IKey,
                 removal_policy: cdk.RemovalPolicy) -> None:
        super().__init__(scope, id)
        self.repositories: dict[str, ecr.Repository] = {}
        names = {**{kind: repository_name(name_prefix, kind) for kind in IMAGE_KINDS},
                 **{image: mirror_repository_name(name_prefix, image) for image in MIRRORED_IMAGES}}
        for kind, name in names.items():
            repo = ecr.Repository(
                self, "".join(part.capitalize() for part in kind.split("-")), repository_name=name,
                image_scan_on_push=True, image_tag_mutability=ecr.TagMutability.IMMUTABLE,
                encryption=ecr.RepositoryEncryption.KMS, encryption_key=key,
                lifecycle_rules=[ecr.LifecycleRule(
                    description=f"keep the last {KEEP_UNTAGGED} untagged images", tag_status=ecr.TagStatus.UNTAGGED,
                    max_image_count=KEEP_UNTAGGED)],
                removal_policy=removal_policy, empty_on_delete=False)
            repo.add_to_resource_policy(iam.PolicyStatement(
                sid="PullByClusterNodes", principals=[iam.AccountRootPrincipal()],
                actions=PULL_ACTIONS, conditions={"ArnEquals": {"aws:PrincipalArn": pull_role_arn}}))
            self.repositories[kind] = repo


class RegistryLogin(Construct):
    """The registry login token for ``role`` (`aws ecr get-login-password`, which enroot's
    credentials file uses): ecr:GetAuthorizationToken has no resource-level permissions, only "*".
    A managed policy (HIPAA.Security-IAMNoInlinePolicy), attached to the role in its own stack."""

    def __init__(self, scope: Construct, id: str, *, role: iam.IRole) -> None:
        super().__init__(scope, id)
        self.policy = iam.ManagedPolicy(self, "Policy", roles=[role], statements=[
            iam.PolicyStatement(sid="EcrLogin", actions=["ecr:GetAuthorizationToken"], resources=["*"])])
        acknowledge(self.policy, "AwsSolutions::AwsSolutions-IAM5[Resource::*]",
                    "ecr:GetAuthorizationToken does not support resource-level permissions (Service "
                    "Authorization Reference, Amazon ECR); the token only lets the nodes reach the "
                    "registry, and each repository's policy decides what they may pull.")
