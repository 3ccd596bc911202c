"""The env step on a private cluster: installed from the wheelhouse inside a network namespace with no
route out, and the same env as the online build.

lifecycle_scripts/python_env.sh runs for real (venv, pip, the flock, the ready marker) in a pretend
node (PLATFORM_ROOT) with the pretend cluster's stand-ins (lifecycle_cluster.py STANDINS: the `aws`
CLI reads the lifecycle bucket from a local directory). The wheelhouse is built by the real
stacks/wheelhouse.py from PyPI, from a small pinned set (the full CUDA set is several GB): a
pure-Python package with dependencies, two manylinux wheels, and the stand-in `torch` the env step's
import check needs (a local wheel, which the index builds find through PIP_FIND_LINKS, the way an
index serves it: a path requirement would show as a direct URL in `pip freeze`). The private build runs under `unshare -n` (a new network namespace: only a
loopback device, down), so any attempt to reach an index fails; the online build of the same
requirements runs outside it, against PyPI, and both envs' `pip freeze` must be equal.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from lifecycle_cluster import build_wheel, settings

from stacks import wheelhouse as wh

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lifecycle_scripts" / "python_env.sh"
BUCKET = "sagemaker-sana-lc-test"
REGION = "eu-west-1"
PACKAGE = "pkgprivate01"
#: Small, exactly pinned, with a dependency tree (requests -> certifi, charset-normalizer, idna,
#: urllib3) and binary wheels (charset-normalizer, PyYAML are cp311 manylinux builds).
PINS = "requests==2.32.3\nPyYAML==6.0.3\n"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="unshare -n needs root (as the lifecycle runs on a node)"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is not installed"),
]


def pip_env() -> dict[str, str]:
    """This machine's environment without its pip configuration (indexes, constraints, find-links):
    the builds see PyPI, and only PyPI, as a node would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "SANA_", "LIFECYCLE_"))
           and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


@pytest.fixture(scope="module")
def standin_dist(tmp_path_factory) -> Path:
    """Where the stand-in torch wheel is found (PIP_FIND_LINKS of the two builds that use an index)."""
    dist = tmp_path_factory.mktemp("standin-wheels")
    build_wheel(dist, "torch")
    return dist


@pytest.fixture(scope="module")
def requirements(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("package") / "requirements-gpu.txt"
    path.write_text(f"# small test set (tests/lifecycle/test_private_env.py)\ntorch==0.0.0\n{PINS}")
    return path


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory, requirements, standin_dist) -> wh.Wheelhouse:
    built, downloaded = wh.build("gpu", requirements=requirements, root=tmp_path_factory.mktemp("wheelhouses"),
                                 env={**pip_env(), "PIP_FIND_LINKS": str(standin_dist)})
    assert downloaded
    return built


def node(tmp_path: Path, standins: Path, requirements: Path, wheelhouse: wh.Wheelhouse, *, private: bool,
         wheelhouse_settings: dict | None = None) -> dict[str, str]:
    """A gpu node after the package step: the package (requirements + its platform-settings.json) on
    FSx, the lifecycle bucket with the uploaded wheelhouse, the env settings.sh would export."""
    fsx = tmp_path / "fsx"
    (fsx / "envs/.locks").mkdir(parents=True)
    package = fsx / "platform" / PACKAGE
    (package / "training").mkdir(parents=True)
    shutil.copy(requirements, package / "training/requirements-gpu.txt")
    (package / "lifecycle").mkdir()
    node_settings = {**settings(PACKAGE), "private_network": private,
                     "wheelhouses": {"gpu": wheelhouse_settings or wheelhouse.settings()} if private else {}}
    (package / "lifecycle/platform-settings.json").write_text(json.dumps(node_settings))
    bucket = tmp_path / "s3" / BUCKET
    shutil.copytree(wheelhouse.path, bucket / wheelhouse.prefix)
    return {**pip_env(), "PATH": f"{standins}:{os.environ['PATH']}", "PLATFORM_ROOT": str(tmp_path / "root"),
            "FSX": str(fsx), "ENV_GPU_DIR": str(fsx / "envs/gpu"), "NODE_NAME": "gpu-1",
            "CFG_PACKAGE_HASH": PACKAGE, "CFG_REGION": REGION, "CFG_LIFECYCLE_BUCKET": BUCKET,
            "CFG_PRIVATE_NETWORK": str(private).lower(), "STANDIN_S3": str(tmp_path / "s3"),
            "STANDIN_REGION": REGION, "STANDIN_LOG": str(tmp_path / "calls.log"), "LIFECYCLE_ENV_LOCK_TIMEOUT_S": "60"}


def env_step(env: dict[str, str], *, offline: bool) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPT), "gpu", "build"]
    return subprocess.run(["unshare", "--net", *cmd] if offline else cmd, env=env, capture_output=True, text=True,
                          timeout=300)


def freeze(env_link: Path) -> list[str]:
    out = subprocess.run([str(env_link / "bin/python"), "-m", "pip", "freeze"], capture_output=True, text=True,
                         check=True, env=pip_env())
    return out.stdout.splitlines()


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0].removeprefix("ERROR: ")


def test_the_namespace_has_no_route_out():
    probe = "import socket; socket.create_connection(('151.101.0.223', 443), timeout=5)"  # a PyPI address
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", probe], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "Network is unreachable" in done.stderr, done.stderr
    with socket.create_connection(("pypi.org", 443), timeout=10):  # while this test's own namespace can
        pass


def test_private_env_from_the_wheelhouse_offline_equals_the_online_build(tmp_path, standins, requirements,
                                                                          wheelhouse, standin_dist):
    private = node(tmp_path / "private", standins, requirements, wheelhouse, private=True)
    result = env_step(private, offline=True)
    assert result.returncode == 0, result.stdout + result.stderr
    fetched = Path(private["FSX"]) / "wheelhouse" / f"gpu-{wheelhouse.key}"
    assert f"downloading the wheelhouse s3://{BUCKET}/{wheelhouse.prefix} to {fetched}" in result.stdout
    assert sorted(p.name for p in fetched.iterdir()) == sorted(p.name for p in wheelhouse.path.iterdir())
    assert oct(fetched.stat().st_mode & 0o777) == "0o755"
    online = node(tmp_path / "online", standins, requirements, wheelhouse, private=False)
    online["PIP_FIND_LINKS"] = str(standin_dist)
    result = env_step(online, offline=False)
    assert result.returncode == 0, result.stdout + result.stderr
    offline_freeze, online_freeze = freeze(Path(private["ENV_GPU_DIR"])), freeze(Path(online["ENV_GPU_DIR"]))
    assert offline_freeze == online_freeze
    names = {line.split("==")[0].lower() for line in offline_freeze}
    assert {"requests", "pyyaml", "certifi", "charset-normalizer", "idna", "urllib3", "torch"} <= names
    # Both marked ready; the private env's key names its wheelhouse, so the two are different dirs.
    for env in (private, online):
        assert (Path(env["ENV_GPU_DIR"]).resolve() / ".sana-env-ready").is_file()
    assert os.readlink(private["ENV_GPU_DIR"]) != os.readlink(online["ENV_GPU_DIR"])


def test_a_missing_wheel_fails_the_step_in_one_line_naming_it(tmp_path, standins, requirements, wheelhouse):
    env = node(tmp_path, standins, requirements, wheelhouse, private=True)
    uploaded = tmp_path / "s3" / BUCKET / wheelhouse.prefix
    (gone,) = uploaded.glob("urllib3-*.whl")
    gone.unlink()
    result = env_step(env, offline=True)
    assert result.returncode == 1
    assert error_line(result) == (
        f"wheelhouse s3://{BUCKET}/{wheelhouse.prefix} lacks 1 of {wheelhouse.wheels} wheels in requirements.lock: "
        f"{gone.name}; rebuild it (make wheelhouse) and redeploy the cluster stack")
    fsx = Path(env["FSX"])
    assert list((fsx / "wheelhouse").iterdir()) == [], "nothing half-downloaded is left on FSx"
    assert not (fsx / "envs/gpu").exists() and list((fsx / "envs").glob("gpu-*")) == []


def test_a_wheelhouse_other_than_the_deployed_one_is_refused(tmp_path, standins, requirements, wheelhouse):
    other = {**wheelhouse.settings(), "lock_sha256": "0" * 64}
    result = env_step(node(tmp_path, standins, requirements, wheelhouse, private=True, wheelhouse_settings=other),
                      offline=True)
    assert result.returncode == 1
    assert error_line(result).startswith(
        f"wheelhouse s3://{BUCKET}/{wheelhouse.prefix}: requirements.lock has sha256 {wheelhouse.lock_sha256[:12]}, "
        "the deployed package names 000000000000; redeploy the cluster stack")


def test_a_node_without_the_wheelhouse_python_fails_without_trying_apt(tmp_path, standins, requirements, wheelhouse):
    other = {**wheelhouse.settings(), "python": "3.99"}
    env = node(tmp_path, standins, requirements, wheelhouse, private=True, wheelhouse_settings=other)
    result = env_step(env, offline=True)
    assert result.returncode == 1
    assert error_line(result).startswith("no python3.99 on this node, the Python the gpu wheelhouse is built for, "
                                         "and apt-get cannot reach the Ubuntu archive")
    calls = Path(env["STANDIN_LOG"])
    assert not calls.exists() or "apt-get" not in calls.read_text()


def test_the_wheelhouse_is_fetched_from_the_clusters_region(tmp_path, standins, requirements, wheelhouse):
    env = node(tmp_path, standins, requirements, wheelhouse, private=True)
    env["STANDIN_REGION"] = "us-east-2"  # the bucket's region differs from the settings' region
    result = env_step(env, offline=True)
    assert result.returncode == 1
    assert error_line(result) == (f"cannot download the wheelhouse s3://{BUCKET}/{wheelhouse.prefix}: Could not "
                                  f"connect to the endpoint URL: \"https://s3.{REGION}.amazonaws.com/{BUCKET}\"")
