"""The optional <project>-serving stack: an inf2 endpoint with the volume on the platform KMS key in
the cluster VPC (``trn_only`` variant, region pinned), the GPU alternative without a KmsKeyId and
with encrypted data capture (``accounting`` variant, region-agnostic), least-privilege model role,
auto scaling on invocations per instance, rollback on 5XX, and one-line refusals of bad keys."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from stacks.config import ConfigError, PlatformConfig
from stacks.serving_config import DLC_ACCOUNTS, DLC_IMAGES, NEURON_DLC_SDK

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def one(synth, type_: str) -> dict:
    (res,) = synth.resources("Serving", type_).values()
    return res["Properties"]


def imported(synth, stack: str, value) -> dict:
    """``Fn::ImportValue`` of the export of ``stack`` whose value is ``value``."""
    (name,) = [out["Export"]["Name"] for out in synth.templates[stack]["Outputs"].values()
               if "Export" in out and out["Value"] == value]
    return {"Fn::ImportValue": name}


def platform_key(synth) -> dict:
    (key_id,) = synth.resources("Storage", "AWS::KMS::Key")
    return imported(synth, "Storage", {"Fn::GetAtt": [key_id, "Arn"]})


def cluster_network(synth) -> dict:
    (subnet,) = [k for k in synth.resources("Network", "AWS::EC2::Subnet") if "ClusterSubnet" in k]
    (group,) = [k for k in synth.resources("Network", "AWS::EC2::SecurityGroup") if "ClusterSecurityGroup" in k]
    return {"Subnets": [imported(synth, "Network", {"Ref": subnet})],
            "SecurityGroupIds": [imported(synth, "Network", {"Fn::GetAtt": [group, "GroupId"]})]}


def test_default_platform_has_no_serving_stack(default):
    assert "Serving" not in default.templates
    assert not list(default.outdir.glob("sana-serving*"))


def test_inf2_endpoint_has_the_platform_key_on_its_volume_and_runs_in_the_cluster_vpc(trn_only):
    config = one(trn_only, "AWS::SageMaker::EndpointConfig")
    (variant,) = config["ProductionVariants"]
    assert (variant["InstanceType"], variant["VariantName"], variant["InitialInstanceCount"]) == (
        "ml.inf2.xlarge", "main", 1)
    assert config["KmsKeyId"] == platform_key(trn_only)
    assert variant["VolumeSizeInGB"] == 64 and "DataCaptureConfig" not in config  # capture off by default (PHI)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1800
    model = one(trn_only, "AWS::SageMaker::Model")
    assert model["VpcConfig"] == cluster_network(trn_only)
    container = model["PrimaryContainer"]
    repo, tag = DLC_IMAGES["neuron"]
    assert container["Image"] == f"763104351884.dkr.ecr.us-east-2.amazonaws.com/{repo}:{tag}"
    assert container["ModelDataUrl"] == trn_only.context["servingModelDataUrl"]
    assert container["Environment"]["SAGEMAKER_PROGRAM"] == "inference.py"  # code/inference.py of the archive
    assert container["Environment"]["SAGEMAKER_MODEL_SERVER_WORKERS"] == "1"
    endpoint = one(trn_only, "AWS::SageMaker::Endpoint")
    assert endpoint["EndpointName"] == "sana-serving"
    assert endpoint["EndpointConfigName"] == {"Fn::GetAtt": [next(iter(trn_only.resources(
        "Serving", "AWS::SageMaker::EndpointConfig"))), "EndpointConfigName"]}


def test_endpoint_scales_on_invocations_per_instance_and_rolls_back_on_5xx(trn_only):
    target = one(trn_only, "AWS::ApplicationAutoScaling::ScalableTarget")
    (endpoint_id,) = trn_only.resources("Serving", "AWS::SageMaker::Endpoint")
    assert target["ResourceId"] == {"Fn::Join": ["", ["endpoint/", {"Fn::GetAtt": [endpoint_id, "EndpointName"]},
                                                      "/variant/main"]]}
    assert (target["ServiceNamespace"], target["ScalableDimension"], target["MinCapacity"], target["MaxCapacity"]) == (
        "sagemaker", "sagemaker:variant:DesiredInstanceCount", 1, 2)
    assert "RoleARN" not in target  # the service-linked role
    tracking = one(trn_only, "AWS::ApplicationAutoScaling::ScalingPolicy")["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["PredefinedMetricSpecification"] == {"PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"}
    assert tracking["TargetValue"] == 10
    endpoint = one(trn_only, "AWS::SageMaker::Endpoint")
    (alarm_id,) = trn_only.resources("Serving", "AWS::CloudWatch::Alarm")
    assert endpoint["DeploymentConfig"]["AutoRollbackConfiguration"] == {"Alarms": [{"AlarmName": {"Ref": alarm_id}}]}
    assert endpoint["RetainAllVariantProperties"] is True
    alarm = one(trn_only, "AWS::CloudWatch::Alarm")
    assert (alarm["MetricName"], alarm["Namespace"]) == ("Invocation5XXErrors", "AWS/SageMaker")
    assert {d["Name"]: d["Value"] for d in alarm["Dimensions"]} == {"EndpointName": "sana-serving", "VariantName": "main"}


def test_model_role_reads_only_the_model_object_and_pulls_only_its_image(trn_only):
    (role,) = trn_only.resources("Serving", "AWS::IAM::Role").values()
    assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {
        "Service": "sagemaker.amazonaws.com"}
    policy = one(trn_only, "AWS::IAM::ManagedPolicy")
    statements = {s["Sid"]: s for s in policy["PolicyDocument"]["Statement"]}
    read = json.dumps(statements["ReadModelData"]["Resource"])
    assert read.endswith(':s3:::sana-artefacts-123456789012-us-east-2/serving/model-0123456789ab.tar.gz"]]}')
    assert statements["ReadModelData"]["Action"] == "s3:GetObject"
    pull = json.dumps(statements["PullInferenceImage"]["Resource"])
    assert pull.endswith(':ecr:us-east-2:763104351884:repository/pytorch-inference-neuronx"]]}')
    assert statements["DecryptWithPlatformKey"]["Resource"] == platform_key(trn_only)
    assert "WriteDataCapture" not in statements


def test_gpu_alternative_omits_the_kms_key_and_captures_encrypted(accounting):
    config = one(accounting, "AWS::SageMaker::EndpointConfig")
    (variant,) = config["ProductionVariants"]
    assert variant["InstanceType"] == "ml.g6.xlarge"
    # ml.g6.*: NVMe instance storage -> CreateEndpointConfig refuses a KmsKeyId (and has no EBS size)
    assert "KmsKeyId" not in config and "VolumeSizeInGB" not in variant
    capture = config["DataCaptureConfig"]
    assert capture["EnableCapture"] is True and capture["KmsKeyId"] == platform_key(accounting)
    assert capture["DestinationS3Uri"] == {"Fn::Join": ["", ["s3://sana-artefacts-", {"Ref": "AWS::AccountId"}, "-",
                                                             {"Ref": "AWS::Region"}, "/serving-capture/"]]}
    assert [o["CaptureMode"] for o in capture["CaptureOptions"]] == ["Input", "Output"]
    meta = json.loads((accounting.outdir / "sana-serving.metadata.json").read_text())
    acked = {rule for entries in meta.values() for e in entries if e["type"] == "aws:cdk:acknowledged-rules"
             for rule in e["data"]}
    assert "HIPAA.Security::HIPAA.Security-SageMakerEndpointConfigurationKMSKeyConfigured" in acked
    target = one(accounting, "AWS::ApplicationAutoScaling::ScalableTarget")
    assert target["MaxCapacity"] == 4


def test_region_agnostic_image_comes_from_the_dlc_table_by_region(accounting):
    mapping = accounting.templates["Serving"]["Mappings"]["DlcRegistry"]
    assert {region: row["account"] for region, row in mapping.items()} == DLC_ACCOUNTS
    assert mapping["cn-north-1"]["domain"] == "amazonaws.com.cn" and mapping["us-east-1"]["domain"] == "amazonaws.com"
    image = one(accounting, "AWS::SageMaker::Model")["PrimaryContainer"]["Image"]
    rendered = json.dumps(image)
    assert '"Fn::FindInMap": ["DlcRegistry", {"Ref": "AWS::Region"}, "account"]' in rendered
    assert rendered.endswith('"/pytorch-inference:2.6.0-gpu-py312-cu124-ubuntu22.04-sagemaker"]]}')


def test_neuron_dlc_runs_the_sdk_the_trainium_env_compiles_with():
    # graphs compiled in the trn env (training/requirements-neuron.txt) must load in the DLC's runtime
    release = re.search(r"Neuron SDK release: (\d+\.\d+\.\d+)",
                        (REPO / "training" / "requirements-neuron.txt").read_text()).group(1)
    assert release == NEURON_DLC_SDK and f"-sdk{release}-" in DLC_IMAGES["neuron"][1]


URL = "s3://sana-artefacts-123456789012-us-east-1/serving/model-0123456789ab.tar.gz"


@pytest.mark.parametrize(("context", "line"), [
    ({"serving": "true"}, "invalid context value servingModelDataUrl='': required with serving=true: the "
                          "s3://BUCKET/KEY.tar.gz URL python -m training.serve.package --upload printed"),
    ({"servingModelDataUrl": "https://bucket/model.tar.gz"}, "invalid context value servingModelDataUrl="
                                                             "'https://bucket/model.tar.gz': allowed: the s3://"),
    ({"servingInstanceType": "ml.p5.48xlarge"}, "invalid context value servingInstanceType='ml.p5.48xlarge': allowed: "
                                                "ml.inf2.xlarge, ml.inf2.8xlarge, ml.g6.xlarge, ml.g6.2xlarge"),
    ({"servingImage": "pytorch:latest"}, "invalid context value servingImage='pytorch:latest': allowed: empty (the "
                                         "inference DLC for the instance type) or an ECR image URI"),
    ({"servingMaxInstances": "0"}, "invalid context value servingMaxInstances=0: allowed: an integer from 1 to 20"),
    ({"servingInvocationsPerInstance": "0"}, "invalid context value servingInvocationsPerInstance=0: allowed"),
    ({"serving": "true", "servingModelDataUrl": URL, "region": "me-south-1", "availabilityZoneId": "mes1-az1"},
     "invalid context value servingImage='': region me-south-1 has no neuron inference DLC in the table"),
])
def test_bad_serving_keys_are_refused_in_one_line(context, line):
    with pytest.raises(ConfigError) as err:
        PlatformConfig.from_context(context)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_a_valid_image_override_is_accepted():
    image = "123456789012.dkr.ecr.me-south-1.amazonaws.com/sana-serve@sha256:" + "a" * 64
    cfg = PlatformConfig.from_context({"serving": "true", "servingModelDataUrl": URL, "region": "me-south-1",
                                       "availabilityZoneId": "mes1-az1", "servingImage": image})
    assert cfg.servingImage == image


def test_platform_key_admits_the_serving_role_and_endpoint_volume_grants(trn_only, default):
    def statements(synth) -> dict:
        (key,) = synth.resources("Storage", "AWS::KMS::Key").values()
        return {st["Sid"]: st for st in key["Properties"]["KeyPolicy"]["Statement"]}

    users = json.dumps(statements(trn_only)["KeyUsers"]["Condition"])
    assert ":role/sana-serving-model-" in users
    grants = statements(trn_only)["EndpointVolumeGrants"]
    assert grants["Action"] == ["kms:CreateGrant", "kms:DescribeKey"]
    assert grants["Condition"]["Bool"] == {"kms:GrantIsForAWSResource": "true"}
    assert json.dumps(grants["Condition"]["StringEquals"]["kms:ViaService"]).startswith('{"Fn::Join": ["", ["sagemaker.')
    # ...and the role the serving stack creates has exactly that name
    (role,) = trn_only.resources("Serving", "AWS::IAM::Role").values()
    assert json.dumps(role["Properties"]["RoleName"]) == json.dumps(
        {"Fn::Join": ["", ["sana-serving-model-", {"Ref": "AWS::Region"}]]})
    # without serving, neither is in the key policy
    assert "EndpointVolumeGrants" not in statements(default)
    assert "serving-model" not in json.dumps(statements(default)["KeyUsers"])


def test_endpoint_log_group_exists_first_with_retention_and_the_platform_key(trn_only):
    group = one(trn_only, "AWS::Logs::LogGroup")
    assert group["LogGroupName"] == "/aws/sagemaker/Endpoints/sana-serving"
    assert group["RetentionInDays"] == 731 and group["KmsKeyId"] == platform_key(trn_only)
    (group_id,) = trn_only.resources("Serving", "AWS::Logs::LogGroup")
    (endpoint,) = trn_only.resources("Serving", "AWS::SageMaker::Endpoint").values()
    assert group_id in endpoint["DependsOn"]
    (key,) = trn_only.resources("Storage", "AWS::KMS::Key").values()
    logs = {st["Sid"]: st for st in key["Properties"]["KeyPolicy"]["Statement"]}["CloudWatchLogsForPlatformLogGroups"]
    assert "/aws/sagemaker/Endpoints/sana-serving" in json.dumps(logs["Condition"])
