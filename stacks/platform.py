"""The platform's CDK app: PlatformConfig from context -> network, storage, cluster stacks -> cdk-nag.

``build_app`` is what ``app.py`` runs and what the tests call in-process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks, HIPAASecurityChecks

from stacks.cluster import ClusterStack
from stacks.config import ConfigError, PlatformConfig, check_known_keys
from stacks.network import NetworkStack
from stacks.observability import ObservabilityStack
from stacks.serving import ServingStack
from stacks.storage import StorageStack

__all__ = ["ConfigError", "Platform", "PlatformConfig", "build_app", "cdk_json_context"]

CDK_JSON = Path(__file__).resolve().parents[1] / "cdk.json"


def cdk_json_context() -> dict[str, Any]:
    """The ``context`` block of cdk.json (what the CDK CLI passes to the app)."""
    return json.loads(CDK_JSON.read_text())["context"]


@dataclass(kw_only=True)
class Platform:
    app: cdk.App
    config: PlatformConfig
    network: NetworkStack
    storage: StorageStack
    cluster: ClusterStack
    serving: ServingStack | None = None
    observability: ObservabilityStack | None = None


def build_app(context: Mapping[str, Any] | None = None, *, outdir: str | None = None,
              wheelhouse_root: Path | None = None) -> Platform:
    """Build the app. Under the CLI, context comes from cdk.json + ``-c``; in tests pass it.

    Args:
        context: extra context for in-process use (tests); merged over cdk.json's context.
            None = the CLI case, where the CLI already passes cdk.json's context.
        outdir: cloud assembly directory for in-process synth.
        wheelhouse_root: where the wheelhouses of a private cluster are (default: build/wheelhouse,
            what ``make wheelhouse`` fills; tests pass their own).

    Raises:
        ConfigError: a bad context value (one line: key, value, what is allowed).
    """
    app_context = None if context is None else {**cdk_json_context(), **context}
    app = cdk.App(context=app_context, outdir=outdir)
    check_known_keys(app.node.get_all_context())
    config = PlatformConfig.from_context(app.node.try_get_context)
    # Environment-agnostic unless account/region are configured; never read from the
    # caller's credentials, so synth works offline and is reproducible.
    env = cdk.Environment(account=config.account or None, region=config.region or None)
    p = config.projectName
    # Construct ID = stack name, so `cdk deploy/destroy <project>-cluster` selects it.
    egress = "no internet egress, interface endpoints" if config.privateNetwork else "NAT"
    network = NetworkStack(app, f"{p}-network", stack_name=f"{p}-network", env=env, config=config,
                           description=f"{p}: VPC, cluster subnet, {egress}, S3 endpoint, flow logs, EFA security group")
    storage = StorageStack(app, f"{p}-storage", stack_name=f"{p}-storage", env=env, config=config,
                           network=network.network,
                           description=f"{p}: KMS key, data/artefacts/lifecycle buckets, FSx for Lustre")
    observability = None
    if config.observability:  # metrics, alerts, dashboards, MLflow (runbooks/observability.md)
        observability = ObservabilityStack(app, f"{p}-observability", stack_name=f"{p}-observability", env=env,
                                           config=config, storage=storage,
                                           description=f"{p}: Managed Prometheus workspace, alert rules, SNS alerts, "
                                                       "optional Grafana and MLflow")
    metrics = observability.metrics if observability is not None else None
    cluster = ClusterStack(app, f"{p}-cluster", stack_name=f"{p}-cluster", env=env, config=config,
                           network=network.network, storage=storage,
                           **({"wheelhouse_root": wheelhouse_root} if wheelhouse_root is not None else {}),
                           metrics_workspace_arn=metrics.workspace.attr_arn if metrics else None,
                           remote_write_url=metrics.remote_write_url if metrics else "",
                           description=f"{p}: HyperPod Slurm cluster, execution role, lifecycle scripts")
    # The cluster names storage's buckets by their deterministic names; keep the order explicit.
    cluster.add_stack_dependency(storage)
    serving = None
    if config.serving:  # optional: the SageMaker endpoint for a packaged model (runbooks/serving.md)
        serving = ServingStack(app, f"{p}-serving", stack_name=f"{p}-serving", env=env, config=config,
                               network=network.network, storage=storage,
                               description=f"{p}: SageMaker endpoint serving the trained Sana model")
    cdk.Tags.of(app).add("project", p)
    cdk.Tags.of(app).add("managed-by", "cdk")
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app), HIPAASecurityChecks(app))
    return Platform(app=app, config=config, network=network, storage=storage, cluster=cluster, serving=serving,
                    observability=observability)
