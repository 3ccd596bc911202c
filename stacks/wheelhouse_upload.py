"""WheelhouseUpload: a private cluster's wheelhouses, uploaded beside the lifecycle package.

``make wheelhouse`` builds them (stacks/wheelhouse.py); this uploads each one the cluster's groups
need to ``s3://<lifecycle bucket>/wheelhouse/<kind>-<key>/`` when the cluster stack deploys, before
the cluster is created. Not under the lifecycle prefix: HyperPod copies that whole prefix onto every
node, and a wheelhouse is several GB; the env step fetches it once per cluster, under its build lock.

The full set is several GB of CUDA and Neuron wheels, more than one run of CDK's BucketDeployment
handler holds: it keeps each source archive and its extracted files in /tmp
(aws-cdk-lib custom-resource-handlers/dist/aws-s3-deployment/bucket-deployment-handler/index.py,
``s3_deploy``), at most 10 GiB of ephemeral storage. So the wheels travel in parts of at most
``UPLOAD_PART_BYTES``, each its own deployment to the same prefix (prune off: the parts would delete
each other's files), and the first part carries the lock. The prefix is named by the key, so a
redeploy of the same wheelhouse writes the same objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import aws_cdk as cdk
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_deployment as s3deploy
from constructs import Construct

from stacks.config import ConfigError, PlatformConfig
from stacks.wheelhouse import UPLOAD_PART_BYTES, Target, Wheelhouse, WheelhouseError, load

HANDLER_STORAGE_MIB = 10240
HANDLER_MEMORY_MIB = 2048


def env_kinds(cfg: PlatformConfig) -> tuple[str, ...]:
    """The node envs the groups build or use: gpu (gpu nodes; login nodes use its Python), neuron (trn)."""
    kinds = []
    if cfg.gpuInstanceCount or cfg.loginInstanceCount:
        kinds.append("gpu")
    if cfg.trnInstanceCount:
        kinds.append("neuron")
    return tuple(kinds)


def wheelhouses_for(cfg: PlatformConfig, root: Path) -> dict[str, Wheelhouse]:
    """The built wheelhouse of every env kind the cluster needs; one-line ConfigError if one is missing."""
    found = {}
    for kind in env_kinds(cfg):
        try:
            found[kind] = load(kind, Target(), root=root)
        except WheelhouseError as err:
            raise ConfigError("privateNetwork", True, f"the nodes install their envs from a wheelhouse: {err}") from None
    return found


class Uploadable(Protocol):
    """A wheelhouse, or the observability agents' archives (stacks/agent_releases.py AgentBundle)."""

    path: Path

    @property
    def prefix(self) -> str: ...

    def upload_parts(self, max_bytes: int = ...) -> list[list[str]]: ...


class WheelhouseUpload(Construct):
    """One BucketDeployment per part of each wheelhouse (``deployments``); the observability agents'
    archives of a private cluster travel the same way, as kind ``agents``."""

    def __init__(self, scope: Construct, id: str, *, wheelhouses: dict[str, Uploadable],
                 bucket: s3.IBucket, part_bytes: int = UPLOAD_PART_BYTES) -> None:
        super().__init__(scope, id)
        self.deployments: list[s3deploy.BucketDeployment] = []
        for kind, wheelhouse in wheelhouses.items():
            parts = wheelhouse.upload_parts(part_bytes)
            every = {p.name for p in wheelhouse.path.iterdir()}
            for number, names in enumerate(parts):
                # Everything in the directory but this part's files (CDK's asset exclude globs).
                exclude = sorted(every - set(names))
                self.deployments.append(s3deploy.BucketDeployment(
                    self, f"{kind.capitalize()}Part{number}",
                    sources=[s3deploy.Source.asset(str(wheelhouse.path), exclude=exclude)],
                    destination_bucket=bucket, destination_key_prefix=wheelhouse.prefix,
                    prune=False, retain_on_delete=True, memory_limit=HANDLER_MEMORY_MIB,
                    ephemeral_storage_size=cdk.Size.mebibytes(HANDLER_STORAGE_MIB)))
