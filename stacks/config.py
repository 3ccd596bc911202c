"""PlatformConfig: the typed, validated platform configuration read from CDK context.

Every field maps to one flat context key (``cdk.json`` -> ``context``, overridable with
``cdk synth -c key=value``). Values from ``-c`` arrive as strings, so integers and booleans
are parsed here. A bad value raises :class:`ConfigError` whose message is ONE line naming
the context key, the value and what is allowed; ``app.py`` prints exactly that line.

This module deliberately imports nothing from aws_cdk: it is plain data + validation, so
it is fast to test and usable from the audit and docs tooling.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stacks.errors import ConfigError

# Instance types HyperPod offers per role (SageMaker "ml." names). Sources: the HyperPod
# supported-instances list (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-prerequisites.html)
# and cfn-lint's AWS::SageMaker::Cluster instance-type data (cfnlint/data/schemas/extensions/
# aws_sagemaker_cluster/instancetype_enum.json, from the pricing API).
GPU_INSTANCE_TYPES: tuple[str, ...] = (
    "ml.p5.48xlarge", "ml.p5e.48xlarge", "ml.p5en.48xlarge", "ml.p4d.24xlarge", "ml.p4de.24xlarge",
    "ml.p6-b200.48xlarge",
    "ml.g5.xlarge", "ml.g5.2xlarge", "ml.g5.4xlarge", "ml.g5.8xlarge", "ml.g5.12xlarge",
    "ml.g5.16xlarge", "ml.g5.24xlarge", "ml.g5.48xlarge",
    "ml.g6e.12xlarge", "ml.g6e.24xlarge", "ml.g6e.48xlarge",
)
TRAINIUM_INSTANCE_TYPES: tuple[str, ...] = (
    "ml.trn1.32xlarge", "ml.trn1n.32xlarge", "ml.trn2.48xlarge", "ml.trn2.3xlarge",
)
# Head nodes (Slurm controller, login): general-purpose / compute-optimised CPU instances.
CPU_INSTANCE_TYPES: tuple[str, ...] = tuple(
    f"ml.{family}.{size}"
    for family, sizes in (
        ("m5", ("large", "xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge")),
        ("m6i", ("large", "xlarge", "2xlarge", "4xlarge", "8xlarge", "12xlarge", "16xlarge", "24xlarge",
                 "32xlarge")),
        ("c5", ("large", "xlarge", "2xlarge", "4xlarge", "9xlarge", "12xlarge", "18xlarge", "24xlarge")),
        ("t3", ("medium", "large", "xlarge", "2xlarge")),
    )
    for size in sizes
)

# FSx for Lustre PERSISTENT_2 (docs.aws.amazon.com/fsx/latest/LustreGuide/managing-storage-capacity.html):
# 1200 GiB, or any multiple of 2400 GiB; per-unit throughput in MB/s/TiB.
FSX_THROUGHPUTS: tuple[int, ...] = (125, 250, 500, 1000)
NODE_RECOVERY: tuple[str, ...] = ("Automatic", "None")
REMOVAL_POLICIES: tuple[str, ...] = ("retain", "destroy")
# HyperPod ClusterName pattern (AWS::SageMaker::Cluster schema).
CLUSTER_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
# Lower case because it becomes part of S3 bucket names; <= 20 so that
# "sagemaker-<project>-lc-<account>-<region>" stays within S3's 63 characters.
PROJECT_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,18}[a-z0-9]$")
ACCOUNT_RE = re.compile(r"^\d{12}$")
REGION_RE = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]?)?-[a-z]+-\d$")
AZ_ID_RE = re.compile(r"^[a-z]{3,5}\d-az\d{1,2}$")
_DIRECTIONS = {"north": "n", "south": "s", "east": "e", "west": "w", "central": "c",
               "northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw"}
MAX_GROUP_COUNT = 1000

# ---- cluster users (POSIX accounts created on every node by lifecycle_scripts/) --------------
# Names: useradd(8) CAVEATS ("usernames that begin with a lower case letter or an underscore,
# followed by lower case letters, digits, underscores, or dashes ... up to 32 characters"),
# which is also Ubuntu's adduser NAME_REGEX without the trailing '$' (Samba machine accounts).
POSIX_NAME_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# Accounts that already exist on a HyperPod node (Ubuntu base + what the platform/agents add):
# the AMI's default user `ubuntu`, Slurm's and MUNGE's daemon users, and `ssm-user`, which the
# SSM agent creates on the first Session Manager session
# (docs.aws.amazon.com/systems-manager/latest/userguide/session-manager-getting-started-ssm-user-permissions.html).
RESERVED_NAMES = frozenset({"root", "daemon", "bin", "sys", "sync", "nobody", "nogroup", "ubuntu", "admin",
                            "sudo", "docker", "slurm", "munge", "ssm-user", "users", "staff", "adm",
                            # keeps the instance metadata service on the nodes (lifecycle_scripts/imds_block.sh)
                            "cwagent"})
# UIDs/GIDs a cluster account may take. Debian Policy 9.2.2 (shared by Ubuntu, the HyperPod
# AMI's base): 0-99 static system, 100-999 dynamic system accounts, 1000-59999 normal users,
# 60000-64999 globally allocated by Debian, 65534 `nobody`/`nogroup`, 65535 invalid (the
# 16-bit -1). 1000-1999 are left to the node's own accounts: 1000 is the AMI's `ubuntu` user,
# and the SSM agent creates `ssm-user` when it starts (aws/amazon-ssm-agent release 2.3.68.0:
# "SSM Agent will create a local user 'ssm-user' ... every time the agent starts"), with
# useradd's default, the next free UID (1001 after ubuntu). AWS's add-users extension says the
# same (awslabs/awsome-distributed-ai, 1.architectures/5.sagemaker-hyperpod/Extensions/
# add-users/README.md, "Choosing UIDs": "Use UIDs >= 2000 to avoid conflicts with system
# users"). The floor applies to the group too: useradd gives ssm-user a private group with
# the same number.
POSIX_ID_MIN, POSIX_ID_MAX = 2000, 59999
POSIX_ID_ALLOWED = (f"allowed: {POSIX_ID_MIN}-{POSIX_ID_MAX} (below 2000: system accounts, the AMI's ubuntu "
                    "user and ssm-user, which the SSM agent creates with the next free id; 60000-65535 are "
                    "reserved by Debian/Ubuntu, 65534 is nobody)")
HOME_ROOT = "/fsx/home"
# CloudWatch Logs PutRetentionPolicy retentionInDays values (CloudWatch Logs API Reference).
LOG_RETENTION_DAYS: tuple[int, ...] = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827,
                                       2192, 2557, 2922, 3288, 3653)
EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
# A named IAM principal for the key policy (a key policy names principals that exist: roles, users).
IAM_PRINCIPAL_ARN_RE = re.compile(r"^arn:aws(-[a-z]+)*:iam::\d{12}:(role|user)/[\w+=,.@/-]{1,512}$")


@dataclass(frozen=True)
class PosixAccount:
    """A POSIX user or group with a fixed numeric ID, the same on every node (``name:id``)."""

    name: str
    id: int

    def __str__(self) -> str:
        return f"{self.name}:{self.id}"


def parse_account(key: str, raw: Any, kind: str) -> PosixAccount:
    """``"name:id"`` -> PosixAccount; a bad spec raises a one-line ConfigError naming ``key``."""
    text = raw.strip() if isinstance(raw, str) else raw
    if not isinstance(text, str) or text.count(":") != 1:
        raise ConfigError(key, raw, f"allowed: {kind} specs written name:id, e.g. researcher:2001")
    name, _, number = (part.strip() for part in text.partition(":"))
    if not POSIX_NAME_RE.match(name):
        raise ConfigError(key, raw, f"bad {kind} name {name!r}; allowed: 1-32 characters, a lower-case letter "
                                    "or '_' first, then lower-case letters, digits, '_' or '-'")
    if name in RESERVED_NAMES:
        raise ConfigError(key, raw, f"{kind} name {name!r} already exists on HyperPod nodes; reserved: "
                                    + ", ".join(sorted(RESERVED_NAMES)))
    if not re.fullmatch(r"\d+", number):
        raise ConfigError(key, raw, f"{kind} id {number!r} is not a number; " + POSIX_ID_ALLOWED)
    if not POSIX_ID_MIN <= int(number) <= POSIX_ID_MAX:
        raise ConfigError(key, raw, f"{kind} id {int(number)} is reserved; " + POSIX_ID_ALLOWED)
    return PosixAccount(name, int(number))


def parse_users(raw: Any) -> tuple[PosixAccount, ...]:
    """clusterUsers: a JSON list of ``name:uid`` (cdk.json) or one comma-separated string (``-c``)."""
    if isinstance(raw, str):
        items: list[Any] = [part for part in raw.split(",") if part.strip()]
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        raise ConfigError("clusterUsers", raw, "allowed: a list of name:uid strings, or one comma-separated string")
    if not items:
        raise ConfigError("clusterUsers", raw, "allowed: at least one name:uid (jobs must not run as root)")
    users = tuple(parse_account("clusterUsers", str(item) if isinstance(item, PosixAccount) else item, "user")
                  for item in items)
    seen_names: set[str] = set()
    seen_ids: set[int] = set()
    for user in users:
        if user.name in seen_names:
            raise ConfigError("clusterUsers", raw, f"duplicate user name {user.name!r}; allowed: each name once")
        if user.id in seen_ids:
            raise ConfigError("clusterUsers", raw, f"duplicate uid {user.id}; allowed: each uid once")
        seen_names.add(user.name)
        seen_ids.add(user.id)
    return users


def az_id_prefix(region: str) -> str | None:
    """The AZ-ID prefix of a region ("us-east-1" -> "use1", "ap-northeast-1" -> "apne1").

    AZ IDs (unlike AZ names) are the same in every account, which is why capacity
    reservations and HyperPod's instance availability are stated in AZ IDs.
    """
    parts = region.split("-")
    if len(parts) != 3 or parts[1] not in _DIRECTIONS:
        return None
    return f"{parts[0]}{_DIRECTIONS[parts[1]]}{parts[2]}"


def _one_of(key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, value, "allowed: " + ", ".join(str(a) for a in allowed))


def _count(key: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ConfigError(key, value, f"allowed: an integer from {low} to {high}")


@dataclass(kw_only=True, frozen=True)
class PlatformConfig:
    """The whole platform's settings; one field per context key (see runbooks/configure.md)."""

    projectName: str = "sana"
    """Prefix of stack and bucket names and the value of the `project` tag."""
    clusterName: str = "sana-hyperpod"
    """HyperPod cluster name; changing it replaces the cluster."""
    account: str = ""
    """12-digit AWS account to pin the stacks to; empty = environment-agnostic."""
    region: str = ""
    """AWS region to pin the stacks to; empty = environment-agnostic (the CLI's region)."""
    availabilityZoneId: str = "use1-az4"
    """AZ ID (e.g. use1-az4) of the one subnet all nodes and FSx live in (EFA needs one AZ)."""
    vpcCidr: str = "10.0.0.0/16"
    """IPv4 CIDR of the VPC, /16 to /22; half goes to the cluster subnet."""
    fsxStorageGiB: int = 1200
    """FSx for Lustre PERSISTENT_2 capacity: 1200 or a multiple of 2400 GiB."""
    fsxThroughputPerTiB: int = 250
    """FSx per-unit storage throughput, MB/s per TiB."""
    controllerInstanceType: str = "ml.m5.2xlarge"
    controllerInstanceCount: int = 1
    """Exactly one Slurm controller (slurmctld) per cluster."""
    loginInstanceType: str = "ml.m5.4xlarge"
    loginInstanceCount: int = 1
    """0 = no login group (users then reach the controller with SSM)."""
    gpuInstanceType: str = "ml.p5.48xlarge"
    gpuInstanceCount: int = 1
    """0 = no GPU group."""
    trnInstanceType: str = "ml.trn1.32xlarge"
    trnInstanceCount: int = 1
    """0 = no Trainium group."""
    controllerEbsGiB: int = 500
    loginEbsGiB: int = 500
    gpuEbsGiB: int = 500
    trnEbsGiB: int = 500
    """Secondary EBS volume per node in each group (mounted by HyperPod at /opt/sagemaker)."""
    deepHealthChecks: bool = True
    """Run InstanceStress + InstanceConnectivity deep health checks when accelerator nodes start."""
    nodeRecovery: str = "Automatic"
    """Automatic = HyperPod replaces or reboots faulty nodes; None = only labels them."""
    dataRemovalPolicy: str = "retain"
    """retain = buckets, key and FSx survive `cdk destroy`; destroy = deleted with the stacks."""
    deploymentGeneration: int = 1
    """In the names of what `cdk destroy --all` keeps; raise it to deploy again beside the kept resources."""
    clusterUsers: tuple[PosixAccount, ...] = (PosixAccount("researcher", 2001),)
    """POSIX users (name:uid) created on every node, homes under /fsx/home; members of clusterGroup."""
    clusterGroup: PosixAccount = PosixAccount("sana", 2000)
    """Shared group (name:gid): every user's primary group; it owns and may write /fsx/data and /fsx/artefacts."""
    clusterAdmins: tuple[str, ...] = ()
    """clusterUsers names who may run commands as root with sudo on every node (members of clusterAdminGroup)."""
    clusterAdminGroup: PosixAccount = PosixAccount("sana-admin", 2999)
    """Admin group (name:gid): /etc/sudoers.d/sana-platform-admins lets its members (clusterAdmins) sudo."""
    continuousProvisioning: bool = True
    """NodeProvisioningMode Continuous: partial capacity, async retries; chosen at cluster creation."""
    slurmAccounting: bool = False
    """Slurm accounting on an Aurora MySQL Serverless v2 database (needs continuousProvisioning)."""
    cloudTrail: bool = True
    """A CloudTrail trail with S3 data events on the platform buckets and log-file validation."""
    keyAdministrators: tuple[str, ...] = ()
    """IAM role/user ARNs that administer the platform KMS key; empty: the account (management actions only)."""
    keyUsers: tuple[str, ...] = ()
    """IAM role/user ARNs besides the cluster nodes that may encrypt and decrypt with the platform key."""
    logRetentionDays: int = 731
    """Retention of every log group the platform creates or adopts (a CloudWatch Logs retention value)."""
    # ---- the optional <project>-serving stack (stacks/serving.py, runbooks/serving.md) ----
    serving: bool = False
    """Deploy the SageMaker endpoint stack for a packaged model (needs servingModelDataUrl)."""
    servingInstanceType: str = "ml.inf2.xlarge"
    """Endpoint instance type: Inferentia2 (compiled graphs) or ml.g6.* (the GPU alternative)."""
    servingModelDataUrl: str = ""
    """s3://.../model-<sha>.tar.gz from python -m training.serve.package --upload."""
    servingImage: str = ""
    """Container image; empty = the PyTorch (Neuron) inference DLC for the instance type and region."""
    servingMaxInstances: int = 2
    """Upper bound of Application Auto Scaling (the endpoint starts with one instance)."""
    servingInvocationsPerInstance: int = 10
    """Auto-scaling target: invocations per instance per minute (SageMakerVariantInvocationsPerInstance)."""
    servingDataCapture: bool = False
    """Capture requests and responses to the artefacts bucket (KMS-encrypted). Off: prompts may hold PHI."""
    containerRuntime: bool = True
    """enroot + pyxis on gpu, trn and login nodes (installed at boot where the AMI lacks them); false = none."""
    privateNetwork: bool = False
    """No internet egress: no NAT/internet gateway, interface endpoints for the AWS APIs, envs from the wheelhouse."""
    # ---- the <project>-observability stack (stacks/observability.py, runbooks/observability.md) ----
    observability: bool = True
    """Amazon Managed Prometheus workspace, alert rules, SNS alerts, node exporters and the collector."""
    stallMinutes: int = 30
    """Minutes without a new training step before the TrainingJobStalled alert fires."""
    alertEmail: str = ""
    """An email address subscribed to the alerts topic; empty = subscribe later (runbooks/observability.md)."""
    grafana: bool = False
    """An Amazon Managed Grafana workspace reading the Prometheus workspace (needs IAM Identity Center)."""
    mlflowTrackingServer: bool = False
    """A SageMaker managed MLflow tracking server, artifacts in the artefacts bucket under mlflow/."""

    def __post_init__(self) -> None:
        if not PROJECT_NAME_RE.match(self.projectName):
            raise ConfigError("projectName", self.projectName,
                              "allowed: 2-20 characters, lower-case letters, digits and '-', "
                              "starting with a letter (it becomes part of S3 bucket names)")
        if not CLUSTER_NAME_RE.match(self.clusterName):
            raise ConfigError("clusterName", self.clusterName,
                              "allowed: 1-63 letters, digits and single or repeated '-' between them "
                              "(HyperPod pattern ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$)")
        if self.account and not ACCOUNT_RE.match(self.account):
            raise ConfigError("account", self.account, "allowed: empty or a 12-digit AWS account ID")
        if self.region and not REGION_RE.match(self.region):
            raise ConfigError("region", self.region, "allowed: empty or an AWS region name such as us-east-1")
        self._check_az()
        self._check_cidr()
        if not (self.fsxStorageGiB == 1200 or (self.fsxStorageGiB > 0 and self.fsxStorageGiB % 2400 == 0)):
            raise ConfigError("fsxStorageGiB", self.fsxStorageGiB,
                              "allowed: 1200 or a multiple of 2400 (FSx for Lustre PERSISTENT_2)")
        _one_of("fsxThroughputPerTiB", self.fsxThroughputPerTiB, FSX_THROUGHPUTS)
        _one_of("controllerInstanceType", self.controllerInstanceType, CPU_INSTANCE_TYPES)
        _one_of("loginInstanceType", self.loginInstanceType, CPU_INSTANCE_TYPES)
        if self.gpuInstanceType in TRAINIUM_INSTANCE_TYPES:
            raise ConfigError("gpuInstanceType", self.gpuInstanceType,
                              "a Trainium type is not allowed in the GPU group (set trnInstanceType instead); "
                              "allowed: " + ", ".join(GPU_INSTANCE_TYPES))
        if self.trnInstanceType in GPU_INSTANCE_TYPES:
            raise ConfigError("trnInstanceType", self.trnInstanceType,
                              "a GPU type is not allowed in the Trainium group (set gpuInstanceType instead); "
                              "allowed: " + ", ".join(TRAINIUM_INSTANCE_TYPES))
        _one_of("gpuInstanceType", self.gpuInstanceType, GPU_INSTANCE_TYPES)
        _one_of("trnInstanceType", self.trnInstanceType, TRAINIUM_INSTANCE_TYPES)
        if self.controllerInstanceCount != 1:
            raise ConfigError("controllerInstanceCount", self.controllerInstanceCount,
                              "allowed: 1 (a Slurm cluster has exactly one controller group of one node)")
        _count("loginInstanceCount", self.loginInstanceCount, 0, 4)
        _count("gpuInstanceCount", self.gpuInstanceCount, 0, MAX_GROUP_COUNT)
        _count("trnInstanceCount", self.trnInstanceCount, 0, MAX_GROUP_COUNT)
        if self.gpuInstanceCount == 0 and self.trnInstanceCount == 0:
            raise ConfigError("gpuInstanceCount", 0,
                              "at least one worker group is needed: set gpuInstanceCount or "
                              "trnInstanceCount to 1 or more")
        for key in ("controllerEbsGiB", "loginEbsGiB", "gpuEbsGiB", "trnEbsGiB"):
            _count(key, getattr(self, key), 1, 16384)
        _one_of("nodeRecovery", self.nodeRecovery, NODE_RECOVERY)
        _one_of("dataRemovalPolicy", self.dataRemovalPolicy, REMOVAL_POLICIES)
        _count("deploymentGeneration", self.deploymentGeneration, 1, 99)
        if len(self.retained_prefix) > 20:
            raise ConfigError("deploymentGeneration", self.deploymentGeneration,
                              f"projectName with its generation is {self.retained_prefix!r}, over 20 characters "
                              "(it becomes part of S3 bucket names); allowed: a shorter projectName")
        self._check_users()
        self._check_admins()
        _one_of("logRetentionDays", self.logRetentionDays, LOG_RETENTION_DAYS)
        for key in ("keyAdministrators", "keyUsers"):
            for arn in getattr(self, key):
                if not IAM_PRINCIPAL_ARN_RE.match(arn):
                    raise ConfigError(key, arn, "allowed: IAM role or user ARNs, e.g. "
                                                "arn:aws:iam::123456789012:role/platform-admin")
        from stacks.serving_config import check_serving

        check_serving(self)
        if self.privateNetwork and self.serving:
            # The endpoint runs in the cluster subnet and the inference toolkit pip-installs the
            # package's code/requirements.txt when it starts (training/serve/package.py).
            raise ConfigError("privateNetwork", True,
                              "the serving endpoint installs code/requirements.txt from PyPI when it starts, "
                              "which a subnet without internet egress cannot reach: set serving=false or "
                              "privateNetwork=false (runbooks/private-network.md)")
        self._check_observability()
        if self.slurmAccounting and not self.continuousProvisioning:
            # AWS::SageMaker::Cluster schema, ClusterAccountingDatabase: "Supported only with
            # Continuous node provisioning."
            raise ConfigError("slurmAccounting", True,
                              "an external accounting database is supported only with Continuous node "
                              "provisioning: set continuousProvisioning=true or slurmAccounting=false")

    def _check_observability(self) -> None:
        _count("stallMinutes", self.stallMinutes, 5, 1440)
        if self.alertEmail and not EMAIL_RE.match(self.alertEmail):
            raise ConfigError("alertEmail", self.alertEmail, "allowed: empty or one email address, e.g. oncall@example.com")
        for key in ("grafana", "mlflowTrackingServer", "alertEmail"):
            if getattr(self, key) and not self.observability:
                raise ConfigError(key, getattr(self, key), "it is part of the observability stack: set "
                                                           "observability=true, or leave it off")

    def _check_users(self) -> None:
        users = parse_users(self.clusterUsers)
        group = self.clusterGroup
        if not isinstance(group, PosixAccount):
            raise ConfigError("clusterGroup", group, "allowed: one name:gid, e.g. sana:2000")
        # The lifecycle step makes the shared group every user's primary group (no per-user
        # groups), but Ubuntu's convention (login.defs USERGROUPS_ENAB) is a private group per
        # user with GID = UID and the user's name, e.g. in containers or on other FSx clients;
        # a shared group on a user's UID or name would then mean two different groups.
        clash = next((u for u in users if u.id == group.id or u.name == group.name), None)
        if clash is not None:
            what = f"gid {group.id} is user {clash.name}'s uid" if clash.id == group.id else \
                f"name {group.name!r} is a user's name"
            raise ConfigError("clusterGroup", str(group),
                              f"{what} (Ubuntu's per-user private groups use the user's uid and name); "
                              "allowed: a gid and name no user in clusterUsers has")

    def _check_admins(self) -> None:
        """clusterAdmins are clusterUsers names; the admin group is a group of its own."""
        users = {u.name: u for u in self.clusterUsers}
        seen: set[str] = set()
        for name in self.clusterAdmins:
            if name not in users:
                raise ConfigError("clusterAdmins", name, "not a clusterUsers name (an admin is a cluster user who "
                                  "may sudo); allowed: " + ", ".join(sorted(users)))
            if name in seen:
                raise ConfigError("clusterAdmins", name, "listed twice; allowed: each name once")
            seen.add(name)
        group = self.clusterAdminGroup
        if not isinstance(group, PosixAccount):
            raise ConfigError("clusterAdminGroup", group, "allowed: one name:gid, e.g. sana-admin:2999")
        cluster = self.clusterGroup
        if group.id == cluster.id or group.name == cluster.name:
            raise ConfigError("clusterAdminGroup", str(group), f"is clusterGroup's {'gid' if group.id == cluster.id else 'name'}; "
                              "allowed: a gid and name of its own (only admins may be members)")
        clash = next((u for u in users.values() if u.id == group.id or u.name == group.name), None)
        if clash is not None:
            raise ConfigError("clusterAdminGroup", str(group), f"user {clash.name} has that "
                              f"{'uid' if clash.id == group.id else 'name'} (Ubuntu's per-user private groups use "
                              "the user's uid and name); allowed: a gid and name no user in clusterUsers has")

    def _check_az(self) -> None:
        if not AZ_ID_RE.match(self.availabilityZoneId):
            raise ConfigError("availabilityZoneId", self.availabilityZoneId,
                              "allowed: an availability zone ID such as use1-az4 (an ID, not a name "
                              "like us-east-1a; see `aws ec2 describe-availability-zones`)")
        prefix = az_id_prefix(self.region) if self.region else None
        if prefix and not self.availabilityZoneId.startswith(prefix + "-"):
            raise ConfigError("availabilityZoneId", self.availabilityZoneId,
                              f"allowed: an AZ ID of region {self.region}, i.e. {prefix}-az<N>")

    def _check_cidr(self) -> None:
        try:
            net = ipaddress.IPv4Network(self.vpcCidr, strict=True)
        except ValueError:
            net = None
        if net is None or not 16 <= net.prefixlen <= 22 or not net.is_private:
            raise ConfigError("vpcCidr", self.vpcCidr,
                              "allowed: a private IPv4 network from /16 to /22, e.g. 10.0.0.0/16")

    # ---- derived values -------------------------------------------------------------
    @property
    def retained_prefix(self) -> str:
        """Prefix of the names of the resources `cdk destroy` keeps (buckets, image repositories,
        the accounting database's logs and secret): projectName, with ``-g<N>`` from generation 2
        on, so a redeploy after a full teardown never collides with what the last one kept."""
        generation = self.deploymentGeneration
        return self.projectName if generation == 1 else f"{self.projectName}-g{generation}"

    @property
    def groups(self) -> dict[str, str]:
        """Instance group name -> role, in creation order; groups with 0 nodes are absent."""
        out = {"controller": "controller"}
        if self.loginInstanceCount:
            out["login"] = "login"
        if self.gpuInstanceCount:
            out["gpu"] = "gpu"
        if self.trnInstanceCount:
            out["trn"] = "trn"
        return out

    @property
    def private_subnet_cidr(self) -> str:
        """First half of the VPC: the cluster + FSx subnet (EFA and HyperPod need many IPs)."""
        return str(next(ipaddress.IPv4Network(self.vpcCidr).subnets(prefixlen_diff=1)))

    @property
    def public_subnet_cidr(self) -> str:
        """A /28 (16 addresses) at the start of the second half: only the NAT gateway lives there."""
        second_half = list(ipaddress.IPv4Network(self.vpcCidr).subnets(prefixlen_diff=1))[1]
        return str(next(second_half.subnets(new_prefix=28)))

    @property
    def accounting_subnet_cidrs(self) -> tuple[str, str]:
        """Two /27s after the NAT subnet's /27 in the second half (used only with slurmAccounting)."""
        second_half = list(ipaddress.IPv4Network(self.vpcCidr).subnets(prefixlen_diff=1))[1]
        blocks = second_half.subnets(new_prefix=27)
        next(blocks)  # holds the NAT /28
        return str(next(blocks)), str(next(blocks))

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_context(cls, get: Callable[[str], Any] | Mapping[str, Any]) -> PlatformConfig:
        """Build from CDK context; ``get`` is ``app.node.try_get_context`` or a dict.

        Missing keys take the defaults above. Strings from ``-c key=value`` are coerced to
        the field's type; anything that does not parse raises a one-line ConfigError.
        """
        lookup = get.get if isinstance(get, Mapping) else get
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = lookup(field.name)
            if raw is None:
                continue
            values[field.name] = _coerce(field.name, raw, field.type)
        return cls(**values)

    def settings(self, *, region: str, data_bucket: str, artefacts_bucket: str, lifecycle_bucket: str,
                 package_hash: str, image_registry: str = "", remote_write_url: str = "",
                 wheelhouses: Mapping[str, Mapping[str, str]] | None = None,
                 offline_agents: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """platform-settings.json, uploaded next to the lifecycle scripts; lifecycle_scripts/settings.sh reads it.

        The node settings plus what the deployment's account and region decide (and the hash):
        exactly lifecycle_scripts/package_hash.py's ENVIRONMENT_KEYS, which the hash leaves out.
        ``image_registry``: this account's ECR registry, the only one a private cluster pulls from;
        ``remote_write_url``: the Prometheus workspace the controller's collector writes to
        (observability); ``wheelhouses``: env kind -> {prefix, lock_sha256, python}
        (stacks/wheelhouse.py) and ``offline_agents`` (``node_settings``), private only, hashed with
        the node settings.
        """
        return {
            "region": region,
            "data_bucket": data_bucket,
            "artefacts_bucket": artefacts_bucket,
            "lifecycle_bucket": lifecycle_bucket,
            "package_hash": package_hash,
            "image_registry": image_registry,
            "remote_write_url": remote_write_url,
            **self.node_settings(wheelhouses, offline_agents),
        }

    def node_settings(self, wheelhouses: Mapping[str, Mapping[str, str]] | None = None,
                      offline_agents: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The settings a node installs that this configuration alone decides (no CDK token):
        hashed into the package prefix, so changing any of them is a new package to roll out.
        ``wheelhouses`` (privateNetwork): named by the content hashes of their locks.
        ``offline_agents`` (privateNetwork with observability): where the observability step finds
        what it would otherwise download, ``{agents: {prefix, lock_sha256}, dcgm_exporter_repository}``
        (stacks/cluster.py offline_agent_settings)."""
        return {
            "project": self.projectName,
            "cluster_name": self.clusterName,
            "fsx_mount": FSX_MOUNT,
            "groups": self.groups,
            "neuron_pip_index": NEURON_PIP_INDEX,
            "rendezvous_port": RENDEZVOUS_PORT,
            "envs": {"gpu": f"{FSX_MOUNT}/envs/gpu", "neuron": f"{FSX_MOUNT}/envs/neuron"},
            "cluster_group": {"name": self.clusterGroup.name, "gid": self.clusterGroup.id},
            "cluster_users": [{"name": u.name, "uid": u.id} for u in self.clusterUsers],
            "cluster_admins": list(self.clusterAdmins),
            "admin_group": {"name": self.clusterAdminGroup.name, "gid": self.clusterAdminGroup.id},
            "home_root": HOME_ROOT,
            "slurm_accounting": self.slurmAccounting,
            "container_runtime": self.containerRuntime,
            "private_network": self.privateNetwork,
            "wheelhouses": {kind: dict(w) for kind, w in (wheelhouses or {}).items()},
            "observability": {"enabled": self.observability, **dict(offline_agents or {})},
        }

    @classmethod
    def context_defaults(cls) -> dict[str, Any]:
        """The defaults as they are written in cdk.json's context (``name:id`` strings for accounts)."""
        return {f.name: context_form(f.default) for f in dataclasses.fields(cls)}


def context_form(value: Any) -> Any:
    """A field value as cdk.json writes it: PosixAccount -> "name:id", tuples -> lists."""
    if isinstance(value, PosixAccount):
        return str(value)
    if isinstance(value, tuple):
        return [context_form(v) for v in value]
    return value


FSX_MOUNT = "/fsx"
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"
RENDEZVOUS_PORT = 29500
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(key: str, raw: Any, typ: Any) -> Any:
    """Coerce one context value (native JSON from cdk.json, or a string from ``-c``)."""
    if typ in ("tuple[PosixAccount, ...]",):
        return parse_users(raw)
    if typ in ("tuple[str, ...]",):
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise ConfigError(key, raw, "allowed: a list of strings, or one comma-separated string")
        return tuple(i.strip() for i in items if i.strip())
    if typ in (PosixAccount, "PosixAccount"):
        return parse_account(key, raw, "group")
    if typ in (bool, "bool"):
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise ConfigError(key, raw, "allowed: true or false")
    if typ in (int, "int"):
        if isinstance(raw, bool):
            raise ConfigError(key, raw, "allowed: an integer")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str) and re.fullmatch(r"\s*[+-]?\d+\s*", raw):
            return int(raw)
        raise ConfigError(key, raw, "allowed: an integer")
    if not isinstance(raw, str):
        raise ConfigError(key, raw, "allowed: a string")
    return raw.strip()


def check_known_keys(context: Mapping[str, Any]) -> None:
    """Reject a mistyped platform key (``-c gpuInstanceCont=2`` must not be silently ignored).

    Only plain camelCase keys are ours; CDK's and tools' keys (``@aws-cdk/...`` feature flags,
    ``aws:cdk:...``, ``cli-telemetry``) contain punctuation and are left alone.
    """
    known = set(PlatformConfig.keys())
    for key, value in context.items():
        if key in known or not re.fullmatch(r"[a-z][a-zA-Z0-9]*", key):
            continue
        raise ConfigError(key, value, "unknown context key; known keys: " + ", ".join(sorted(known)))
