"""Names the stacks agree on without cross-stack references (deterministic, with the account and
region pseudo parameters as tokens): the buckets, the cluster execution role, the trail.

Named rather than generated so that one stack's policy can name another stack's resource
(the key policy and bucket policies in the storage stack name the execution role the cluster
stack creates; the access-log bucket's policy in the network stack names the storage stack's
buckets and trail) without a reference cycle between the stacks, and so that audit findings
show readable ARNs.
"""

from __future__ import annotations

import aws_cdk as cdk


def bucket_names(name_prefix: str) -> dict[str, str]:
    """Deterministic bucket names (with the account/region pseudo parameters as tokens).

    ``name_prefix`` is PlatformConfig.retained_prefix: the project, with ``-g<N>`` from
    deploymentGeneration 2 on (retained buckets of an earlier deployment keep their names).

    Named rather than generated so that other stacks, IAM statements and the nodes'
    platform-settings.json refer to them without cross-stack exports, and so that audit
    findings show readable ARNs. HyperPod's managed instance policy
    (AmazonSageMakerClusterInstanceRolePolicy) only reaches buckets named sagemaker-*,
    hence the lifecycle bucket's prefix.
    """
    suffix = f"{cdk.Aws.ACCOUNT_ID}-{cdk.Aws.REGION}"
    return {"data": f"{name_prefix}-data-{suffix}", "artefacts": f"{name_prefix}-artefacts-{suffix}",
            "lifecycle": f"sagemaker-{name_prefix}-lc-{suffix}"}


def bucket_arn(name: str) -> str:
    return f"arn:{cdk.Aws.PARTITION}:s3:::{name}"


def execution_role_name(project: str) -> str:
    """The cluster execution role's fixed name: the key policy and the bucket policies name the
    role (storage stack) before the cluster stack creates it. Per region: IAM names are global."""
    return f"{project}-hyperpod-nodes-{cdk.Aws.REGION}"


def execution_role_arn(project: str) -> str:
    return f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/{execution_role_name(project)}"


def endpoint_name(project: str) -> str:
    """The serving endpoint (stacks/serving.py); its CloudWatch log group is
    /aws/sagemaker/Endpoints/<this>, which the key policy lets CloudWatch Logs encrypt."""
    return f"{project}-serving"


def serving_role_name(project: str) -> str:
    """The serving model's role (stacks/serving.py): the key policy names it before the serving
    stack creates it, as it names the execution role. Per region: IAM names are global."""
    return f"{project}-serving-model-{cdk.Aws.REGION}"


def serving_role_arn(project: str) -> str:
    return f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/{serving_role_name(project)}"


def trail_name(project: str) -> str:
    return f"{project}-data-events"


def trail_arn(project: str) -> str:
    return f"arn:{cdk.Aws.PARTITION}:cloudtrail:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:trail/{trail_name(project)}"


def log_group_arn(name_pattern: str) -> str:
    return f"arn:{cdk.Aws.PARTITION}:logs:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:log-group:{name_pattern}"


def observability_stack_name(project: str) -> str:
    return f"{project}-observability"


def mlflow_server_name(project: str) -> str:
    """The SageMaker MLflow tracking server (stacks/observability.py): the nodes' role names its
    ARN (stacks/cluster.py) without a reference to the observability stack."""
    return f"{project}-mlflow"


def mlflow_server_arn(project: str) -> str:
    return (f"arn:{cdk.Aws.PARTITION}:sagemaker:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:"
            f"mlflow-tracking-server/{mlflow_server_name(project)}")


def mlflow_role_name(project: str) -> str:
    """The tracking server's role: the key policy names it (a key user) before the observability
    stack creates it. Per region: IAM names are global."""
    return f"{project}-mlflow-{cdk.Aws.REGION}"


def mlflow_role_arn(project: str) -> str:
    return f"arn:{cdk.Aws.PARTITION}:iam::{cdk.Aws.ACCOUNT_ID}:role/{mlflow_role_name(project)}"


def alerts_topic_name(project: str) -> str:
    """The SNS topic the alert manager sends to (stacks/observability.py); the key policy names it."""
    return f"{project}-alerts"


def alerts_topic_arn(project: str) -> str:
    return f"arn:{cdk.Aws.PARTITION}:sns:{cdk.Aws.REGION}:{cdk.Aws.ACCOUNT_ID}:{alerts_topic_name(project)}"
