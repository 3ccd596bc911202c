"""What the optional ``<project>-serving`` stack may be configured with, and the facts it relies on.

Plain data + validation like stacks/config.py (no aws_cdk import): the serving context keys'
checks (``check_serving``, called from ``PlatformConfig.__post_init__``), the instance types the
endpoint may use, which of them carry NVMe instance storage, and the ONE table of inference
Deep Learning Container images by region.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stacks.config import PlatformConfig

#: Inferentia2 first (the default), the GPU alternative second; both families' smallest sizes.
SERVING_INSTANCE_TYPES: tuple[str, ...] = ("ml.inf2.xlarge", "ml.inf2.8xlarge", "ml.g6.xlarge", "ml.g6.2xlarge")
#: NVMe instance storage per instance type (GB). CreateEndpointConfig: "Certain Nitro-based
#: instances include local storage ... You can't request a KmsKeyId when using an instance type
#: with local storage ... the call to CreateEndpointConfig fails" (SageMaker API reference,
#: CreateEndpointConfig KmsKeyId). G6: g6.xlarge 1 x 250 GB, g6.2xlarge 1 x 450 GB NVMe SSD
#: (aws.amazon.com/ec2/instance-types/g6/); Inf2: EBS only (aws.amazon.com/ec2/instance-types/inf2/).
#: Those local volumes are encrypted by the instance's hardware module instead.
LOCAL_NVME_GB: dict[str, int] = {"ml.g6.xlarge": 250, "ml.g6.2xlarge": 450}

#: Inference DLC repositories and tags (aws/deep-learning-containers docs/src/data at e0ecedea:
#: pytorch-inference-neuronx/2.9-neuronx-sdk2.29.0.yml, pytorch-inference/2.6-gpu-sagemaker.yml;
#: at 8a167b51: pytorch-inference-neuronx/2.9-neuronx-sdk2.31.1.yml; rendered on
#: github.com/aws/deep-learning-containers/blob/master/available_images.md). The
#: Neuron image is the SDK release the Trainium env pins (training/backends/neuron_release.py 2.31.1), so
#: graphs compiled there load in this runtime (tests/stacks/test_serving.py checks the two agree).
#: The GPU one is the newest PyTorch *inference* image for SageMaker there (the 2.13 "pytorch"
#: images are training-only: no inference toolkit); its support window ended 2026-06-30 in that
#: data file: pin a newer one with -c servingImage=... when AWS publishes it.
DLC_IMAGES: dict[str, tuple[str, str]] = {
    "neuron": ("pytorch-inference-neuronx", "2.9.0-neuronx-py312-sdk2.31.1-ubuntu24.04"),
    "gpu": ("pytorch-inference", "2.6.0-gpu-py312-cu124-ubuntu22.04-sagemaker"),
}
NEURON_DLC_SDK = "2.31.1"
#: DLC registry account per region (aws/deep-learning-containers docs/reference/region_availability.md).
DLC_ACCOUNTS: dict[str, str] = {
    "us-east-1": "763104351884", "us-east-2": "763104351884", "us-west-1": "763104351884",
    "us-west-2": "763104351884", "af-south-1": "626614931356", "ap-east-1": "871362719292",
    "ap-south-2": "772153158452", "ap-southeast-3": "907027046896", "ap-southeast-5": "550225433462",
    "ap-southeast-4": "457447274322", "ap-south-1": "763104351884", "ap-southeast-6": "633930458069",
    "ap-northeast-3": "364406365360", "ap-northeast-2": "763104351884", "ap-southeast-1": "763104351884",
    "ap-southeast-2": "763104351884", "ap-east-2": "975050140332", "ap-southeast-7": "590183813437",
    "ap-northeast-1": "763104351884", "ca-west-1": "204538143572", "ca-central-1": "763104351884",
    "eu-central-1": "763104351884", "eu-west-1": "763104351884", "eu-west-2": "763104351884",
    "eu-south-1": "692866216735", "eu-west-3": "763104351884", "eu-south-2": "503227376785",
    "eu-north-1": "763104351884", "eu-central-2": "380420809688", "il-central-1": "780543022126",
    "mx-central-1": "637423239942", "me-south-1": "217643126080", "me-central-1": "914824155844",
    "sa-east-1": "763104351884", "cn-north-1": "727897471807", "cn-northwest-1": "727897471807",
}
#: Regions whose registry serves Neuron containers ("Neuron Container: Available" in the region
#: table of aws/deep-learning-containers available_images.md, commit 00819950). A pinned region
#: outside it needs -c servingImage=...
NEURON_DLC_REGIONS: frozenset[str] = frozenset({
    "us-east-1", "us-east-2", "us-west-2", "ap-south-1", "ap-southeast-1", "ap-southeast-2", "ap-northeast-1",
    "eu-central-1", "eu-west-1", "eu-west-3", "sa-east-1"})

MODEL_DATA_URL_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(.+\.tar\.gz)$")
IMAGE_URI_RE = re.compile(r"^\d{12}\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com(\.cn)?/[a-z0-9][a-z0-9._/-]*"
                          r"(:[\w][\w.-]{0,127}|@sha256:[0-9a-f]{64})$")
MAX_SERVING_INSTANCES = 20


def image_kind(instance_type: str) -> str:
    """"neuron" for Inferentia/Trainium instance types, "gpu" otherwise."""
    family = instance_type.removeprefix("ml.").split(".")[0]
    return "neuron" if family.startswith(("inf", "trn")) else "gpu"


def has_local_storage(instance_type: str) -> bool:
    return instance_type in LOCAL_NVME_GB


def dlc_image_uri(region: str, kind: str) -> str:
    """The DLC image URI for a known region (a pinned stack); the stack maps it otherwise."""
    repository, tag = DLC_IMAGES[kind]
    suffix = ".cn" if region.startswith("cn-") else ""
    return f"{DLC_ACCOUNTS[region]}.dkr.ecr.{region}.amazonaws.com{suffix}/{repository}:{tag}"


def model_data_location(url: str) -> tuple[str, str]:
    """(bucket, key) of a servingModelDataUrl."""
    match = MODEL_DATA_URL_RE.match(url)
    if not match:
        raise ValueError(url)
    return match.group(1), match.group(2)


def check_serving(cfg: PlatformConfig) -> None:
    """The serving keys, each refused in one line naming it (stacks/config.py ConfigError)."""
    from stacks.errors import ConfigError

    if cfg.servingInstanceType not in SERVING_INSTANCE_TYPES:
        raise ConfigError("servingInstanceType", cfg.servingInstanceType,
                          "allowed: " + ", ".join(SERVING_INSTANCE_TYPES) + " (Inferentia2, or the L4 GPU alternative)")
    if cfg.servingModelDataUrl and not MODEL_DATA_URL_RE.match(cfg.servingModelDataUrl):
        raise ConfigError("servingModelDataUrl", cfg.servingModelDataUrl,
                          "allowed: the s3://BUCKET/KEY.tar.gz URL python -m training.serve.package --upload printed")
    if cfg.serving and not cfg.servingModelDataUrl:
        raise ConfigError("servingModelDataUrl", "", "required with serving=true: the s3://BUCKET/KEY.tar.gz URL "
                          "python -m training.serve.package --upload printed (runbooks/serving.md)")
    if cfg.servingImage and not IMAGE_URI_RE.match(cfg.servingImage):
        raise ConfigError("servingImage", cfg.servingImage,
                          "allowed: empty (the inference DLC for the instance type) or an ECR image URI "
                          "ACCOUNT.dkr.ecr.REGION.amazonaws.com/REPOSITORY:TAG (or @sha256:DIGEST)")
    if not 1 <= cfg.servingMaxInstances <= MAX_SERVING_INSTANCES:
        raise ConfigError("servingMaxInstances", cfg.servingMaxInstances,
                          f"allowed: an integer from 1 to {MAX_SERVING_INSTANCES}")
    if not 1 <= cfg.servingInvocationsPerInstance <= 10000:
        raise ConfigError("servingInvocationsPerInstance", cfg.servingInvocationsPerInstance,
                          "allowed: an integer from 1 to 10000 (invocations per instance per minute)")
    if cfg.serving and cfg.region and not cfg.servingImage:
        kind = image_kind(cfg.servingInstanceType)
        if cfg.region not in DLC_ACCOUNTS or (kind == "neuron" and cfg.region not in NEURON_DLC_REGIONS):
            raise ConfigError("servingImage", "",
                              f"region {cfg.region} has no {kind} inference DLC in the table (stacks/serving_config.py); "
                              "set servingImage to an image URI in that region")
