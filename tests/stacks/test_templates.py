"""Template assertions on the default platform (cdk.json as shipped: GPU + Trainium + login)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from aws_cdk.assertions import Match

from tests.conftest import skip_or_fail

pytestmark = pytest.mark.slow  # the shared session synth takes ~30-60 s on the 2-core machine


def sg_ref(synth, stack="Network"):
    (sg_id,) = synth.resources(stack, "AWS::EC2::SecurityGroup")
    return {"Fn::GetAtt": [sg_id, "GroupId"]}


# ---- network ------------------------------------------------------------------------
def test_security_group_allows_all_traffic_from_and_to_itself(default):
    t, sg = default.template("Network"), sg_ref(default)
    t.resource_count_is("AWS::EC2::SecurityGroupIngress", 1)
    t.has_resource_properties("AWS::EC2::SecurityGroupIngress",
                              {"IpProtocol": "-1", "GroupId": sg, "SourceSecurityGroupId": sg})
    t.has_resource_properties("AWS::EC2::SecurityGroupEgress",
                              {"IpProtocol": "-1", "GroupId": sg, "DestinationSecurityGroupId": sg})
    # No ingress from any CIDR at all (inline rules included).
    (group,) = default.resources("Network", "AWS::EC2::SecurityGroup").values()
    assert "SecurityGroupIngress" not in group["Properties"]


def test_cluster_subnet_is_private_in_the_configured_az_id(default):
    subnets = [r["Properties"] for r in default.resources("Network", "AWS::EC2::Subnet").values()]
    assert len(subnets) == 2
    assert all(s["AvailabilityZoneId"] == "use1-az4" for s in subnets)
    assert all(s["MapPublicIpOnLaunch"] is False for s in subnets)
    assert sorted(s["CidrBlock"] for s in subnets) == ["10.0.0.0/17", "10.0.128.0/28"]
    # The cluster subnet's default route goes to the NAT gateway, never to the internet gateway.
    t = default.template("Network")
    t.has_resource_properties("AWS::EC2::Route", {"DestinationCidrBlock": "0.0.0.0/0",
                                                  "NatGatewayId": {"Ref": Match.string_like_regexp("NatGateway")}})


def test_s3_gateway_endpoint_serves_both_route_tables(default):
    default.template("Network").has_resource_properties("AWS::EC2::VPCEndpoint", {
        "VpcEndpointType": "Gateway",
        "ServiceName": {"Fn::Join": ["", ["com.amazonaws.", {"Ref": "AWS::Region"}, ".s3"]]},
        "RouteTableIds": Match.array_with([{"Ref": Match.string_like_regexp("ClusterRouteTable")}]),
    })


def test_vpc_flow_logs_capture_all_traffic_to_the_log_bucket(default):
    default.template("Network").has_resource_properties("AWS::EC2::FlowLog", {
        "ResourceType": "VPC", "TrafficType": "ALL", "LogDestinationType": "s3",
        "LogDestination": Match.object_like({"Fn::Join": Match.any_value()}),
    })


# ---- storage ------------------------------------------------------------------------
def _buckets(synth):
    return {k: v["Properties"] for k, v in synth.resources("Storage", "AWS::S3::Bucket").items()}


def test_platform_buckets_are_kms_encrypted_versioned_private_and_logged(default):
    buckets = _buckets(default)
    assert len(buckets) == 3
    (key_id,) = default.resources("Storage", "AWS::KMS::Key")
    for props in buckets.values():
        sse = props["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
        assert sse == {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": {"Fn::GetAtt": [key_id, "Arn"]}}
        assert props["VersioningConfiguration"] == {"Status": "Enabled"}
        assert props["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True}
        assert props["LoggingConfiguration"]["LogFilePrefix"].startswith("s3-access-logs/")
    names = sorted(json.dumps(p["BucketName"]) for p in buckets.values())
    assert any('"sagemaker-sana-lc-"' in n for n in names), names


def test_access_log_bucket_is_sse_s3_versioned_private(default):
    (props,) = [r["Properties"] for r in default.resources("Network", "AWS::S3::Bucket").values()]
    sse = props["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
    assert sse == {"SSEAlgorithm": "AES256"}
    assert props["VersioningConfiguration"] == {"Status": "Enabled"}
    assert props["PublicAccessBlockConfiguration"]["BlockPublicPolicy"] is True


@pytest.mark.parametrize("stack,count", [("Storage", 3), ("Network", 1)])
def test_every_bucket_policy_denies_plain_http(default, stack, count):
    t = default.template(stack)
    t.resource_count_is("AWS::S3::BucketPolicy", count)
    policies = default.resources(stack, "AWS::S3::BucketPolicy").values()
    for policy in policies:
        statements = policy["Properties"]["PolicyDocument"]["Statement"]
        assert any(s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
                   for s in statements)


def test_kms_key_rotates(default):
    default.template("Storage").has_resource_properties("AWS::KMS::Key", {"EnableKeyRotation": True})


def test_fsx_is_persistent2_encrypted_with_configured_size_and_throughput(default):
    (key_id,) = default.resources("Storage", "AWS::KMS::Key")
    default.template("Storage").has_resource_properties("AWS::FSx::FileSystem", {
        "FileSystemType": "LUSTRE", "StorageCapacity": 1200,
        "KmsKeyId": {"Fn::GetAtt": [key_id, "Arn"]},
        "LustreConfiguration": Match.object_like({"DeploymentType": "PERSISTENT_2", "PerUnitStorageThroughput": 250}),
        "SecurityGroupIds": [Match.object_like({"Fn::ImportValue": Match.string_like_regexp("ClusterSecurityGroup")})],
        "SubnetIds": [Match.object_like({"Fn::ImportValue": Match.string_like_regexp("ClusterSubnet")})],
    })


def test_fsx_waits_for_the_security_group_rules(default):
    # The rules live in the network stack, so the dependency is the stack order.
    assert default.platform.network in default.platform.storage.dependencies


def test_data_repository_associations(default):
    dras = {r["Properties"]["FileSystemPath"]: r["Properties"]
            for r in default.resources("Storage", "AWS::FSx::DataRepositoryAssociation").values()}
    assert set(dras) == {"/data", "/artefacts"}
    events = ["NEW", "CHANGED", "DELETED"]
    assert dras["/data"]["S3"] == {"AutoImportPolicy": {"Events": events}}
    assert dras["/artefacts"]["S3"] == {"AutoImportPolicy": {"Events": events}, "AutoExportPolicy": {"Events": events}}
    by_name = {json.dumps(p["BucketName"]): logical for logical, p in _buckets(default).items()}
    data = next(logical for name, logical in by_name.items() if '"sana-data-"' in name)
    artefacts = next(logical for name, logical in by_name.items() if '"sana-artefacts-"' in name)
    assert dras["/data"]["DataRepositoryPath"] == {"Fn::Join": ["", ["s3://", {"Ref": data}, "/"]]}
    assert dras["/artefacts"]["DataRepositoryPath"] == {"Fn::Join": ["", ["s3://", {"Ref": artefacts}, "/"]]}


# ---- cluster ------------------------------------------------------------------------
def test_execution_role_is_sagemaker_with_managed_policy_and_platform_policy(default):
    default.template("Cluster").has_resource_properties("AWS::IAM::Role", {
        "AssumeRolePolicyDocument": {"Statement": [Match.object_like(
            {"Principal": {"Service": "sagemaker.amazonaws.com"}})], "Version": Match.any_value()},
        "ManagedPolicyArns": Match.array_with([{"Fn::Join": ["", [
            "arn:", {"Ref": "AWS::Partition"}, ":iam::aws:policy/AmazonSageMakerClusterInstanceRolePolicy"]]}]),
    })


def platform_policy(synth) -> dict:
    """The execution role's platform policy (the registry-login policy is tests/stacks/test_images.py's)."""
    (policy,) = [p for p in synth.resources("Cluster", "AWS::IAM::ManagedPolicy").values()
                 if "ReadLifecycleScripts" in json.dumps(p)]
    return policy


def test_execution_policy_resources_are_this_platforms_arns(default):
    policy = platform_policy(default)
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    for st in statements:
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        rendered = [json.dumps(r) for r in resources]
        if st["Sid"] == "DescribeNetwork":  # ec2:Describe* has no resource-level permissions
            assert all(a.startswith("ec2:Describe") for a in st["Action"]) and resources == ["*"]
            continue
        assert "*" not in resources, st
        for text in rendered:
            if '":s3:::' in text:
                assert any(f'":s3:::{n}' in text for n in ("sana-data-", "sana-artefacts-", "sagemaker-sana-lc-")), text
            elif st["Sid"] in ("UsePlatformKey", "GrantPlatformKeyToNodeVolumes"):
                assert "Fn::ImportValue" in text and "Key" in text, text
            elif st["Sid"] == "RemoteWriteToThePlatformWorkspace":  # the observability stack's workspace
                assert text.startswith('{"Fn::ImportValue": "sana-observability:') and "MetricsWorkspace" in text, text
            else:
                assert ":ec2:" in text and '"Ref": "AWS::AccountId"' in text and '"Ref": "AWS::Region"' in text, text


def test_cluster_groups_types_counts_and_slurm(default):
    groups = default.groups()
    assert list(groups) == ["controller", "login", "gpu", "trn"]
    expect = {"controller": ("ml.m5.2xlarge", 1, {"NodeType": "Controller"}),
              "login": ("ml.m5.4xlarge", 1, {"NodeType": "Login"}),
              "gpu": ("ml.p5.48xlarge", 1, {"NodeType": "Compute", "PartitionNames": ["gpu"]}),
              "trn": ("ml.trn1.32xlarge", 1, {"NodeType": "Compute", "PartitionNames": ["trn"]})}
    for name, (itype, count, slurm) in expect.items():
        g = groups[name]
        assert (g["InstanceType"], g["InstanceCount"], g["SlurmConfig"]) == (itype, count, slurm)
    cluster = default.cluster()
    assert cluster["Orchestrator"] == {"Slurm": {"SlurmConfigStrategy": "Managed"}}  # no accounting by default
    assert cluster["NodeProvisioningMode"] == "Continuous"
    assert cluster["NodeRecovery"] == "Automatic"
    assert cluster["ClusterName"] == "sana-hyperpod"
    assert len(cluster["VpcConfig"]["Subnets"]) == 1


def platform_key_import(synth) -> dict:
    """The cluster stack's reference to the storage stack's KMS key ARN."""
    (key_id,) = synth.resources("Storage", "AWS::KMS::Key")
    (export,) = [name for name, out in synth.templates["Storage"]["Outputs"].items()
                 if out["Value"] == {"Fn::GetAtt": [key_id, "Arn"]}]
    return {"Fn::ImportValue": synth.templates["Storage"]["Outputs"][export]["Export"]["Name"]}


def test_every_group_mounts_fsx_and_encrypts_root_and_secondary_ebs_with_the_platform_key(default):
    key = platform_key_import(default)
    for g in default.groups().values():
        root, ebs, lustre = g["InstanceStorageConfigs"]
        # smcluster-cmk: the root entry has RootVolume + key and no size; the secondary has both.
        assert root == {"EbsVolumeConfig": {"RootVolume": True, "VolumeKmsKeyId": key}}
        assert ebs == {"EbsVolumeConfig": {"VolumeSizeInGB": 500, "VolumeKmsKeyId": key}}
        assert lustre["FsxLustreConfig"]["MountPath"] == "/fsx"
        assert "DNSName" in json.dumps(lustre["FsxLustreConfig"]["DnsName"])
        assert "LustreMountName" in json.dumps(lustre["FsxLustreConfig"]["MountName"])


def test_accelerator_groups_have_deep_health_checks_and_one_thread_per_core(default):
    groups = default.groups()
    for name in ("gpu", "trn"):
        assert groups[name]["OnStartDeepHealthChecks"] == ["InstanceStress", "InstanceConnectivity"]
        assert groups[name]["ThreadsPerCore"] == 1
    for name in ("controller", "login"):
        assert "OnStartDeepHealthChecks" not in groups[name] and "ThreadsPerCore" not in groups[name]


def deployed_hash(synth) -> str:
    """The content hash the template uses (checked against the tree when it was stable during synth)."""
    prefixes = {d["Properties"]["DestinationBucketKeyPrefix"].split("/")[1]
                for d in synth.resources("Cluster", "Custom::CDKBucketDeployment").values()}
    (h,) = prefixes
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    if synth.package_hash:
        assert h == synth.package_hash
    return h


def test_lifecycle_uri_has_the_content_hash_prefix(default):
    expected_hash = deployed_hash(default)
    for g in default.groups().values():
        lc = g["LifeCycleConfig"]
        # Extended mode: OnInitComplete, never OnCreate (Customer Managed mode: no Slurm).
        assert set(lc) == {"SourceS3Uri", "OnInitComplete"}
        assert lc["OnInitComplete"] == "on_init_complete.sh"
        parts = lc["SourceS3Uri"]["Fn::Join"][1]
        assert parts[0] == "s3://sagemaker-sana-lc-" and parts[-1] == f"/lifecycle/{expected_hash}/"


def test_cluster_waits_for_both_uploads(default):
    (cluster,) = default.resources("Cluster", "AWS::SageMaker::Cluster").values()
    deployments = default.resources("Cluster", "Custom::CDKBucketDeployment")
    assert set(deployments) <= set(cluster["DependsOn"])
    prefixes = sorted(d["Properties"]["DestinationBucketKeyPrefix"] for d in deployments.values())
    h = deployed_hash(default)
    assert prefixes == [f"lifecycle/{h}/", f"lifecycle/{h}/training/"]
    assert all(d["Properties"]["Prune"] is False for d in deployments.values())


def _render(value, refs):
    """Resolve a Ref / Fn::Join the way CloudFormation would, with fake pseudo-parameter values."""
    if isinstance(value, str):
        return value
    if "Ref" in value:
        return refs[value["Ref"]]
    if "Fn::ImportValue" in value:  # another stack's output, as CloudFormation hands it over
        return refs[value["Fn::ImportValue"]]
    sep, parts = value["Fn::Join"]
    return sep.join(_render(p, refs) for p in parts)


def deployed_settings(synth, refs: dict[str, str]) -> dict:
    """platform-settings.json as the deployment handler writes it to S3 (markers replaced)."""
    (settings_file,) = synth.outdir.glob("asset.*/platform-settings.json")
    (scripts,) = [d for d in synth.resources("Cluster", "Custom::CDKBucketDeployment").values()
                  if "SourceMarkers" in d["Properties"]]
    # Deploy-time values (bucket names, region) are markers the deployment handler replaces.
    text = settings_file.read_text()
    refs = {"AWS::URLSuffix": "amazonaws.com", **refs}
    # The observability stack's workspace endpoint (its PrometheusEndpoint ends with a slash).
    (export,) = [out["Export"]["Name"] for out in synth.templates["Observability"]["Outputs"].values()
                 if "Export" in out and "PrometheusEndpoint" in json.dumps(out["Value"])]
    refs[export] = f"https://aps-workspaces.{refs['AWS::Region']}.amazonaws.com/workspaces/ws-0123/"
    for markers in scripts["Properties"]["SourceMarkers"]:
        for marker, value in markers.items():
            text = text.replace(marker, _render(value, refs))
    return json.loads(text)


def test_platform_settings_json_follows_the_contract(default):
    settings = deployed_settings(default, {"AWS::AccountId": "123456789012", "AWS::Region": "us-east-1"})
    h = deployed_hash(default)
    assert settings == {
        "project": "sana", "cluster_name": "sana-hyperpod", "region": "us-east-1", "fsx_mount": "/fsx",
        "groups": {"controller": "controller", "login": "login", "gpu": "gpu", "trn": "trn"},
        "data_bucket": "sana-data-123456789012-us-east-1",
        "artefacts_bucket": "sana-artefacts-123456789012-us-east-1",
        "lifecycle_bucket": "sagemaker-sana-lc-123456789012-us-east-1",
        "package_hash": h,
        "neuron_pip_index": "https://pip.repos.neuron.amazonaws.com",
        "rendezvous_port": 29500,
        "envs": {"gpu": "/fsx/envs/gpu", "neuron": "/fsx/envs/neuron"},
        "cluster_group": {"name": "sana", "gid": 2000},
        "cluster_users": [{"name": "researcher", "uid": 2001}],
        "cluster_admins": [],
        "admin_group": {"name": "sana-admin", "gid": 2999},
        "home_root": "/fsx/home",
        "slurm_accounting": False,
        "container_runtime": True,
        "private_network": False,
        "image_registry": "123456789012.dkr.ecr.us-east-1.amazonaws.com",
        "wheelhouses": {},
        "observability": {"enabled": True},
        "remote_write_url": "https://aps-workspaces.us-east-1.amazonaws.com/workspaces/ws-0123/api/v1/remote_write",
    }


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-1"])
def test_the_node_recomputes_the_prefix_hash_from_what_s3_holds(default, tmp_path, region):
    """What rollout.sh checks on a fetched prefix: the uploaded scripts, training/ and the
    settings file as S3 holds it (deploy-time values resolved, in any account and region)
    hash, by the node's own package_hash.py, to the name of the prefix."""
    from stacks.cluster import LIFECYCLE_DIR, TRAINING_DIR

    lifecycle, training = tmp_path / "lifecycle", tmp_path / "training"
    shutil.copytree(LIFECYCLE_DIR, lifecycle)
    shutil.copytree(TRAINING_DIR, training)
    settings = deployed_settings(default, {"AWS::AccountId": "210987654321", "AWS::Region": region})
    (lifecycle / "platform-settings.json").write_text(json.dumps(settings))
    node_hash = subprocess.run([sys.executable, "-I", str(lifecycle / "package_hash.py"), str(lifecycle),
                                str(training)], capture_output=True, text=True, check=True).stdout.strip()
    assert node_hash == settings["package_hash"] == deployed_hash(default)


def test_execution_role_tags_node_interfaces_as_the_reference_policy_does(default):
    """awslabs/awsome-distributed-ai 1.AmazonSageMakerClustersExecutionRolePolicy.json grants
    ec2:CreateTags on network interfaces with no condition; a CreateAction condition would
    refuse a tag HyperPod puts on an interface after creating it."""
    statements = {st["Sid"]: st for st in platform_policy(default)["Properties"]["PolicyDocument"]["Statement"]}
    tagging = [st for st in statements.values() if "ec2:CreateTags" in
               (st["Action"] if isinstance(st["Action"], list) else [st["Action"]])]
    assert len(tagging) == 1
    (st,) = tagging
    assert "Condition" not in st, st
    assert json.dumps(st["Resource"]).endswith(':network-interface/*"]]}')


def test_execution_role_may_create_grants_on_the_platform_key_for_node_volumes(default):
    policy = platform_policy(default)
    statements = {st["Sid"]: st for st in policy["Properties"]["PolicyDocument"]["Statement"]}
    grant = statements["GrantPlatformKeyToNodeVolumes"]
    assert grant["Action"] == "kms:CreateGrant"
    assert grant["Resource"] == platform_key_import(default)
    assert grant["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}
    assert grant["Condition"]["StringEquals"] == {"kms:ViaService": {"Fn::Join": [
        "", ["sagemaker.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}}
    assert "kms:DescribeKey" in statements["UsePlatformKey"]["Action"]
    assert "ReadAccountingDatabaseSecret" not in statements


def test_key_policy_lets_the_execution_role_create_grants_via_sagemaker(default):
    via_sagemaker = {"Fn::Join": ["", ["sagemaker.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]}
    execution_role = {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":iam::", {"Ref": "AWS::AccountId"},
                                        ":role/sana-hyperpod-nodes-", {"Ref": "AWS::Region"}]]}
    t = default.template("Storage")
    t.has_resource_properties("AWS::KMS::Key", {"KeyPolicy": {"Statement": Match.array_with([
        Match.object_like({"Sid": "NodeVolumeGrants", "Action": "kms:CreateGrant", "Effect": "Allow",
                           "Condition": {"StringEquals": {"kms:CallerAccount": {"Ref": "AWS::AccountId"},
                                                          "kms:ViaService": via_sagemaker},
                                         "Bool": {"kms:GrantIsForAWSResource": "true"},
                                         "ArnEquals": {"aws:PrincipalArn": execution_role}}}),
    ])}})
    # The role named there is the execution role: the cluster stack gives it exactly that name.
    (role,) = [r for k, r in default.resources("Cluster", "AWS::IAM::Role").items() if "ExecutionRole" in k]
    assert role["Properties"]["RoleName"] == {"Fn::Join": ["", ["sana-hyperpod-nodes-", {"Ref": "AWS::Region"}]]}
    # No encryption-context condition on the node-volume grants: HyperPod cannot pass one.
    (key,) = default.resources("Storage", "AWS::KMS::Key").values()
    grants = [st for st in key["Properties"]["KeyPolicy"]["Statement"] if st.get("Sid") == "NodeVolumeGrants"]
    assert "EncryptionContext" not in json.dumps(grants)


def test_no_accounting_resources_by_default(default):
    assert not default.resources("Storage", "AWS::RDS::DBCluster")
    assert not default.resources("Storage", "AWS::SecretsManager::Secret")
    assert len(default.resources("Network", "AWS::EC2::SecurityGroup")) == 1


def test_outputs(default):
    """Every output is one the runbooks use (tests/docs/test_runbooks.py checks the other way)."""
    assert set(default.templates["Cluster"]["Outputs"]) == {
        "ClusterName", "ClusterArn", "DataBucket", "ArtefactsBucket", "LifecycleBucket", "LifecycleUri",
        "FeaturesUri", "CheckpointsUri"}
    assert {"FsxDnsName", "FsxMountName", "FsxFileSystemId", "GpuImageRepositoryUri",
            "NeuronImageRepositoryUri"} <= set(default.templates["Storage"]["Outputs"])


def test_uploaded_files_are_exactly_the_hashed_files(default):
    """The asset's exclusions (CDK globs) and package_hash's must agree, or the hash would lie."""
    from stacks.cluster import LIFECYCLE_DIR, TRAINING_DIR, package_files
    from tests.stacks.conftest import expected_package_hash

    if not default.package_hash or expected_package_hash(default.context) != default.package_hash:
        skip_or_fail("lifecycle_scripts/ or training/ changed since the synth (shared checkout)",
                     required_by="SANA_REQUIRE_ALL")
    assets = [d for d in default.outdir.glob("asset.*") if d.is_dir()]
    listed = {tuple(sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())) for d in assets}
    for root in (LIFECYCLE_DIR, TRAINING_DIR):
        expected = tuple(sorted(p.relative_to(root).as_posix() for p in package_files(root)))
        assert expected in listed, root
