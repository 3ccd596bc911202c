"""Synthesized platform variants, each built ONCE per test session and shared by all tests.

jsii synth is the slow part (tens of seconds per app on the shared 2-core machine), so the
variants are chosen to cover every shape the issue names with three apps:

- ``default``: cdk.json as shipped -> GPU (p5) + Trainium (trn1) + login group.
- ``gpu_only``: p4d, no Trainium group, no login group; synthesized through the REAL CDK CLI
  with ``-c`` overrides, which proves the CLI path and that ``-c`` changes the cluster.
- ``trn_only``: trn2.48xlarge, no GPU group, login on, pinned to us-east-2 (the region
  where cfn-lint's pricing data lists trn2.48xlarge), continuousProvisioning off (the
  legacy provisioning mode: no NodeProvisioningMode, node volumes on AWS owned keys), and
  cloudTrail off.
- ``accounting``: slurmAccounting on (Aurora MySQL + Secrets Manager + the DB subnets and
  security group), with two users, a custom group, named key administrators and users, and
  another log retention.

- ``private``: privateNetwork on (no NAT or internet gateway, interface endpoints, the
  wheelhouse uploads) with slurmAccounting (the Secrets Manager endpoint) and the SageMaker MLflow
  tracking server (its endpoint); its wheelhouses are stand-ins ``stand_in_wheelhouse`` makes for
  the real requirements files (the real ones are several GB; tests/lifecycle/test_private_env.py
  builds a small real one), and ``stand_in_agent_bundle`` the observability agents' archives.
The ``<project>-observability`` stack is on by default (``default``, ``gpu_only``); ``trn_only``
turns it off, and ``accounting`` adds its optional parts (Managed Grafana, the SageMaker MLflow
tracking server, an alert email, another stall window).

The optional ``<project>-serving`` stack rides on two of them instead of costing a synth of its
own: ``trn_only`` adds ``serving=true`` with the defaults (ml.inf2.xlarge, the Neuron DLC of the
pinned region, the volume on the platform key), ``accounting`` adds the GPU alternative
(ml.g6.xlarge: NVMe instance storage, so no KmsKeyId) with data capture on, region-agnostic
(the DLC image from the per-region mapping).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

REPO = Path(__file__).resolve().parents[2]
STACKS = ("Network", "Storage", "Cluster")

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "gpu_only": {"gpuInstanceType": "ml.p4d.24xlarge", "trnInstanceCount": "0", "loginInstanceCount": "0",
                 "gpuInstanceCount": "4", "deepHealthChecks": "false"},
    "trn_only": {"gpuInstanceCount": 0, "trnInstanceType": "ml.trn2.48xlarge", "trnInstanceCount": 2,
                 "region": "us-east-2", "availabilityZoneId": "use2-az3", "continuousProvisioning": False,
                 "cloudTrail": False, "serving": True, "observability": False,
                 "servingModelDataUrl": "s3://sana-artefacts-123456789012-us-east-2/serving/model-0123456789ab.tar.gz"},
    "accounting": {"slurmAccounting": "true", "clusterUsers": "ana:2001,ben:2002", "clusterGroup": "lab:3000",
                   "keyAdministrators": ["arn:aws:iam::123456789012:role/platform-admin"],
                   "keyUsers": "arn:aws:iam::123456789012:role/data-engineer,arn:aws:iam::123456789012:user/ana",
                   "logRetentionDays": 365,
                   "serving": "true", "servingInstanceType": "ml.g6.xlarge", "servingDataCapture": "true",
                   "servingMaxInstances": "4",
                   "grafana": "true", "mlflowTrackingServer": "true", "alertEmail": "oncall@example.com",
                   "stallMinutes": "45",
                   "servingModelDataUrl": "s3://sana-artefacts-123456789012-us-east-1/serving/model-ba9876543210.tar.gz"},
    "private": {"privateNetwork": "true", "slurmAccounting": "true", "mlflowTrackingServer": "true"},
}
# The next deployment after a full teardown (tests/stacks/test_redeploy.py).
VARIANTS["default_g2"] = {"deploymentGeneration": 2}
VARIANTS["accounting_g2"] = {**VARIANTS["accounting"], "deploymentGeneration": 2}
CLI_VARIANTS = {"gpu_only"}


@dataclass
class Synth:
    name: str
    outdir: Path
    context: dict[str, Any]
    templates: dict[str, dict] = field(default_factory=dict)
    platform: Any = None  # stacks.platform.Platform for in-process variants
    cli_output: str = ""  # stdout+stderr of `cdk synth` for CLI variants
    package_hash: str = ""  # of lifecycle_scripts/ + training/ + node settings at synth; "" if the trees changed during synth

    def template(self, stack: str):
        from aws_cdk.assertions import Template

        return Template.from_json(self.templates[stack])

    def resources(self, stack: str, type_: str) -> dict[str, dict]:
        return {k: v for k, v in self.templates[stack]["Resources"].items() if v["Type"] == type_}

    def cluster(self) -> dict:
        (res,) = self.resources("Cluster", "AWS::SageMaker::Cluster").values()
        return res["Properties"]

    def groups(self) -> dict[str, dict]:
        return {g["InstanceGroupName"]: g for g in self.cluster()["InstanceGroups"]}


def _cli_command(*args: str) -> tuple[list[str], dict[str, str]]:
    return ["npx", "--no-install", "cdk", *args], {**os.environ, "CDK_DISABLE_CLI_TELEMETRY": "true"}


def cdk_cli(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd, env = _cli_command(*args)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class BackgroundCliSynth:
    """`cdk synth` of a CLI variant in a child process, started early so it overlaps the in-process synth."""

    def __init__(self, name: str, outdir: Path) -> None:
        self.outdir = outdir
        self.hash_before = expected_package_hash(VARIANTS[name])
        overrides = [arg for key, value in VARIANTS[name].items() for arg in ("-c", f"{key}={value}")]
        cmd, env = _cli_command("synth", "--quiet", "--no-notices", "--output", str(outdir), *overrides)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)

    def wait(self) -> None:
        output, _ = self.proc.communicate(timeout=600)
        assert self.proc.returncode == 0, output
        self.output = output

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_BACKGROUND: dict[str, BackgroundCliSynth] = {}


@pytest.fixture(scope="session", autouse=True)
def _start_cli_synths(request, tmp_path_factory):
    """Start the CLI variants' synth at session start, if any collected test needs a variant."""
    needed = any({"synthesized", *CLI_VARIANTS} & set(getattr(item, "fixturenames", ())) for item in request.session.items)
    for name in CLI_VARIANTS if needed else ():
        _BACKGROUND[name] = BackgroundCliSynth(name, tmp_path_factory.mktemp(f"cdk-{name}"))
    yield
    for job in _BACKGROUND.values():
        job.stop()


def stand_in_wheelhouse(root: Path, kind: str, names: tuple[str, ...] = ("torch", "numpy")) -> Path:
    """A wheelhouse of ``kind`` keyed by the real requirements file, holding small stand-in wheels,
    locked by the real stacks/wheelhouse.py ``finish``."""
    import zipfile

    from stacks import wheelhouse

    incoming = root / f".incoming-{kind}"
    incoming.mkdir(parents=True)
    for name in names:
        with zipfile.ZipFile(incoming / f"{name}-0.0.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}/__init__.py", f'"""Stand-in {name} (tests/stacks)."""\n')
    return wheelhouse.finish(incoming, kind=kind, target=wheelhouse.Target(), root=root).path


def stand_in_agent_bundle(root: Path) -> Path:
    """The observability agents' bundle for the real pins, holding small stand-in archives (the real ones
    come from GitHub: tests/stacks/test_agent_releases.py builds one from releases served on loopback),
    locked by the real stacks/agent_releases.py ``finish``."""
    from stacks import agent_releases

    incoming = root / ".incoming-agents"
    incoming.mkdir(parents=True)
    sha256s = {}
    for name, release in agent_releases.RELEASES.items():
        (incoming / release.asset).write_bytes(f"stand-in {release.asset} (tests/stacks)".encode())
        sha256s[name] = agent_releases.pins.sha256_of(incoming / release.asset)
    return agent_releases.finish(incoming, releases=agent_releases.RELEASES, sha256s=sha256s, root=root).path


def expected_package_hash(context: dict[str, Any], wheelhouse_root: Path | None = None) -> str:
    """The package hash of the tree now, for a variant's configuration (code + node settings)."""
    from stacks.cluster import deployment_package_hash
    from stacks.platform import PlatformConfig, cdk_json_context

    config = PlatformConfig.from_context({**cdk_json_context(), **context})
    if wheelhouse_root is None:
        return deployment_package_hash(config)
    return deployment_package_hash(config, wheelhouse_root=wheelhouse_root)


def _synth(name: str, outdir: Path) -> Synth:
    context = VARIANTS[name]
    wheelhouses = None
    if context.get("privateNetwork"):
        wheelhouses = outdir.parent / f"{outdir.name}-wheelhouses"
        for kind in ("gpu", "neuron"):
            stand_in_wheelhouse(wheelhouses, kind)
        stand_in_agent_bundle(wheelhouses)
    expected_hash = expected_package_hash(context, wheelhouses)
    cli_output = ""
    if name in CLI_VARIANTS:
        job = _BACKGROUND[name]
        job.wait()
        outdir, expected_hash, cli_output = job.outdir, job.hash_before, job.output
    else:
        from stacks.platform import build_app

        platform = build_app(context, outdir=str(outdir), wheelhouse_root=wheelhouses)
        platform.app.synth()
    if expected_package_hash(context, wheelhouses) != expected_hash:
        expected_hash = ""  # edited while synthesizing (several engineers share this checkout)
    synth = Synth(name=name, outdir=outdir, context=context,
                  platform=None if name in CLI_VARIANTS else platform, package_hash=expected_hash,
                  cli_output=cli_output)
    project = context.get("projectName", "sana")
    for stack in STACKS:
        synth.templates[stack] = json.loads((outdir / f"{project}-{stack.lower()}.template.json").read_text())
    for stack in ("Serving", "Observability"):  # only with serving=true / observability=true
        template = outdir / f"{project}-{stack.lower()}.template.json"
        if template.exists():
            synth.templates[stack] = json.loads(template.read_text())
    return synth


_CACHE: dict[str, Synth] = {}


@pytest.fixture(scope="session")
def cdk():
    """Run the project's pinned CDK CLI (``npx --no-install cdk ...``) in the repo."""
    return cdk_cli


@pytest.fixture(scope="session")
def synthesized(tmp_path_factory):
    """``synthesized(name)`` -> the Synth of that variant (built on first use, then cached)."""

    def get(name: str) -> Synth:
        if name not in _CACHE:
            _CACHE[name] = _synth(name, tmp_path_factory.mktemp(f"cdk-{name}"))
        return _CACHE[name]

    return get


@pytest.fixture(scope="session")
def default(synthesized) -> Synth:
    return synthesized("default")


@pytest.fixture(scope="session")
def gpu_only(synthesized) -> Synth:
    return synthesized("gpu_only")


@pytest.fixture(scope="session")
def trn_only(synthesized) -> Synth:
    return synthesized("trn_only")


@pytest.fixture(scope="session")
def accounting(synthesized) -> Synth:
    return synthesized("accounting")


@pytest.fixture(scope="session")
def private(synthesized) -> Synth:
    return synthesized("private")
