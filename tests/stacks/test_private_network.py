"""privateNetwork=true: no way out of the subnet but the endpoints the code needs, each with its policy.

The ``private`` variant (conftest.py: privateNetwork + slurmAccounting, stand-in wheelhouses) is
synthesized once through the real app (cdk-nag runs; tests/stacks/test_compliance.py audits it).
The endpoint list is checked against the code that runs on the nodes: stacks/endpoints.py
``services_used`` scans training/ and lifecycle_scripts/ for every boto3 client and ``aws <service>``
command, and the node requirements for packages that call AWS themselves (the sagemaker-mlflow
plugin), and each must be served by an endpoint of the template (or the S3 gateway, or be one of
the documented off-cluster uses), so a new client without an endpoint fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from stacks.config import ConfigError, PlatformConfig
from stacks.endpoints import (
    INTERFACE_ENDPOINTS,
    OFF_CLUSTER_USES,
    required_endpoints,
    services_used,
    uncovered,
)

pytestmark = pytest.mark.slow
#: The least the issue names for a private HyperPod cluster with accounting (the rest is derived).
FLOOR = {"sts", "ecr.api", "ecr.dkr", "logs", "ssm", "ssmmessages", "ec2messages", "sagemaker.api", "kms",
         "secretsmanager"}


def interface_services(synth) -> dict[str, dict]:
    """Service name without its region (Endpoint.id: ``ecr.api``, ``aws.sagemaker.experiments``) -> the
    endpoint's properties."""
    out = {}
    for props in (r["Properties"] for r in synth.resources("Network", "AWS::EC2::VPCEndpoint").values()):
        parts = props["ServiceName"]["Fn::Join"][1]
        assert parts[0] in ("com.amazonaws.", "aws.sagemaker.") and parts[1] == {"Ref": "AWS::Region"}, parts
        service = parts[2].removeprefix(".")
        out[service if parts[0] == "com.amazonaws." else f"aws.sagemaker.{service}"] = props
    return out


def test_no_nat_no_internet_gateway_no_public_subnet_no_route_out(private):
    types = {r["Type"] for r in private.templates["Network"]["Resources"].values()}
    for absent in ("AWS::EC2::NatGateway", "AWS::EC2::InternetGateway", "AWS::EC2::VPCGatewayAttachment",
                   "AWS::EC2::EIP", "AWS::EC2::Route", "AWS::EC2::EgressOnlyInternetGateway"):
        assert absent not in types, absent
    subnets = {s["Properties"]["Tags"][1]["Value"] for s in private.resources("Network", "AWS::EC2::Subnet").values()}
    assert subnets == {"cluster", "slurm-accounting-0", "slurm-accounting-1"}
    (flow_log,) = private.resources("Network", "AWS::EC2::FlowLog").values()
    assert flow_log["Properties"]["TrafficType"] == "ALL"


def test_the_default_network_keeps_its_nat_and_has_no_interface_endpoints(default):
    types = [r["Type"] for r in default.templates["Network"]["Resources"].values()]
    assert types.count("AWS::EC2::NatGateway") == 1 and types.count("AWS::EC2::InternetGateway") == 1
    assert set(interface_services(default)) == {"s3"}


def test_the_interface_endpoints_are_the_ones_the_code_and_agents_need(private):
    services = interface_services(private)
    gateway = services.pop("s3")
    assert gateway["VpcEndpointType"] == "Gateway"
    config = PlatformConfig.from_context(private.context)
    assert set(services) == {e.id for e in required_endpoints(config)}
    assert set(services) >= FLOOR | {"aps-workspaces", "aws.sagemaker.experiments"}
    # Every AWS service the node code calls is served by one of them (or S3's gateway, or is a
    # documented off-cluster use): a new client without an endpoint fails here.
    used = services_used()
    assert {"s3", "ecr", "ecr-registry"} <= set(used), used
    in_template = [e for e in INTERFACE_ENDPOINTS if e.id in services]
    assert uncovered(used, in_template) == {}
    for name in OFF_CLUSTER_USES:
        assert name in used, f"{name} is listed as an off-cluster use but no node code calls it any more"


def test_a_client_without_an_endpoint_is_found(tmp_path):
    (tmp_path / "job.py").write_text('import boto3\nq = boto3.session.Session().client("athena", region_name=r)\n')
    (tmp_path / "step.sh").write_text('#!/bin/bash\naws dynamodb scan --table-name t\necho "aws keeps going"\n'
                                      'docker --config "$d" pull "$image"\n')
    (tmp_path / "pull.sh").write_text("docker pull public.ecr.aws/x/y:1\n")
    # A package the envs install that calls AWS itself: found in a requirements file, not in code.
    (tmp_path / "requirements-gpu.txt").write_text("# envs\nmlflow-skinny==3.17.2\nSageMaker_MLflow==0.5.0\n")
    used = services_used([tmp_path])
    requirement = [f"{tmp_path}/requirements-gpu.txt:3"]
    assert used == {"athena": [f"{tmp_path}/job.py:2"], "dynamodb": [f"{tmp_path}/step.sh:2"],
                    "ecr-registry": [f"{tmp_path}/pull.sh:1", f"{tmp_path}/step.sh:4"],
                    "sagemaker-mlflow": requirement, "sts": requirement, "sagemaker": requirement}
    assert set(uncovered(used, INTERFACE_ENDPOINTS)) == {"athena", "dynamodb"}


def test_the_mlflow_plugin_of_the_node_envs_needs_the_mlflow_endpoint():
    """The envs pin sagemaker-mlflow (training/requirements-*.txt): without the MLflow endpoint its
    tracking calls have no way out of a private subnet, and the scan says where it comes from."""
    without = [e for e in INTERFACE_ENDPOINTS if e.id != "aws.sagemaker.experiments"]
    repo = Path(__file__).resolve().parents[2]
    pins = [f"training/requirements-{kind}.txt:{number}" for kind in ("gpu", "neuron")
            for number, line in enumerate((repo / f"training/requirements-{kind}.txt").read_text().splitlines(), 1)
            if line.startswith("sagemaker-mlflow==")]
    assert len(pins) == 2
    assert uncovered(services_used(), without) == {"sagemaker-mlflow": pins}


def test_each_endpoint_is_in_the_cluster_subnet_with_private_dns_behind_https_from_the_cluster_only(private):
    resources = private.templates["Network"]["Resources"]
    (subnet,) = [k for k, r in resources.items() if r["Type"] == "AWS::EC2::Subnet"
                 and {"Key": "Name", "Value": "cluster"} in r["Properties"]["Tags"]]
    (endpoint_sg,) = [k for k, r in resources.items() if r["Type"] == "AWS::EC2::SecurityGroup"
                      and r["Properties"]["GroupDescription"].startswith("Interface endpoints")]
    (cluster_sg,) = [k for k, r in resources.items() if r["Type"] == "AWS::EC2::SecurityGroup"
                     and r["Properties"]["GroupDescription"].startswith("HyperPod nodes")]
    for service, props in interface_services(private).items():
        if service == "s3":
            continue
        assert props["VpcEndpointType"] == "Interface" and props["PrivateDnsEnabled"] is True, service
        assert props["SubnetIds"] == [{"Ref": subnet}], service
        assert props["SecurityGroupIds"] == [{"Fn::GetAtt": [endpoint_sg, "GroupId"]}], service
    ingress = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::EC2::SecurityGroupIngress"
               and r["Properties"]["GroupId"] == {"Fn::GetAtt": [endpoint_sg, "GroupId"]}]
    assert [(i["IpProtocol"], i["FromPort"], i["ToPort"], i["SourceSecurityGroupId"]) for i in ingress] == \
        [("tcp", 443, 443, {"Fn::GetAtt": [cluster_sg, "GroupId"]})]
    assert "SecurityGroupIngress" not in resources[endpoint_sg]["Properties"]
    # No egress: CDK's placeholder that matches nothing (allow_all_outbound=False).
    assert resources[endpoint_sg]["Properties"]["SecurityGroupEgress"] == [
        {"CidrIp": "255.255.255.255/32", "Description": "Disallow all traffic", "FromPort": 252,
         "IpProtocol": "icmp", "ToPort": 86}]


def _statements(props: dict) -> dict[str, dict]:
    return {s["Sid"]: s for s in props["PolicyDocument"]["Statement"]}


def test_endpoint_policies_admit_this_accounts_identities_and_resources(private):
    account = {"Ref": "AWS::AccountId"}
    services = interface_services(private)
    for endpoint in required_endpoints(PlatformConfig.from_context(private.context)):
        props = services[endpoint.id]
        if endpoint.policy == "none":  # ssmmessages, ec2messages: the service takes no endpoint policy
            assert "PolicyDocument" not in props, endpoint.service
            continue
        statements = _statements(props)
        if endpoint.policy == "resources":  # SageMaker MLflow: AWS's example, this account's tracking servers
            (only,) = statements.values()
            assert only["Action"] == ["sagemaker-mlflow:*"] and only["Condition"] == {
                "StringEquals": {"aws:PrincipalAccount": account}}, endpoint.id
            assert json.dumps(only["Resource"]).endswith(':mlflow-tracking-server/*"]]}]'), only["Resource"]
            continue
        perimeter = statements.pop("ThisAccountsIdentitiesToThisAccountsResources" if endpoint.policy == "perimeter"
                                   else "ThisAccountsIdentities")
        expected = {"aws:PrincipalAccount": account}
        if endpoint.policy == "perimeter":
            expected["aws:ResourceAccount"] = account
        assert perimeter["Condition"] == {"StringEquals": expected}, endpoint.service
        assert statements.pop("AwsServicePrincipals")["Condition"] == {"Bool": {"aws:PrincipalIsAWSService": "true"}}
        if endpoint.service == "ssm":
            owned = statements.pop("ThisAccountsIdentitiesToAwsOwnedDocumentsAndParameters")
            assert owned["Condition"] == {"StringEquals": {"aws:PrincipalAccount": account}}
            assert "ssm:SendCommand" in owned["Action"] and "ssm:PutParameter" not in owned["Action"]
        assert statements == {}, (endpoint.service, statements)
    assert {e.service for e in INTERFACE_ENDPOINTS if e.policy == "none"} == {"ssmmessages", "ec2messages"}


def test_the_s3_gateway_admits_this_account_and_the_aws_owned_buckets_the_nodes_read(private, default):
    statements = _statements(interface_services(private)["s3"])
    account = {"Ref": "AWS::AccountId"}
    assert statements["ThisAccountsIdentitiesToThisAccountsBuckets"]["Condition"] == {
        "StringEquals": {"aws:PrincipalAccount": account, "aws:ResourceAccount": account}}
    owned = statements["AwsOwnedPackagesAndImageLayers"]
    assert owned["Action"] == ["s3:GetObject"] and "Condition" not in owned  # ECR signs the layer URLs
    rendered = json.dumps(owned["Resource"])
    assert "-starport-layer-bucket/*" in rendered and "amazon-ssm-" in rendered
    assert "PolicyDocument" not in interface_services(default)["s3"]  # the default keeps S3's default


def test_the_cluster_uploads_its_wheelhouses_and_names_them_in_the_settings(private):
    (settings_file,) = private.outdir.glob("asset.*/platform-settings.json")
    settings = json.loads(re.sub(r"<<marker:0x[0-9a-f]+:\d+>>", '"token"', settings_file.read_text()))
    assert settings["private_network"] is True
    assert set(settings["wheelhouses"]) == {"gpu", "neuron"}
    uploads = {r["Properties"]["DestinationBucketKeyPrefix"]: k
               for k, r in private.resources("Cluster", "Custom::CDKBucketDeployment").items()}
    cluster = next(r for r in private.templates["Cluster"]["Resources"].values()
                   if r["Type"] == "AWS::SageMaker::Cluster")
    for kind, entry in settings["wheelhouses"].items():
        assert re.fullmatch(rf"wheelhouse/{kind}-[0-9a-f]{{16}}/", entry["prefix"]) and entry["python"] == "3.11"
        assert uploads[entry["prefix"]] in cluster["DependsOn"]
    policy = next(r for k, r in private.resources("Cluster", "AWS::IAM::ManagedPolicy").items()
                  if "PlatformAccess" in k)
    read = next(s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Sid"] == "ReadLifecycleScripts")
    assert json.dumps(read["Resource"]).count("/wheelhouse/*") == 1


def test_a_missing_wheelhouse_stops_synth_in_one_line(tmp_path):
    from stacks.platform import build_app

    with pytest.raises(ConfigError) as err:
        build_app({"privateNetwork": "true"}, outdir=str(tmp_path / "out"), wheelhouse_root=tmp_path / "none")
    message = str(err.value)
    assert "\n" not in message
    assert re.fullmatch(r"invalid context value privateNetwork=True: the nodes install their envs from a wheelhouse: "
                        r"no wheelhouse of training/requirements-gpu\.txt for CPython 3\.11 at \S+/gpu-[0-9a-f]{16}: "
                        r"run `make wheelhouse` .*", message), message


def test_serving_is_refused_on_a_private_network():
    with pytest.raises(ConfigError, match=r"^invalid context value privateNetwork=True: the serving endpoint installs "
                                          r"code/requirements.txt from PyPI"):
        PlatformConfig.from_context({"privateNetwork": "true", "serving": "true",
                                     "servingModelDataUrl": "s3://sana-artefacts-123456789012-us-east-1/serving/model-0123456789ab.tar.gz"})


def test_secrets_manager_with_accounting_managed_prometheus_with_observability_mlflow_with_its_server():
    def services(**keys) -> set[str]:
        return {e.id for e in required_endpoints(SimpleNamespace(**{
            "slurmAccounting": False, "observability": False, "mlflowTrackingServer": False, **keys}))}
    base = services()
    assert "secretsmanager" not in base and "aps-workspaces" not in base
    assert services(slurmAccounting=True) - base == {"secretsmanager"}
    assert services(observability=True) - base == {"aps-workspaces"}
    assert services(observability=True, mlflowTrackingServer=True) - base == {"aps-workspaces",
                                                                             "aws.sagemaker.experiments"}


def _marker_values(synth, stack: str) -> dict[str, object]:
    """The values CDK put in place of the tokens of a BucketDeployment's JSON source (its SourceMarkers)."""
    out = {}
    for resource in synth.resources(stack, "Custom::CDKBucketDeployment").values():
        for markers in resource["Properties"].get("SourceMarkers", []):
            out.update(markers)
    return out


def test_the_collectors_remote_write_and_the_mlflow_plugin_reach_their_endpoints_private_dns(private):
    """Private DNS makes a client's usual host name answer with the endpoint's addresses in the subnet:
    the collector's remote-write URL is the workspace's PrometheusEndpoint (data plane host
    aps-workspaces.<region>.amazonaws.com, AWS general reference "Amazon Managed Service for Prometheus
    endpoints") + api/v1/remote_write, and the sagemaker-mlflow plugin, the one the envs pin, calls the
    host the MLflow endpoint answers for."""
    from sagemaker_mlflow.mlflow_sagemaker_helpers import get_tracking_server_url

    services = interface_services(private)
    by_id = {e.id: e for e in INTERFACE_ENDPOINTS}
    for service in ("aps-workspaces", "aws.sagemaker.experiments"):
        assert services[service]["PrivateDnsEnabled"] is True, service
    (settings_file,) = private.outdir.glob("asset.*/platform-settings.json")
    marker = re.search(r'"remote_write_url":(<<marker:0x[0-9a-f]+:\d+>>)', settings_file.read_text())[1]
    url = _marker_values(private, "Cluster")[marker]  # the JSON string: quotes around the joined parts
    (opening, imported, suffix) = url["Fn::Join"][1]
    assert (opening, suffix) == ('"', 'api/v1/remote_write"')
    export = imported["Fn::ImportValue"]
    (output,) = [o for o in private.templates["Observability"]["Outputs"].values()
                 if o.get("Export", {}).get("Name") == export]
    workspace, attribute = output["Value"]["Fn::GetAtt"]
    assert attribute == "PrometheusEndpoint"
    assert private.templates["Observability"]["Resources"][workspace]["Type"] == "AWS::APS::Workspace"
    documented = "https://aps-workspaces.eu-west-1.amazonaws.com/workspaces/ws-0123/"  # PrometheusEndpoint's form
    assert documented.split("/")[2] == by_id["aps-workspaces"].private_dns.format(region="eu-west-1")
    plugin = get_tracking_server_url("arn:aws:sagemaker:eu-west-1:123456789012:mlflow-tracking-server/sana-mlflow")
    assert plugin.split("/")[2] == by_id["aws.sagemaker.experiments"].private_dns.format(region="eu-west-1")


def test_every_endpoint_names_who_calls_it_and_a_source_that_exists():
    repo = Path(__file__).resolve().parents[2]
    for endpoint in INTERFACE_ENDPOINTS:
        assert len(endpoint.why) > 40, endpoint.service
        for source in endpoint.source.split("; "):
            path = source.split(" (")[0]
            if not source.startswith(("https://", "awslabs/", "aws-samples/")):
                assert (repo / path).exists(), (endpoint.service, path)
