"""Context variants: each synthesizes (nag-clean, else synth raises) and has the asked-for shape.

``gpu_only`` goes through the real CDK CLI with ``-c`` overrides (see conftest.py).
"""

from __future__ import annotations

import json
import re

import pytest
from aws_cdk.assertions import Match

pytestmark = pytest.mark.slow


def test_gpu_only_p4d_without_login_via_cli_overrides(gpu_only):
    groups = gpu_only.groups()
    assert list(groups) == ["controller", "gpu"]
    gpu = groups["gpu"]
    assert (gpu["InstanceType"], gpu["InstanceCount"]) == ("ml.p4d.24xlarge", 4)
    assert gpu["SlurmConfig"] == {"NodeType": "Compute", "PartitionNames": ["gpu"]}
    assert gpu["ThreadsPerCore"] == 1
    assert "OnStartDeepHealthChecks" not in gpu  # -c deepHealthChecks=false


def test_gpu_only_settings_list_only_existing_groups(gpu_only):
    (settings_file,) = gpu_only.outdir.glob("asset.*/platform-settings.json")
    assert '"groups":{"controller":"controller","gpu":"gpu"}' in settings_file.read_text()


def test_trainium_only_trn2_with_login_pinned_to_region(trn_only):
    groups = trn_only.groups()
    assert list(groups) == ["controller", "login", "trn"]
    trn = groups["trn"]
    assert (trn["InstanceType"], trn["InstanceCount"]) == ("ml.trn2.48xlarge", 2)
    assert trn["SlurmConfig"] == {"NodeType": "Compute", "PartitionNames": ["trn"]}
    assert trn["OnStartDeepHealthChecks"] == ["InstanceStress", "InstanceConnectivity"]
    assert groups["login"]["SlurmConfig"] == {"NodeType": "Login"}
    subnets = trn_only.resources("Network", "AWS::EC2::Subnet").values()
    assert {s["Properties"]["AvailabilityZoneId"] for s in subnets} == {"use2-az3"}
    manifest = json.loads((trn_only.outdir / "manifest.json").read_text())
    assert manifest["artifacts"]["sana-cluster"]["environment"] == "aws://unknown-account/us-east-2"


def test_both_groups_with_login_is_the_default(default):
    assert list(default.groups()) == ["controller", "login", "gpu", "trn"]


def test_cli_synth_prints_no_unconfigured_feature_flags_notice(gpu_only):
    # The CLI counts flags of the pinned aws-cdk-lib that cdk.json leaves unset
    # ("77 feature flags are not configured" before cdk.json carried them).
    assert gpu_only.cli_output, "the CLI variant kept no output"
    assert not re.search(r"feature flags? (is|are) not configured", gpu_only.cli_output), gpu_only.cli_output


def test_without_continuous_provisioning_the_mode_is_unset_and_volumes_use_aws_keys(trn_only):
    cluster = trn_only.cluster()
    assert "NodeProvisioningMode" not in cluster
    for g in trn_only.groups().values():
        ebs, lustre = g["InstanceStorageConfigs"]
        # smcluster-cmk: customer managed keys need continuous provisioning.
        assert ebs == {"EbsVolumeConfig": {"VolumeSizeInGB": 500}}
        assert "FsxLustreConfig" in lustre


def test_accounting_database_is_wired_as_the_schema_names_it(accounting):
    cluster = accounting.cluster()
    assert cluster["NodeProvisioningMode"] == "Continuous"
    db = cluster["Orchestrator"]["Slurm"]["AccountingDatabase"]
    assert set(db) == {"Endpoint", "Port", "Name", "SecretArn"}
    assert (db["Port"], db["Name"]) == (3306, "slurm_acct_db_sana")
    storage = accounting.templates["Storage"]
    exports = {out["Export"]["Name"]: out["Value"] for out in storage["Outputs"].values() if "Export" in out}
    (db_id,) = accounting.resources("Storage", "AWS::RDS::DBCluster")
    (secret,) = accounting.resources("Storage", "AWS::SecretsManager::Secret")  # slurmdbd's, not the admin's
    assert exports[db["Endpoint"]["Fn::ImportValue"]] == {"Fn::GetAtt": [db_id, "Endpoint.Address"]}
    assert exports[db["SecretArn"]["Fn::ImportValue"]] == {"Ref": secret}  # Ref = the secret's ARN


def test_accounting_aurora_is_serverless_v2_encrypted_private_and_backed_up(accounting):
    (key_id,) = accounting.resources("Storage", "AWS::KMS::Key")
    key = {"Fn::GetAtt": [key_id, "Arn"]}
    t = accounting.template("Storage")
    t.has_resource_properties("AWS::RDS::DBCluster", {
        "Engine": "aurora-mysql", "StorageEncrypted": True, "KmsKeyId": key, "Port": 3306,
        "ServerlessV2ScalingConfiguration": {"MinCapacity": 0.5, "MaxCapacity": 4},
        "BackupRetentionPeriod": 14, "DeletionProtection": True, "EnableIAMDatabaseAuthentication": True,
        "EnableCloudwatchLogsExports": ["audit", "error", "slowquery"],
    })
    instances = [r["Properties"] for r in accounting.resources("Storage", "AWS::RDS::DBInstance").values()]
    assert len(instances) == 2
    assert all(i["DBInstanceClass"] == "db.serverless" and i["PubliclyAccessible"] is False for i in instances)
    t.has_resource_properties("AWS::SecretsManager::Secret", {
        "KmsKeyId": key, "Name": "sana/slurmdbd",
        "GenerateSecretString": Match.object_like({"SecretStringTemplate": '{"username":"slurm"}',
                                                   "GenerateStringKey": "password"})})
    (db,) = accounting.resources("Storage", "AWS::RDS::DBCluster").values()
    assert db["DeletionPolicy"] == "Snapshot"  # dataRemovalPolicy=retain


def test_accounting_subnets_span_two_azs_and_have_no_route_out(accounting):
    subnets = {k: r["Properties"] for k, r in accounting.resources("Network", "AWS::EC2::Subnet").items()
               if "Accounting" in k}
    assert sorted(s["CidrBlock"] for s in subnets.values()) == ["10.0.128.32/27", "10.0.128.64/27"]
    assert sorted(json.dumps(s["AvailabilityZone"]) for s in subnets.values()) == [
        json.dumps({"Fn::Select": [i, {"Fn::GetAZs": ""}]}) for i in (0, 1)]
    assert all(s["MapPublicIpOnLaunch"] is False for s in subnets.values())
    associations = [r["Properties"] for r in accounting.resources("Network", "AWS::EC2::SubnetRouteTableAssociation").values()
                    if r["Properties"]["SubnetId"]["Ref"] in subnets]
    (table,) = {a["RouteTableId"]["Ref"] for a in associations}
    assert not [r for r in accounting.resources("Network", "AWS::EC2::Route").values()
                if r["Properties"]["RouteTableId"] == {"Ref": table}]
    group = accounting.resources("Storage", "AWS::RDS::DBSubnetGroup")
    (props,) = [g["Properties"] for g in group.values()]
    assert len(props["SubnetIds"]) == 2


def test_accounting_db_is_reachable_only_from_the_controllers_client_group(accounting):
    groups = accounting.resources("Network", "AWS::EC2::SecurityGroup")
    (db_sg,) = [k for k in groups if "AccountingSecurityGroup" in k]
    (client_sg,) = [k for k in groups if "AccountingClientSecurityGroup" in k]
    ingress = [r["Properties"] for r in accounting.resources("Network", "AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"]["GroupId"] == {"Fn::GetAtt": [db_sg, "GroupId"]}]
    (rule,) = ingress
    assert (rule["IpProtocol"], rule["FromPort"], rule["ToPort"]) == ("tcp", 3306, 3306)
    assert rule["SourceSecurityGroupId"] == {"Fn::GetAtt": [client_sg, "GroupId"]}
    assert "CidrIp" not in rule
    assert "SecurityGroupIngress" not in groups[db_sg]["Properties"]  # no inline (CIDR) rules
    # No egress from the database group (CDK's placeholder rule matches no traffic).
    assert [e["CidrIp"] for e in groups[db_sg]["Properties"]["SecurityGroupEgress"]] == ["255.255.255.255/32"]


def test_accounting_secret_is_readable_by_the_execution_role(accounting):
    from test_templates import platform_policy  # the execution role's platform policy (not the ECR login one)

    policy = platform_policy(accounting)
    statements = {st["Sid"]: st for st in policy["Properties"]["PolicyDocument"]["Statement"]}
    read = statements["ReadAccountingDatabaseSecret"]
    assert sorted(read["Action"]) == ["secretsmanager:DescribeSecret", "secretsmanager:GetSecretValue"]
    assert read["Resource"] == accounting.cluster()["Orchestrator"]["Slurm"]["AccountingDatabase"]["SecretArn"]


def test_accounting_variant_settings_carry_users_group_and_accounting(accounting):
    (settings_file,) = accounting.outdir.glob("asset.*/platform-settings.json")
    text = settings_file.read_text()
    assert '"cluster_group":{"name":"lab","gid":3000}' in text
    assert '"cluster_users":[{"name":"ana","uid":2001},{"name":"ben","uid":2002}]' in text
    assert '"home_root":"/fsx/home"' in text and '"slurm_accounting":true' in text


def test_accounting_without_continuous_provisioning_fails_synth_in_one_line():
    from stacks.config import ConfigError
    from stacks.platform import build_app

    with pytest.raises(ConfigError) as err:
        build_app({"slurmAccounting": "true", "continuousProvisioning": "false"})
    assert str(err.value) == (
        "invalid context value slurmAccounting=True: an external accounting database is supported only with "
        "Continuous node provisioning: set continuousProvisioning=true or slurmAccounting=false")


@pytest.mark.parametrize("variant", ["default", "gpu_only", "trn_only", "accounting"])
def test_every_group_shares_role_lifecycle_and_fsx(synthesized, variant):
    synth = synthesized(variant)
    groups = list(synth.groups().values())
    assert len({json.dumps(g["ExecutionRole"]) for g in groups}) == 1
    assert len({json.dumps(g["LifeCycleConfig"]) for g in groups}) == 1
    assert all(g["InstanceStorageConfigs"][-1]["FsxLustreConfig"]["MountPath"] == "/fsx" for g in groups)
