"""The synthesized policies against issue 24's statements: the KMS key, the bucket policies, the
execution role's trust and interfaces, the CloudTrail trail, every log group, and the accounting
database. Rendered with fake pseudo parameters so patterns can be matched as AWS would.

Condition keys are checked against the Service Authorization Reference: every key any policy of
any template uses must be one of DOCUMENTED (each with the page that defines it), and an EC2
resource-level key must be listed for the resource type in cfn-lint's copy of that reference
(cfnlint/data/AdditionalSpecs/Policies.json). A mistyped key would otherwise silently deny or allow.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the shared session synths

ACCOUNT, REGION, PARTITION = "123456789012", "us-east-1", "aws"
IAM = "https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_policies_condition-keys.html"
SAR = "https://docs.aws.amazon.com/service-authorization/latest/reference/"
DOCUMENTED = {
    "aws:SecureTransport": IAM, "aws:PrincipalArn": IAM, "aws:SourceArn": IAM, "aws:SourceAccount": IAM,
    "aws:SourceVpce": IAM, "aws:ViaAWSService": IAM,
    "kms:CallerAccount": SAR + "list_awskeymanagementservice.html",
    "kms:ViaService": SAR + "list_awskeymanagementservice.html",
    "kms:GrantIsForAWSResource": SAR + "list_awskeymanagementservice.html",
    "kms:EncryptionContext:aws:s3:arn": SAR + "list_awskeymanagementservice.html (kms:EncryptionContext:${Key})",
    "kms:EncryptionContext:aws:logs:arn": SAR + "list_awskeymanagementservice.html (kms:EncryptionContext:${Key})",
    "kms:EncryptionContext:aws:cloudtrail:arn": SAR + "list_awskeymanagementservice.html (kms:EncryptionContext:${Key})",
    # SNS's encryption context is the topic's ARN (https://docs.aws.amazon.com/sns/latest/dg/sns-key-management.html)
    "kms:EncryptionContext:aws:sns:topicArn": SAR + "list_awskeymanagementservice.html (kms:EncryptionContext:${Key})",
    "s3:x-amz-server-side-encryption": SAR + "list_amazons3.html",
    "s3:x-amz-server-side-encryption-aws-kms-key-id": SAR + "list_amazons3.html",
    "s3:x-amz-server-side-encryption-customer-algorithm": SAR + "list_amazons3.html",
    "s3:x-amz-acl": SAR + "list_amazons3.html",
    "ec2:Subnet": SAR + "list_amazonec2.html (resource type network-interface)",
    "ec2:CreateAction": SAR + "list_amazonec2.html",
}
POLICY_PROPS = {"AWS::IAM::Role": "AssumeRolePolicyDocument", "AWS::IAM::ManagedPolicy": "PolicyDocument",
                "AWS::IAM::Policy": "PolicyDocument", "AWS::KMS::Key": "KeyPolicy",
                "AWS::S3::BucketPolicy": "PolicyDocument", "AWS::ECR::Repository": "RepositoryPolicyText",
                "AWS::SNS::TopicPolicy": "PolicyDocument"}


def render(value, template: dict | None = None):
    """A template value as a string AWS would see (pseudo parameters filled in; a resource
    reference as <Ref:id>, <GetAtt:id.attr>, <Import:name>)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return [render(v, template) for v in value]
    if "Ref" in value:
        return {"AWS::AccountId": ACCOUNT, "AWS::Region": REGION, "AWS::Partition": PARTITION}.get(
            value["Ref"], f"<Ref:{value['Ref']}>")
    if "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return sep.join(render(p, template) for p in parts)
    if "Fn::GetAtt" in value:
        return f"<GetAtt:{'.'.join(value['Fn::GetAtt'])}>"
    if "Fn::ImportValue" in value:
        return f"<Import:{render(value['Fn::ImportValue'])}>"
    return json.dumps(value)


def statements(synth, stack: str, type_: str) -> dict[str, list[dict]]:
    return {k: v["Properties"][POLICY_PROPS[type_]]["Statement"]
            for k, v in synth.resources(stack, type_).items() if POLICY_PROPS[type_] in v["Properties"]}


def key_policy(synth) -> dict[str, dict]:
    (doc,) = statements(synth, "Storage", "AWS::KMS::Key").values()
    return {st.get("Sid", f"#{i}"): st for i, st in enumerate(doc)}


def as_list(x):
    return x if isinstance(x, list) else [x]


# ---- KMS ---------------------------------------------------------------------------
DATA_PLANE = {"kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:GenerateDataKey*", "kms:ReEncrypt*",
              "kms:ReEncryptFrom", "kms:ReEncryptTo", "kms:Encrypt*", "kms:Decrypt*", "kms:CreateGrant", "kms:*"}


@pytest.mark.parametrize("variant", ["default", "accounting"])
def test_no_principal_gets_kms_star_and_every_use_is_named_or_pinned(synthesized, variant):
    synth = synthesized(variant)
    policy = key_policy(synth)
    for sid, st in policy.items():
        actions = set(as_list(st["Action"]))
        assert "kms:*" not in actions and "*" not in actions, sid
        if not actions & DATA_PLANE:
            continue
        cond = json.dumps(st.get("Condition", {}))
        # Who may use the key is named (aws:PrincipalArn), or it is a service bound to what it
        # serves (an encryption context, a grant for an AWS resource, a calling service).
        assert any(k in cond for k in ("aws:PrincipalArn", "kms:EncryptionContext:", "kms:GrantIsForAWSResource",
                                       "kms:ViaService")), (sid, st)
    admin = policy["KeyAdministration"]
    assert not set(admin["Action"]) & DATA_PLANE and "Condition" not in admin
    root = f"arn:{PARTITION}:iam::{ACCOUNT}:root"
    if variant == "accounting":
        assert render(admin["Principal"]["AWS"]) == "arn:aws:iam::123456789012:role/platform-admin"
    else:
        assert render(admin["Principal"]["AWS"]) == root


def test_key_users_are_the_nodes_role_by_its_fixed_name_and_the_named_users(synthesized, accounting, default):
    nodes = f"arn:aws:iam::{ACCOUNT}:role/sana-hyperpod-nodes-{REGION}"
    for synth, extra in ((default, []), (accounting, ["arn:aws:iam::123456789012:role/data-engineer",
                                                       "arn:aws:iam::123456789012:user/ana",
                                                       # the accounting variant also deploys serving=true
                                                       f"arn:aws:iam::{ACCOUNT}:role/sana-serving-model-{REGION}",
                                                       # ... and mlflowTrackingServer=true
                                                       f"arn:aws:iam::{ACCOUNT}:role/sana-mlflow-{REGION}"])):
        users = key_policy(synth)["KeyUsers"]
        assert render(users["Principal"]["AWS"]) == f"arn:aws:iam::{ACCOUNT}:root"
        assert render(users["Condition"]["ArnEquals"]["aws:PrincipalArn"]) == [nodes, *extra]
        # ... and that is the execution role's real name (the cluster stack names it so).
        (role,) = [r for k, r in synth.resources("Cluster", "AWS::IAM::Role").items() if "ExecutionRole" in k]
        assert f"arn:aws:iam::{ACCOUNT}:role/{render(role['Properties']['RoleName'])}" == nodes


def test_fsx_role_is_pinned_to_the_data_buckets_and_this_file_system(default):
    fsx = key_policy(default)["FsxDataRepositories"]
    assert fsx["Principal"] == {"AWS": "*"}
    assert render(fsx["Condition"]["StringEquals"]["kms:ViaService"]) == f"s3.{REGION}.amazonaws.com"
    buckets = render(fsx["Condition"]["StringLike"]["kms:EncryptionContext:aws:s3:arn"])
    assert buckets == [f"arn:aws:s3:::sana-{k}-{ACCOUNT}-{REGION}{s}" for k in ("data", "artefacts") for s in ("", "/*")]
    (fs_id,) = default.resources("Storage", "AWS::FSx::FileSystem")
    for name, docs in statements(default, "Storage", "AWS::S3::BucketPolicy").items():
        pin = [st for st in docs if st.get("Sid") == "OnlyThisFileSystemsDataRepositories"]
        if "Lifecycle" in name:
            assert not pin
            continue
        (st,) = pin
        assert st["Effect"] == "Deny" and st["Principal"] == {"AWS": "*"}
        assert render(st["Condition"]["ArnNotEquals"]["aws:PrincipalArn"]).endswith(
            f"AWSServiceRoleForFSxS3Access_<Ref:{fs_id}>")


# ---- buckets -----------------------------------------------------------------------
def test_platform_buckets_refuse_foreign_keys_sse_c_and_the_nodes_outside_the_endpoint(default):
    (endpoint,) = default.resources("Network", "AWS::EC2::VPCEndpoint")
    (key_id,) = default.resources("Storage", "AWS::KMS::Key")
    for name, docs in statements(default, "Storage", "AWS::S3::BucketPolicy").items():
        by_sid = {st.get("Sid"): st for st in docs}
        assert by_sid["DenyForeignKmsKey"]["Condition"] == {"StringNotEqualsIfExists": {
            "s3:x-amz-server-side-encryption-aws-kms-key-id": {"Fn::GetAtt": [key_id, "Arn"]}}}
        assert by_sid["DenyOtherEncryption"]["Condition"] == {"StringNotEqualsIfExists": {
            "s3:x-amz-server-side-encryption": "aws:kms"}}
        assert by_sid["DenySseC"]["Condition"] == {"Null": {"s3:x-amz-server-side-encryption-customer-algorithm": "false"}}
        for sid in ("DenyForeignKmsKey", "DenyOtherEncryption", "DenySseC"):
            assert (by_sid[sid]["Effect"], by_sid[sid]["Action"]) == ("Deny", "s3:PutObject")
        vpce = by_sid.get("NodesOnlyThroughTheVpcEndpoint")
        if "Lifecycle" in name:  # HyperPod itself reads the lifecycle scripts, from outside the VPC
            assert vpce is None
            continue
        assert vpce["Effect"] == "Deny" and vpce["Action"] == "s3:*"
        assert render(vpce["Condition"]["ArnEquals"]["aws:PrincipalArn"]) == \
            f"arn:aws:iam::{ACCOUNT}:role/sana-hyperpod-nodes-{REGION}"
        assert render(vpce["Condition"]["StringNotEquals"]["aws:SourceVpce"]).startswith("<Import:sana-network:")
        assert endpoint in json.dumps(vpce["Condition"]["StringNotEquals"])
        assert vpce["Condition"]["Bool"] == {"aws:ViaAWSService": "false"}


def test_access_log_bucket_takes_logs_only_from_the_platform_buckets_and_trail(default, trn_only):
    for synth, trail in ((default, True), (trn_only, False)):
        (docs,) = statements(synth, "Network", "AWS::S3::BucketPolicy").values()
        by_sid = {st.get("Sid"): st for st in docs}
        logging = by_sid["S3ServerAccessLogsFromThePlatformBuckets"]
        names = [f"sana-data-{ACCOUNT}-{REGION}", f"sana-artefacts-{ACCOUNT}-{REGION}", f"sagemaker-sana-lc-{ACCOUNT}-{REGION}"]
        assert render(logging["Condition"]["ArnEquals"]["aws:SourceArn"]) == [f"arn:aws:s3:::{n}" for n in names]
        assert render(logging["Condition"]["StringEquals"]["aws:SourceAccount"]) == ACCOUNT
        if not trail:
            assert "CloudTrailWrite" not in by_sid and not synth.resources("Storage", "AWS::CloudTrail::Trail")
            assert "CloudTrailEncryptsLogs" not in key_policy(synth)
            continue
        (t,) = synth.resources("Storage", "AWS::CloudTrail::Trail").values()
        arn = f"arn:aws:cloudtrail:{REGION}:{ACCOUNT}:trail/{t['Properties']['TrailName']}"
        for sid in ("CloudTrailAclCheck", "CloudTrailWrite"):
            assert render(by_sid[sid]["Condition"]["StringEquals"]["aws:SourceArn"]) == arn
        assert by_sid["CloudTrailWrite"]["Condition"]["StringEquals"]["s3:x-amz-acl"] == "bucket-owner-full-control"
        kms = key_policy(synth)
        assert render(kms["CloudTrailEncryptsLogs"]["Condition"]["StringEquals"]["aws:SourceArn"]) == arn


# ---- the execution role ------------------------------------------------------------
def test_trust_policy_binds_the_role_to_this_accounts_clusters(default):
    (role,) = [r for k, r in default.resources("Cluster", "AWS::IAM::Role").items() if "ExecutionRole" in k]
    (st,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert st["Principal"] == {"Service": "sagemaker.amazonaws.com"} and st["Action"] == "sts:AssumeRole"
    assert render(st["Condition"]["StringEqualsIfExists"]["aws:SourceAccount"]) == ACCOUNT
    assert render(st["Condition"]["ArnLikeIfExists"]["aws:SourceArn"]) == f"arn:aws:sagemaker:{REGION}:{ACCOUNT}:cluster/*"


def test_node_interfaces_are_managed_only_in_the_cluster_subnet(default):
    (policy,) = [p for p in default.resources("Cluster", "AWS::IAM::ManagedPolicy").values()
                 if "ManageNodeInterfaces" in json.dumps(p)]
    (st,) = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Sid"] == "ManageNodeInterfaces"]
    assert "ec2:DeleteNetworkInterface" in st["Action"]
    assert render(st["Condition"]["ArnEquals"]["ec2:Subnet"]).startswith(f"arn:aws:ec2:{REGION}:{ACCOUNT}:subnet/<Import:")
    # ec2:Subnet is a condition key of every resource type these actions authorize (the ENI).
    actions = reference()["ec2"]["Actions"]
    for action in st["Action"]:
        assert "network-interface" in actions[action.split(":")[1].lower()]["Resources"], action
    assert "ec2:Subnet" in reference()["ec2"]["Resources"]["network-interface"]["ConditionKeys"]


def reference() -> dict:
    """cfn-lint's copy of the Service Authorization Reference (actions, resource types, their condition keys)."""
    import cfnlint

    return json.loads((Path(cfnlint.__file__).parent / "data/AdditionalSpecs/Policies.json").read_text())


@pytest.mark.parametrize("variant", ["default", "accounting", "trn_only"])
def test_every_condition_key_is_a_documented_one(synthesized, variant):
    synth = synthesized(variant)
    seen = set()
    for stack in ("Network", "Storage", "Cluster", *(["Observability"] if "Observability" in synth.templates else [])):
        for type_ in POLICY_PROPS:
            for docs in statements(synth, stack, type_).values():
                for st in docs:
                    for operator, keys in st.get("Condition", {}).items():
                        for key in keys:
                            seen.add(key)
                            assert key in DOCUMENTED, (stack, type_, operator, key, st)
    assert {"aws:PrincipalArn", "kms:ViaService", "aws:SourceVpce", "ec2:Subnet"} <= seen


# ---- log groups --------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["default", "accounting"])
def test_every_log_group_has_retention_and_a_key_that_admits_it(synthesized, variant):
    synth = synthesized(variant)
    retention = 365 if variant == "accounting" else 731
    patterns = as_list(render(key_policy(synth)["CloudWatchLogsForPlatformLogGroups"]["Condition"]["ArnLike"][
        "kms:EncryptionContext:aws:logs:arn"]))
    groups = {(stack, k): v["Properties"] for stack in ("Network", "Storage", "Cluster")
              for k, v in synth.resources(stack, "AWS::Logs::LogGroup").items()}
    assert groups
    for (stack, name), props in groups.items():
        assert props["RetentionInDays"] == retention, name
        assert "KmsKeyId" in props, name
        if stack == "Network":  # its own key (the platform key is the storage stack's)
            continue
        group_name = render(props["LogGroupName"]).replace("<Ref:", "").replace(">", "")
        if "CustomCDKBucketDeployment" in group_name:  # /aws/lambda/<function name>: <stack name>-<id>-<suffix>
            group_name = "/aws/lambda/sana-cluster-" + group_name.split("/")[-1]
        arn = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{group_name}"
        assert any(fnmatch.fnmatchcase(arn, p) for p in patterns), (arn, patterns)
    # No Lambda function of the platform writes to a log group the template does not hold.
    for stack in ("Network", "Storage", "Cluster"):
        names = {json.dumps(p.get("LogGroupName")) for (s, _), p in groups.items() if s == stack}
        for fn_id, fn in synth.resources(stack, "AWS::Lambda::Function").items():
            own = fn["Properties"].get("LoggingConfig", {}).get("LogGroup")
            implicit = json.dumps({"Fn::Join": ["", ["/aws/lambda/", {"Ref": fn_id}]]})
            assert own is not None or implicit in names, (stack, fn_id)


def test_the_hyperpod_cluster_log_group_gets_retention_and_the_key(default):
    calls = {k: v["Properties"] for k, v in default.resources("Cluster", "Custom::AWS").items()}
    (cluster_id,) = default.resources("Cluster", "AWS::SageMaker::Cluster")
    text = json.dumps(calls)
    assert '\\"action\\":\\"putRetentionPolicy\\"' in text and '\\"action\\":\\"associateKmsKey\\"' in text, text
    assert "/aws/sagemaker/Clusters/sana-hyperpod/" in text and cluster_id in text
    assert '\\"retentionInDays\\":731' in text


# ---- accounting --------------------------------------------------------------------
def test_accounting_admin_is_rds_managed_and_slurmdbd_has_its_own_tls_login(accounting):
    (db,) = accounting.resources("Storage", "AWS::RDS::DBCluster").values()
    props = db["Properties"]
    assert props["ManageMasterUserPassword"] is True and props["MasterUsername"] == "admin"
    assert "MasterUserPassword" not in props
    (params,) = accounting.resources("Storage", "AWS::RDS::DBClusterParameterGroup").values()
    p = params["Properties"]["Parameters"]
    assert (p["require_secure_transport"], p["server_audit_logging"]) == ("ON", "1")
    assert set(p["server_audit_events"].split(",")) == {"CONNECT", "QUERY_DCL", "QUERY_DDL"}
    assert props["EnableCloudwatchLogsExports"] == ["audit", "error", "slowquery"]
    assert props["DBClusterIdentifier"] == "sana-slurm-accounting" and props["EnableHttpEndpoint"] is True
    # The nodes read slurmdbd's secret only, never the admin's.
    (policy,) = [x for x in accounting.resources("Cluster", "AWS::IAM::ManagedPolicy").values()
                 if "ReadAccountingDatabaseSecret" in json.dumps(x)]
    (read,) = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Sid"] == "ReadAccountingDatabaseSecret"]
    assert "MasterUserSecret" not in json.dumps(read)
    secrets = {k: v["Properties"] for k, v in accounting.resources("Storage", "AWS::SecretsManager::Secret").items()}
    (slurmdbd,) = secrets
    assert secrets[slurmdbd]["GenerateSecretString"]["SecretStringTemplate"] == '{"username":"slurm"}'
    assert slurmdbd in json.dumps(read["Resource"]) or "Import" in json.dumps(read["Resource"])
    # The user's rights and TLS, as the deploy-time function applies them.
    from stacks.accounting_user import HANDLER

    namespace: dict = {}
    exec(HANDLER.replace("import hashlib, json, boto3, cfnresponse", "import hashlib, json"), namespace)  # noqa: S102
    sqls = namespace["statements"]({"User": "slurm", "Schema": "slurm_acct_db_sana"}, "pw")
    assert all("REQUIRE SSL" in s for s in sqls[:2]) and "pw" not in " ".join(sqls)
    assert sqls[2] == "GRANT ALL PRIVILEGES ON `slurm_acct_db_sana`.* TO 'slurm'@'%'"
    import hashlib
    assert f"AS '*{hashlib.sha1(hashlib.sha1(b'pw').digest()).hexdigest().upper()}'" in sqls[0]


def test_accounting_database_admits_only_the_controller(accounting):
    ingress = [r["Properties"] for r in accounting.resources("Network", "AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"].get("FromPort") == 3306]
    (rule,) = ingress
    client = rule["SourceSecurityGroupId"]["Fn::GetAtt"][0]
    assert "ClientSecurityGroup" in client
    groups = accounting.groups()
    controller_sgs = json.dumps(groups["controller"]["OverrideVpcConfig"]["SecurityGroupIds"])
    assert "ClientSecurityGroup" in controller_sgs
    for name, g in groups.items():
        if name != "controller":
            assert "OverrideVpcConfig" not in g, name
