"""The observability step on a private cluster (privateNetwork): its agents from the bundle the deploy host
built, its DCGM exporter from this account's ECR, and a missing artefact one WARN line naming the fix.

What a private node has, each part real or standing in for the real one as written where it is made:

- the deploy host's build step is the real one (stacks/agent_releases.py ``build``) against the stand-in
  GitHub releases of lifecycle_cluster.observability_sources (archives in the projects' layouts with
  their checksum files, served as file://), and the cluster stack's upload is a copy of the built
  bundle into the stand-in lifecycle bucket (``$STANDIN_S3``) under the prefix the stack uses;
- the node's pins name GitHub, as the real ones do; in the pretend private subnet
  (``STANDIN_PRIVATE_SUBNET``) the stand-in curl fails as curl fails without a route and records each
  attempt, and the stand-in docker daemon times out on any registry but this region's ECR;
- the step itself runs inside a new network namespace (``unshare --net``: only a loopback device,
  down), so nothing it might reach past the stand-ins is reachable either.

Each test says what the code before the bundle existed did instead: it downloaded from GitHub and
nvcr.io on every node, which a private node cannot reach (curl retried each archive 6 times, 30 s a
try), and ended with WARN lines and no metrics at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import node_model
import pytest
from lifecycle_cluster import observability_sources

from stacks import agent_releases

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lifecycle_scripts" / "observability.sh"
SETTINGS = REPO / "lifecycle_scripts" / "settings.sh"
REGION = "eu-west-1"
BUCKET = "sagemaker-sana-lc-123456789012-eu-west-1"
REGISTRY = f"123456789012.dkr.ecr.{REGION}.amazonaws.com"
MIRROR = "sana/dcgm-exporter"
REMOTE_WRITE = f"https://aps-workspaces.{REGION}.amazonaws.com/workspaces/ws-0123/api/v1/remote_write"
DCGM_MIRROR = f"{REGISTRY}/{MIRROR}:{agent_releases.DCGM_EXPORTER.tag}"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="chown to the cluster group and unshare --net need root (as on a node)"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is not installed"),
]


@pytest.fixture
def bundle(tmp_path: Path) -> agent_releases.AgentBundle:
    """`make wheelhouse`'s agents part on the deploy host (internet: here the releases as file://), then
    the cluster stack's upload of it to the lifecycle bucket. The node's pins name GitHub."""
    releases = tmp_path / "github"
    observability_sources(releases, base_url="https://github.com")
    _base, pins = agent_releases.pins.load({"LIFECYCLE_AGENT_RELEASES": str(releases / "agent-releases.json")})
    built, downloaded = agent_releases.build(tmp_path / "build", releases=pins, base_url=releases.as_uri())
    assert downloaded
    shutil.copytree(built.path, tmp_path / "s3" / BUCKET / built.prefix)
    return built


def private_node(tmp_path: Path, standins: Path, bundle: agent_releases.AgentBundle, role: str,
                 **extra: str) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "nodes" / f"{role}-1"
    (root / "fsx").mkdir(parents=True)
    (root / "tmp").mkdir()
    (root / node_model.MARKERS).mkdir(parents=True)
    env = {"PATH": f"{standins}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "PLATFORM_ROOT": str(root),
           "FSX": str(root / "fsx"), "NODE_ROLE": role, "NODE_NAME": f"{role}-1", "NODE_IP": "10.1.1.1",
           "CFG_OBSERVABILITY": "true", "CFG_CLUSTER_GID": str(os.getgid()), "CFG_REGION": REGION,
           "CFG_CLUSTER_NAME": "sana-test", "CFG_REMOTE_WRITE_URL": REMOTE_WRITE,
           # settings.sh's exports on a private cluster (test_the_stack_settings_reach_the_step checks them)
           "CFG_PRIVATE_NETWORK": "true", "CFG_LIFECYCLE_BUCKET": BUCKET, "CFG_IMAGE_REGISTRY": REGISTRY,
           "CFG_AGENTS_PREFIX": bundle.prefix, "CFG_AGENTS_LOCK_SHA256": bundle.lock_sha256,
           "CFG_DCGM_EXPORTER_REPOSITORY": MIRROR,
           "LIFECYCLE_AGENT_RELEASES": str(tmp_path / "github/agent-releases.json"),
           "STANDIN_PRIVATE_SUBNET": "1", "STANDIN_S3": str(tmp_path / "s3"), "STANDIN_REGION": REGION,
           "STANDIN_DOCKER_IMAGES": DCGM_MIRROR, "STANDIN_LOG": str(tmp_path / "calls.log"),
           "STEP_WARN_FILE": str(tmp_path / "warnings"), **extra}
    return root, env


def run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "--net", "bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=180)


def warnings(tmp_path: Path) -> list[str]:
    path = tmp_path / "warnings"
    return path.read_text().splitlines() if path.exists() else []


def calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls.log"
    return path.read_text().splitlines() if path.exists() else []


def exec_start(root: Path, unit: str) -> str:
    (line,) = [ln for ln in (root / "etc/systemd/system" / unit).read_text().splitlines() if ln.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def test_a_private_gpu_node_installs_from_the_bundle_and_pulls_dcgm_from_this_accounts_ecr(tmp_path, standins, bundle):
    root, env = private_node(tmp_path, standins, bundle, "gpu")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/docker").write_text("#!/bin/sh\n")  # the AMI's docker
    (root / "usr/bin/docker").chmod(0o755)
    done = run(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert warnings(tmp_path) == []
    log = calls(tmp_path)
    # Nothing tried GitHub or nvcr.io; the archives came through the S3 gateway (the region's bucket).
    assert not [c for c in log if c.startswith(("curl", "curl-attempt"))], log
    source = f"s3://{BUCKET}/{bundle.prefix}"
    assert f"aws s3 cp --only-show-errors --no-progress --region {REGION} {source}agents.lock " \
        f"{root}/tmp" in "\n".join(log)
    assert any(c.startswith(f"aws s3 cp --only-show-errors --no-progress --region {REGION} "
                            f"{source}node_exporter-1.9.1.linux-amd64.tar.gz ") for c in log)
    assert "node_exporter 1.9.1: sha256 " in done.stdout and "matches the agents lock" in done.stdout
    assert (root / "opt/sana-observability/bin/node_exporter").is_file()
    # DCGM: ECR login with this run's own docker config, then the mirror, never nvcr.io.
    assert f"aws ecr get-login-password --region {REGION}" in log
    (login,) = [c for c in log if c.startswith("docker --config ") and " login " in c]
    assert login.endswith(f"login --username AWS --password-stdin {REGISTRY}")
    assert [c for c in log if " pull " in f" {c} "] == [f"docker --config {login.split()[2]} pull --quiet {DCGM_MIRROR}"]
    assert exec_start(root, "sana-dcgm-exporter.service").endswith(
        f"{DCGM_MIRROR} dcgm-exporter --hpc-job-mapping-dir /run/slurm/dcgm-job-mapping")
    # The login token stayed in the run's scratch directory, removed with it; root's docker config has none.
    assert not Path(login.split()[2]).exists() and not (tmp_path / "home/.docker").exists()
    targets = json.loads((root / "fsx/observability/nodes/gpu-1.json").read_text())
    assert [t["labels"]["job"] for t in targets] == ["node", "dcgm"]


def test_a_private_controller_runs_the_slurm_exporter_and_the_collector_from_the_bundle(tmp_path, standins, bundle):
    """slurm_exporter's pin records no sha256: on a private cluster the lock the build step wrote decides."""
    root, env = private_node(tmp_path, standins, bundle, "controller")
    done = run(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert warnings(tmp_path) == []
    for name in ("slurm_exporter", "prometheus", "promtool"):
        assert (root / "opt/sana-observability/bin" / name).is_file(), name
    assert "slurm_exporter 1.8.3: sha256 " in done.stdout
    config = json.loads((root / "etc/sana-observability/collector.yml").read_text())
    assert config["remote_write"] == [{"url": REMOTE_WRITE, "sigv4": {"region": REGION}}]
    assert not [c for c in calls(tmp_path) if c.startswith("curl")]


def test_a_missing_archive_is_one_warn_line_naming_it_and_the_fix(tmp_path, standins, bundle):
    """Before: the controller curled github.com for each archive (6 tries of 30 s) and warned twice."""
    asset = agent_releases.RELEASES["prometheus"].asset
    (tmp_path / "s3" / BUCKET / bundle.prefix / asset).unlink()
    root, env = private_node(tmp_path, standins, bundle, "controller")
    assert run(env).returncode == 0
    assert warnings(tmp_path) == [
        f"prometheus 2.53.4: cannot fetch s3://{BUCKET}/{bundle.prefix}{asset} (fatal error: An error occurred (404) "
        f'when calling the HeadObject operation: Key "{bundle.prefix}{asset}" does not exist): run `make wheelhouse` '
        "on the deploy host (it fetches the agents with the wheels) and redeploy the cluster stack"]
    assert (root / "opt/sana-observability/bin/slurm_exporter").is_file()  # the rest still runs
    assert not (root / "etc/systemd/system/sana-collector.service").exists()
    assert not [c for c in calls(tmp_path) if c.startswith("curl")]


def test_a_dcgm_image_not_mirrored_is_one_warn_line_naming_the_make_target(tmp_path, standins, bundle):
    """Before: docker pull nvcr.io/... timed out in the daemon on every GPU node."""
    root, env = private_node(tmp_path, standins, bundle, "gpu", STANDIN_DOCKER_IMAGES="")
    assert run(env).returncode == 0
    assert warnings(tmp_path) == [
        f"DCGM exporter: docker pull {DCGM_MIRROR} failed (Error response from daemon: manifest for {DCGM_MIRROR} not "
        "found: manifest unknown: manifest unknown): a private cluster pulls it from this account's ECR only; copy it "
        f"there from a machine that reaches nvcr.io (make mirror-dcgm-image REGISTRY={REGISTRY})"]
    targets = json.loads((root / "fsx/observability/nodes/gpu-1.json").read_text())
    assert [t["labels"]["job"] for t in targets] == ["node"]


def test_an_altered_bundle_is_refused_in_one_line_and_nothing_from_it_runs(tmp_path, standins, bundle):
    lock = tmp_path / "s3" / BUCKET / bundle.prefix / agent_releases.LOCK
    lock.write_text(lock.read_text().replace('"recipe": 1', '"recipe": 1 '))
    root, env = private_node(tmp_path, standins, bundle, "controller")
    assert run(env).returncode == 0
    (warning,) = warnings(tmp_path)
    source = f"s3://{BUCKET}/{bundle.prefix}{agent_releases.LOCK}"
    assert warning.startswith(f"agent releases: {source} has sha256 ")
    assert warning.endswith(f", not {bundle.lock_sha256} as platform-settings.json names it: run `make wheelhouse` on "
                            "the deploy host (it fetches the agents with the wheels) and redeploy the cluster stack; "
                            "no exporter or collector from this node")
    assert not (root / "opt/sana-observability/bin").exists()
    # An archive altered in the bucket (the lock intact) is refused by its sha256, before it is opened.
    shutil.rmtree(tmp_path / "s3" / BUCKET / bundle.prefix)
    shutil.copytree(bundle.path, tmp_path / "s3" / BUCKET / bundle.prefix)
    asset = agent_releases.RELEASES["node_exporter"].asset
    with (tmp_path / "s3" / BUCKET / bundle.prefix / asset).open("ab") as f:
        f.write(b"\0")
    (tmp_path / "warnings").unlink()
    assert run(env).returncode == 0
    (warning,) = [w for w in warnings(tmp_path) if w.startswith("node_exporter")]
    assert "node_exporter-1.9.1.linux-amd64.tar.gz has sha256 " in warning and \
        f"(the agents lock) (from s3://{BUCKET}/{bundle.prefix}{asset}); not installed" in warning
    assert not (root / "opt/sana-observability/bin/node_exporter").exists()


def test_a_package_without_a_bundle_warns_once_and_never_tries_github(tmp_path, standins, bundle):
    """A package from before the bundle existed (its settings name none): one line, no curl attempt."""
    root, env = private_node(tmp_path, standins, bundle, "controller", CFG_AGENTS_PREFIX="", CFG_AGENTS_LOCK_SHA256="")
    assert run(env).returncode == 0
    assert warnings(tmp_path) == [
        "agent releases: platform-settings.json names no observability.agents bundle and a private cluster cannot "
        "reach github.com: run `make wheelhouse` on the deploy host (it fetches the agents with the wheels) and "
        "redeploy the cluster stack; no exporter or collector from this node"]
    assert not [c for c in calls(tmp_path) if c.startswith("curl")]


def test_the_stack_settings_reach_the_step(tmp_path, standins, bundle):
    """platform-settings.json as the cluster stack writes it for a private cluster with observability
    (PlatformConfig.settings with stacks/cluster.py offline_agent_settings) -> settings.sh -> the CFG_*
    values the step above runs with."""
    from stacks.cluster import offline_agent_settings
    from stacks.config import PlatformConfig

    config = PlatformConfig.from_context({"privateNetwork": "true"})
    data = config.settings(region=REGION, data_bucket="sana-data-x", artefacts_bucket="sana-artefacts-x",
                           lifecycle_bucket=BUCKET, package_hash="pkg", image_registry=REGISTRY,
                           remote_write_url=REMOTE_WRITE,
                           wheelhouses={"gpu": {"prefix": "wheelhouse/gpu-0123456789abcdef/", "lock_sha256": "a" * 64,
                                                "python": "3.11"}},
                           offline_agents=offline_agent_settings(config, bundle))
    lifecycle = tmp_path / "lifecycle"
    lifecycle.mkdir()
    (lifecycle / "platform-settings.json").write_text(json.dumps(data))
    done = subprocess.run(["bash", str(SETTINGS)], env={"PATH": os.environ["PATH"], "LIFECYCLE_DIR": str(lifecycle),
                                                        "PLATFORM_ROOT": str(tmp_path / "node")},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    exported = (tmp_path / "node/var/lib/sana-platform/settings.env").read_text()
    assert f"export CFG_AGENTS_PREFIX={bundle.prefix}\n" in exported
    assert f"export CFG_AGENTS_LOCK_SHA256={bundle.lock_sha256}\n" in exported
    assert f"export CFG_DCGM_EXPORTER_REPOSITORY={MIRROR}\n" in exported
    assert "export CFG_PRIVATE_NETWORK=true\n" in exported
