"""ECR repositories for the training images (stacks/images.py) as synthesized: in the storage
stack, kept with the data; the registry login on the execution role in the cluster stack."""

from __future__ import annotations

import json

from stacks.agent_releases import DCGM_EXPORTER
from stacks.images import IMAGE_KINDS, KEEP_UNTAGGED, MIRRORED_IMAGES, PULL_ACTIONS


def _repos(synth) -> dict[str, dict]:
    return {res["Properties"]["RepositoryName"]: res for res in synth.resources("Storage", "AWS::ECR::Repository").values()}


def _execution_role_id(synth) -> str:
    roles = [rid for rid, res in synth.resources("Cluster", "AWS::IAM::Role").items()
             if "sagemaker.amazonaws.com" in json.dumps(res["Properties"]["AssumeRolePolicyDocument"])]
    (role,) = roles
    return role


def test_one_repository_per_image_scanned_immutable_kms_with_the_platform_key(default):
    repos = _repos(default)
    # The training images, and the third-party images a private cluster pulls from here (the DCGM
    # exporter: the repository its pin names, lifecycle_scripts/agent_releases.py).
    assert set(repos) == {f"sana/sana-{kind}" for kind in IMAGE_KINDS} | {f"sana/{image}" for image in MIRRORED_IMAGES}
    assert f"sana/{DCGM_EXPORTER.repository}" in repos
    (key,) = default.resources("Storage", "AWS::KMS::Key")  # the platform key, in the same stack
    for res in repos.values():
        props = res["Properties"]
        assert props["ImageScanningConfiguration"] == {"ScanOnPush": True}
        assert props["ImageTagMutability"] == "IMMUTABLE"
        assert props["EncryptionConfiguration"] == {"EncryptionType": "KMS", "KmsKey": {"Fn::GetAtt": [key, "Arn"]}}
        assert res["DeletionPolicy"] == "Retain"  # dataRemovalPolicy=retain (cdk.json default)


def test_lifecycle_rule_expires_untagged_images_beyond_the_last_n(default):
    for res in _repos(default).values():
        policy = json.loads(res["Properties"]["LifecyclePolicy"]["LifecyclePolicyText"])
        (rule,) = policy["rules"]
        assert rule["selection"] == {"tagStatus": "untagged", "countType": "imageCountMoreThan",
                                     "countNumber": KEEP_UNTAGGED}
        assert rule["action"] == {"type": "expire"}


def test_only_the_cluster_execution_role_may_pull(default):
    """Named by its fixed ARN (the cluster stack creates the role after the repositories)."""
    from test_templates import _render

    refs = {"AWS::Partition": "aws", "AWS::AccountId": "123456789012", "AWS::Region": "us-east-1"}
    (role,) = [res for rid, res in default.resources("Cluster", "AWS::IAM::Role").items()
               if rid == _execution_role_id(default)]
    role_arn = f"arn:aws:iam::123456789012:role/{_render(role['Properties']['RoleName'], refs)}"
    for name, res in _repos(default).items():
        (statement,) = res["Properties"]["RepositoryPolicyText"]["Statement"]
        assert statement["Effect"] == "Allow"
        assert _render(statement["Condition"]["ArnEquals"]["aws:PrincipalArn"], refs) == role_arn, name
        assert _render(statement["Principal"]["AWS"], refs) == "arn:aws:iam::123456789012:root"
        assert sorted(statement["Action"]) == sorted(PULL_ACTIONS)


def test_execution_role_may_log_in_to_the_registry(default):
    role = _execution_role_id(default)
    policies = [res["Properties"] for res in default.resources("Cluster", "AWS::IAM::ManagedPolicy").values()
                if {"Ref": role} in res["Properties"].get("Roles", [])]
    statements = [st for p in policies for st in p["PolicyDocument"]["Statement"]]
    assert {"Sid": "EcrLogin", "Effect": "Allow", "Action": "ecr:GetAuthorizationToken", "Resource": "*"} in statements


def test_repository_uris_are_outputs_of_the_stack_that_keeps_them(default):
    assert {"GpuImageRepositoryUri", "NeuronImageRepositoryUri", "DcgmExporterRepositoryUri"} <= set(
        default.templates["Storage"]["Outputs"])
    assert not default.resources("Cluster", "AWS::ECR::Repository")
