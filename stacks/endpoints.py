"""The AWS APIs a private cluster (``privateNetwork=true``) reaches through VPC endpoints, and why.

Without a NAT or internet gateway a node reaches an AWS API only through a VPC endpoint in its
subnet, so the list below is the whole of "what can leave the subnet". It is written from three
sources, each entry naming its own:

- the code that runs on the nodes: every ``boto3`` client and ``aws <service>`` command under
  training/ and lifecycle_scripts/ (``services_used`` finds them; tests/stacks/test_private_network.py
  fails when one has no endpoint here, so a new client cannot ship without one);
- the agents on every HyperPod node: the HyperPod node agent (the actions of its managed policy,
  AmazonSageMakerClusterInstanceRolePolicy, mirrored in awslabs/awsome-distributed-ai
  1.architectures/5.sagemaker-hyperpod/1.AmazonSageMakerClustersExecutionRolePolicy.json) and the
  SSM agent (Session Manager, which HyperPod's node access uses);
- the configuration: Secrets Manager with ``slurmAccounting`` (the controller reads slurmdbd's
  secret), Amazon Managed Service for Prometheus with ``observability`` (stacks/observability.py),
  SageMaker managed MLflow with ``mlflowTrackingServer``;
- the packages the node envs install that call AWS themselves, not through a client in this code
  (``PACKAGE_USES``: the sagemaker-mlflow plugin signs MLflow's REST calls to the tracking server),
  found in the node requirements files by the same scan.

Endpoint policies. VPC endpoint policies bound what may pass through the endpoint (they grant
nothing; IAM still decides). Where a service accepts them they admit only this account's
identities acting on this account's resources (``aws:PrincipalAccount`` + ``aws:ResourceAccount``)
and AWS service principals, the identity and resource perimeter of AWS's data-perimeter examples
(aws-samples/data-perimeter-policy-examples vpc_endpoint_policies/default_endpoint_policy.json,
with the account in place of the organization), plus the service-owned resources a service is
documented to need (the same repository's ssm_endpoint_policy.json and s3_endpoint_policy.json,
service_owned_resources.md). Services whose endpoints take no policy keep the default one.

This module imports aws_cdk only inside the construct (the list and the scan are plain data, used by
the tests and the audit).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: The code that runs on cluster nodes (jobs, the lifecycle, the node agents' helpers).
NODE_CODE = (REPO / "training", REPO / "lifecycle_scripts")
DATA_PERIMETER = "aws-samples/data-perimeter-policy-examples"
HYPERPOD_POLICY = ("awslabs/awsome-distributed-ai 1.architectures/5.sagemaker-hyperpod/"
                   "1.AmazonSageMakerClustersExecutionRolePolicy.json")
SSM_ENDPOINTS_DOC = ("https://docs.aws.amazon.com/systems-manager/latest/userguide/"
                     "setup-create-vpc.html")

#: Endpoint policy kinds:
#: "perimeter": this account's identities on this account's resources; the data-perimeter
#:   repository's service_specific_guidance/<service>-specific-guidance.md says the VPC-endpoint
#:   resource perimeter needs no further exception for sts, logs, cloudwatch, kms, secretsmanager,
#:   amp, and names the ones for ecr (service-owned repositories: not pulled from here) and ssm
#:   (AWS-owned documents and public parameters, added below).
#: "identity": this account's identities on any resource: sagemaker.api, for which that repository
#:   has no guidance, so a resource condition could refuse a call HyperPod's tooling makes.
#: "none": no policy, the default stays: ec2messages reports VpcEndpointPolicySupported false
#:   (aws/aws-cli awscli/examples/ec2/describe-vpc-endpoint-services.rst), and for ssmmessages none is
#:   documented; their actions take no resource (Service Authorization Reference, "Amazon Message
#:   Gateway Service", "Amazon Message Delivery Service"), so there is no resource to bound, and
#:   the execution role's managed policy limits them.
POLICY_KINDS = ("perimeter", "identity", "none")
#: "resources": this account's identities on the resource ARNs ``Endpoint.resources`` names (the form of
#:   AWS's own example for an endpoint service whose resources are known, e.g. MLflow's).
POLICY_KINDS = (*POLICY_KINDS, "resources")
#: When an endpoint exists: always, or only with a configuration key on.
WHEN = ("always", "slurmAccounting", "observability", "mlflowTrackingServer")
DEFAULT_PREFIX = "com.amazonaws"


@dataclass(kw_only=True, frozen=True)
class Endpoint:
    """One interface endpoint: ``<prefix>.<region>.<service>`` (``com.amazonaws`` for most services)."""

    service: str
    why: str
    """Who calls this API from the cluster subnet."""
    source: str
    """Where that is written: a file of this repository, a public repository path or a URL."""
    uses: tuple[str, ...] = ()
    """The boto3 client / AWS CLI service names (``services_used``) this endpoint serves."""
    policy: str = "perimeter"
    when: str = "always"
    prefix: str = DEFAULT_PREFIX
    """What precedes the region in the service name (``aws.sagemaker`` for SageMaker MLflow)."""
    actions: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    """policy "resources": the actions and resource ARNs (``{partition}``, ``{region}``, ``{account}`` filled at synth)."""
    private_dns: str = ""
    """The host the clients call that the endpoint's private DNS answers for (``{region}`` filled), where
    a test checks a client's URL against it."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9-]+(\.[a-z0-9-]+)?", self.service):
            raise ValueError(f"endpoint service {self.service!r}: expected the part after <prefix>.<region>.")
        if self.prefix not in (DEFAULT_PREFIX, "aws.sagemaker"):
            raise ValueError(f"endpoint {self.service}: prefix {self.prefix!r} not com.amazonaws or aws.sagemaker")
        if (self.policy == "resources") != bool(self.actions and self.resources):
            raise ValueError(f"endpoint {self.service}: policy 'resources' needs actions and resources, and only it")
        if self.policy not in POLICY_KINDS:
            raise ValueError(f"endpoint {self.service}: policy {self.policy!r} not one of {POLICY_KINDS}")
        if self.when not in WHEN:
            raise ValueError(f"endpoint {self.service}: when {self.when!r} not one of {WHEN}")

    @property
    def id(self) -> str:
        """The service name without the region: ``ecr.api``, ``aws.sagemaker.experiments``."""
        return self.service if self.prefix == DEFAULT_PREFIX else f"{self.prefix}.{self.service}"


INTERFACE_ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(service="ecr.api", uses=("ecr",),
             why="import_image.sh resolves a tag to its digest (BatchGetImage) and logs in "
                 "(GetAuthorizationToken) before enroot pulls the image",
             source="lifecycle_scripts/import_image.sh"),
    Endpoint(service="ecr.dkr", uses=("ecr-registry",),
             why="enroot import docker://<account>.dkr.ecr.<region>.amazonaws.com#... pulls the manifest and "
                 "layers through the registry API (layers then come from S3 through the gateway endpoint)",
             source="lifecycle_scripts/import_image.sh; https://docs.aws.amazon.com/AmazonECR/latest/userguide/"
                    "vpc-endpoints.html"),
    Endpoint(service="logs", uses=("logs",),
             why="the HyperPod node agent ships each node's lifecycle and Slurm logs to "
                 "/aws/sagemaker/Clusters/<cluster> (logs:CreateLogStream, PutLogEvents)",
             source=HYPERPOD_POLICY),
    Endpoint(service="monitoring", uses=("cloudwatch",),
             why="the HyperPod node agent puts node metrics (cloudwatch:PutMetricData, namespace "
                 "/aws/sagemaker/Clusters)",
             source=HYPERPOD_POLICY),
    Endpoint(service="ssm", uses=("ssm",), policy="perimeter",
             why="the SSM agent registers the node and fetches its documents (Session Manager access to nodes)",
             source=SSM_ENDPOINTS_DOC),
    Endpoint(service="ssmmessages", uses=("ssmmessages",), policy="none",
             why="Session Manager's data channel (ssmmessages:Create/OpenControlChannel, Create/OpenDataChannel "
                 "in the HyperPod managed policy)",
             source=f"{HYPERPOD_POLICY}; {SSM_ENDPOINTS_DOC}"),
    Endpoint(service="ec2messages", uses=("ec2messages",), policy="none",
             why="the SSM agent's command channel (agents before 3.3.40.0 use only this one)",
             source=SSM_ENDPOINTS_DOC),
    Endpoint(service="sts", uses=("sts",),
             why="regional STS for SDK and CLI calls that resolve the caller's identity, e.g. the "
                 "connectivity check of runbooks/deploy.md (aws sts get-caller-identity on a node)",
             source="https://docs.aws.amazon.com/IAM/latest/UserGuide/id_credentials_sts_vpce.html"),
    Endpoint(service="sagemaker.api", uses=("sagemaker",), policy="identity",
             why="SageMaker API calls from a node: the runbooks' aws sagemaker commands (describe-cluster, "
                 "list-cluster-nodes, batch-replace-cluster-nodes) when run on the login node",
             source="https://docs.aws.amazon.com/sagemaker/latest/dg/interface-vpc-endpoint.html"),
    Endpoint(service="kms", uses=("kms",),
             why="KMS calls from a node: Session Manager sessions encrypted with a KMS key, SecureString "
                 "parameters, client-side encryption with the platform key",
             source=SSM_ENDPOINTS_DOC),
    Endpoint(service="secretsmanager", uses=("secretsmanager",), when="slurmAccounting",
             why="the controller reads slurmdbd's database login from the secret that "
                 "ClusterAccountingDatabase.SecretArn names",
             source="stacks/accounting.py; stacks/cluster.py (ReadAccountingDatabaseSecret)"),
    Endpoint(service="aps-workspaces", uses=("aps-workspaces",), when="observability",
             private_dns="aps-workspaces.{region}.amazonaws.com",
             why="Prometheus remote write (SigV4) from the controller's collector to the Amazon Managed "
                 "Service for Prometheus workspace: its remote-write URL is the workspace's PrometheusEndpoint "
                 "(https://aps-workspaces.<region>.amazonaws.com/workspaces/<id>/) + api/v1/remote_write, the data "
                 "plane host this endpoint's private DNS answers for",
             source="https://docs.aws.amazon.com/prometheus/latest/userguide/AMP-and-interface-VPC.html; "
                    "https://docs.aws.amazon.com/general/latest/gr/prometheus-service.html; "
                    "stacks/observability.py (MetricsWorkspace.remote_write_url); "
                    "awslabs/awsome-distributed-ai 1.architectures/7.sagemaker-hyperpod-eks/terraform-modules/"
                    "hyperpod-eks-tf/modules/observability/vpc_endpoints.tf"),
    # SageMaker managed MLflow: the tracking server's REST API. The service name is
    # aws.sagemaker.<region>.experiments (aws/aws-cdk packages/aws-cdk-lib/aws-ec2/lib/vpc-endpoint.ts,
    # SAGEMAKER_EXPERIMENTS); the plugin calls https://<region>.experiments.sagemaker.aws for a
    # tracking-server ARN (aws/sagemaker-mlflow sagemaker_mlflow/mlflow_sagemaker_helpers.py) and signs
    # as sagemaker-mlflow (auth_provider.py). The policy is AWS's example: sagemaker-mlflow:* on this
    # account's tracking servers (mlflow-private-link-policy.html).
    Endpoint(service="experiments", prefix="aws.sagemaker", uses=("sagemaker-mlflow",), when="mlflowTrackingServer",
             policy="resources", actions=("sagemaker-mlflow:*",),
             resources=("arn:{partition}:sagemaker:{region}:{account}:mlflow-tracking-server/*",),
             private_dns="{region}.experiments.sagemaker.aws",
             why="training jobs' MLflow tracking (tracking.uri = the platform's tracking server ARN): the "
                 "sagemaker-mlflow plugin's REST calls to the tracking server",
             source="https://docs.aws.amazon.com/sagemaker/latest/dg/mlflow-interface-endpoint.html; "
                    "https://docs.aws.amazon.com/sagemaker/latest/dg/mlflow-private-link-policy.html; "
                    "training/observability/tracking.py"),
)

#: Packages the node envs install (training/requirements-*.txt) that call AWS APIs from their own code,
#: which the client scan of this repository cannot see: name -> the services they call.
#: sagemaker-mlflow: its REST store signs every tracking request as ``sagemaker-mlflow`` for a
#: tracking-server ARN (aws/sagemaker-mlflow sagemaker_mlflow/auth_provider.py _get_auth_service_name)
#: and sends it to <region>.experiments.sagemaker.aws (mlflow_sagemaker_helpers.py); its STS and
#: SageMaker API calls (auth.py with an assumed role, presigned_url.py for the UI) are served by the
#: sts and sagemaker.api endpoints.
PACKAGE_USES: Mapping[str, tuple[str, ...]] = {"sagemaker-mlflow": ("sagemaker-mlflow", "sts", "sagemaker")}

#: Served by the S3 *gateway* endpoint (no interface endpoint; the route table carries S3's prefix list).
GATEWAY_USES = ("s3", "s3api")

#: Clients found in the node code that run somewhere else or fail in one line by design, with why.
OFF_CLUSTER_USES: Mapping[str, str] = {
    "pricing": ("training/report/aws_prices.py (`--prices aws`): the Price List API is served from "
                "us-east-1, eu-central-1 and ap-south-1 only, so no endpoint in the cluster's region reaches "
                "it; run the decision report where the internet is reachable (it fails in one line on a "
                "private cluster, and `--prices-cache` reuses the last fetch)"),
}

#: AWS-owned buckets the nodes read through the S3 gateway endpoint (data-perimeter-policy-examples
#: vpc_endpoint_policies/s3_endpoint_policy.json, "AllowRequestsToAWSOwnedResources"): ECR's image
#: layers, the SSM agent's and CloudWatch agent's packages. ``{region}`` is filled at synth.
S3_AWS_OWNED_OBJECTS = (
    "prod-{region}-starport-layer-bucket",
    "aws-ssm-{region}", "amazon-ssm-{region}", "amazon-ssm-packages-{region}", "{region}-birdwatcher-prod",
    "aws-ssm-distributor-file-{region}", "aws-ssm-document-attachments-{region}",
    "patch-baseline-snapshot-{region}", "amazoncloudwatch-agent-{region}", "amazoncloudwatch-agent",
)
#: SSM documents and public parameters are owned by AWS (ssm_endpoint_policy.json,
#: "AllowRequestsByOrgsIdentitiesToAWSResources"); ``{region}``/``{partition}`` filled at synth.
SSM_AWS_OWNED = ("arn:{partition}:ssm:{region}::parameter/aws/*", "arn:{partition}:ssm:{region}::document/*",
                 "arn:{partition}:ssm:*::automation-definition/*")
SSM_AWS_OWNED_ACTIONS = ("ssm:Describe*", "ssm:List*", "ssm:Get*", "ssm:SendCommand", "ssm:CreateAssociation",
                         "ssm:StartSession", "ssm:StartAutomationExecution")


def required_endpoints(config: Any) -> tuple[Endpoint, ...]:
    """The interface endpoints a private cluster with this configuration needs."""
    on = {"always": True, "slurmAccounting": bool(config.slurmAccounting),
          "observability": bool(config.observability), "mlflowTrackingServer": bool(config.mlflowTrackingServer)}
    return tuple(e for e in INTERFACE_ENDPOINTS if on[e.when])


# ---- what the node code calls --------------------------------------------------------------------
_CLIENT = re.compile(r"""\b(?:client|resource)\(\s*["']([a-z0-9-]+)["']""")
_CLI = re.compile(r"""(?<![\w./-])aws\s+([a-z0-9-]+)\s+[a-z]""")
#: enroot import; docker/podman pull, global options between them included (``docker --config D pull``,
#: ``"${docker[@]}" pull``)
_REGISTRY_PULL = re.compile(r"""\benroot\s+import\b|\b(?:docker|podman)\b[^|;&]*\spull\b""")
SCANNED_SUFFIXES = (".py", ".sh", ".sbatch")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*==")


def aws_service_names() -> frozenset[str]:
    """Every service name botocore (and so boto3 and the AWS CLI) knows, plus the CLI's own ``s3``."""
    import botocore.session  # noqa: PLC0415 - only the scan needs it

    return frozenset(botocore.session.get_session().get_available_services()) | {"s3"}


def services_used(roots: Iterable[Path] = NODE_CODE) -> dict[str, list[str]]:
    """AWS services the code under ``roots`` calls -> where (``path:line``).

    ``boto3.client("x")`` / ``session.client("x")`` / ``resource("x")`` in Python (also in
    Python embedded in shell scripts), ``aws x <command>`` in shell, Python and comments alike
    (a runbook hint names a call someone will make), ``ecr-registry`` for an image pull
    (enroot import, docker/podman pull), and the services of a ``PACKAGE_USES`` package pinned in a
    ``requirements*.txt`` (what the node envs install). Words after ``aws`` that are not AWS services
    are ignored.
    """
    known = aws_service_names()
    found: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if (p.suffix in SCANNED_SUFFIXES or _is_requirements(p))
                           and p.is_file()):
            if "__pycache__" in path.parts:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}"
                if _is_requirements(path):
                    pinned = _REQUIREMENT.match(line)
                    for name in PACKAGE_USES.get(_canonical(pinned[1]), ()) if pinned else ():
                        found.setdefault(name, []).append(where)
                    continue
                names = set(_CLIENT.findall(line)) | {n for n in _CLI.findall(line) if n in known}
                if _REGISTRY_PULL.search(line) and not line.lstrip().startswith("#"):
                    names.add("ecr-registry")
                for name in names:
                    found.setdefault(name, []).append(where)
    return found


def _is_requirements(path: Path) -> bool:
    return path.name.startswith("requirements") and path.suffix == ".txt"


def _canonical(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def uncovered(used: Mapping[str, list[str]], endpoints: Iterable[Endpoint]) -> dict[str, list[str]]:
    """The services in ``used`` that neither an endpoint, the S3 gateway nor OFF_CLUSTER_USES covers."""
    covered = {u for e in endpoints for u in e.uses} | set(GATEWAY_USES) | set(OFF_CLUSTER_USES)
    return {name: where for name, where in used.items() if name not in covered}


# ---- endpoint policies ---------------------------------------------------------------------------
def endpoint_policy(endpoint: Endpoint, *, account: str, region: str, partition: str) -> dict | None:
    """The endpoint's policy document (None: the service takes none, the default stays)."""
    if endpoint.policy == "none":
        return None
    identity = {"aws:PrincipalAccount": account}
    if endpoint.policy == "resources":
        return {"Version": "2012-10-17", "Statement": [
            {"Sid": "ThisAccountsIdentitiesToTheseResources", "Effect": "Allow", "Principal": "*",
             "Action": list(endpoint.actions),
             "Resource": [r.format(partition=partition, region=region, account=account) for r in endpoint.resources],
             "Condition": {"StringEquals": identity}}]}
    statements = [
        {"Sid": "ThisAccountsIdentities" + ("ToThisAccountsResources" if endpoint.policy == "perimeter" else ""),
         "Effect": "Allow", "Principal": "*", "Action": "*", "Resource": "*",
         "Condition": {"StringEquals": {**identity, **({"aws:ResourceAccount": account}
                                                       if endpoint.policy == "perimeter" else {})}}},
        {"Sid": "AwsServicePrincipals", "Effect": "Allow", "Principal": "*", "Action": "*", "Resource": "*",
         "Condition": {"Bool": {"aws:PrincipalIsAWSService": "true"}}},
    ]
    if endpoint.service == "ssm":
        statements.append({
            "Sid": "ThisAccountsIdentitiesToAwsOwnedDocumentsAndParameters", "Effect": "Allow", "Principal": "*",
            "Action": list(SSM_AWS_OWNED_ACTIONS),
            "Resource": [r.format(partition=partition, region=region) for r in SSM_AWS_OWNED],
            "Condition": {"StringEquals": identity}})
    return {"Version": "2012-10-17", "Statement": statements}


def s3_gateway_policy(*, account: str, region: str, partition: str) -> dict:
    """The S3 gateway endpoint's policy on a private cluster: this account's identities on this
    account's buckets, AWS service principals, and reads of the AWS-owned buckets the nodes need
    (ECR layers are fetched with presigned URLs that ECR's own identity signs, hence no principal
    condition there, as in the data-perimeter example)."""
    owned = [f"arn:{partition}:s3:::{b.format(region=region)}/*" for b in S3_AWS_OWNED_OBJECTS]
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "ThisAccountsIdentitiesToThisAccountsBuckets", "Effect": "Allow", "Principal": "*", "Action": "*",
         "Resource": "*",
         "Condition": {"StringEquals": {"aws:PrincipalAccount": account, "aws:ResourceAccount": account}}},
        {"Sid": "AwsServicePrincipals", "Effect": "Allow", "Principal": "*", "Action": "*", "Resource": "*",
         "Condition": {"Bool": {"aws:PrincipalIsAWSService": "true"}}},
        {"Sid": "AwsOwnedPackagesAndImageLayers", "Effect": "Allow", "Principal": "*",
         "Action": ["s3:GetObject"], "Resource": owned},
    ]}
