"""The env step on a private cluster: installed from the wheelhouse inside a network namespace with no
route out, and the same env as the online build.

lifecycle_scripts/python_env.sh runs for real (venv, pip, the flock, the ready marker) in a pretend
node (PLATFORM_ROOT) with the pretend cluster's stand-ins (lifecycle_cluster.py STANDINS: the `aws`
CLI reads the lifecycle bucket from a local directory). The package index is a real one on
loopback: a PEP 503 "simple" repository (https://peps.python.org/pep-0503/) served over HTTP on
127.0.0.1, holding a small set made here (the real set is several GB, and tests reach nothing beyond
loopback): a pinned package with dependencies, one unpinned with two releases (the resolver takes
the newest), one behind a marker that is false on the nodes' Python, a manylinux wheel whose newer
release needs a glibc newer than the nodes' and this machine's, and the stand-in `torch` the env
step's import check needs. stacks/wheelhouse.py builds the wheelhouse from that index as
`make wheelhouse` does from PyPI; the private build runs under `unshare -n` (a new network
namespace: only a loopback device, down), so the index is out of reach; the online build of the
same requirements runs outside it against the index, and both envs' `pip freeze` must be equal.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from lifecycle_cluster import build_wheel, settings

from stacks import wheelhouse as wh

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "lifecycle_scripts" / "python_env.sh"
BUCKET = "sagemaker-sana-lc-test"
REGION = "eu-west-1"
PACKAGE = "pkgprivate01"
REQUIREMENTS = "# small test set (tests/lifecycle/test_private_env.py)\ntorch==0.0.0\nsana-app==1.0\n"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="unshare -n needs root (as the lifecycle runs on a node)"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare is not installed"),
]


def pip_env(index: str | None = None) -> dict[str, str]:
    """This machine's environment without its pip configuration (indexes, constraints, find-links),
    and the test's index, if any, as the only one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "SANA_", "LIFECYCLE_"))
           and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if index:
        env["PIP_INDEX_URL"] = index
    return env


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A PEP 503 repository on 127.0.0.1: /simple/<project>/ lists the files with their sha256."""
    root = tmp_path_factory.mktemp("index")
    files = root / "files"
    files.mkdir()
    build_wheel(files, "torch")
    build_wheel(files, "sana_app", "1.0", requires=("sana-dep>=1.0", "sana-native>=2.0",
                                                     'sana-old; python_version < "3.8"'))
    build_wheel(files, "sana_dep", "1.0")
    build_wheel(files, "sana_dep", "1.1")  # unpinned: both builds must take the newest
    build_wheel(files, "sana_old", "1.0")  # behind a marker that is false on 3.11
    build_wheel(files, "sana_native", "2.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    build_wheel(files, "sana_native", "2.1", tag="cp311-cp311-manylinux_2_99_x86_64")  # no node has that glibc
    projects: dict[str, list[Path]] = {}
    for wheel in files.iterdir():
        projects.setdefault(wheel.name.split("-")[0].replace("_", "-").lower(), []).append(wheel)
    for project, wheels in projects.items():
        page = root / "simple" / project
        page.mkdir(parents=True)
        links = "".join(f'<a href="../../files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                        f"{html.escape(w.name)}</a>\n" for w in sorted(wheels))
        (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def requirements(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("package") / "requirements-gpu.txt"
    path.write_text(REQUIREMENTS)
    return path


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory, requirements, index) -> wh.Wheelhouse:
    built, downloaded = wh.build("gpu", requirements=requirements, root=tmp_path_factory.mktemp("wheelhouses"),
                                 env=pip_env(index))
    assert downloaded
    return built


def node(tmp_path: Path, standins: Path, requirements: Path, wheelhouse: wh.Wheelhouse, *, private: bool,
         wheelhouse_settings: dict | None = None) -> dict[str, str]:
    """A gpu node after the package step: the package (requirements + its platform-settings.json) on
    FSx as the cluster's current one, the lifecycle bucket with the uploaded wheelhouse, the env settings.sh would export."""
    fsx = tmp_path / "fsx"
    (fsx / "envs/.locks").mkdir(parents=True)
    package = fsx / "platform" / PACKAGE
    (package / "training").mkdir(parents=True)
    shutil.copy(requirements, package / "training/requirements-gpu.txt")
    (package / "lifecycle").mkdir()
    node_settings = {**settings(PACKAGE), "private_network": private,
                     "wheelhouses": {"gpu": wheelhouse_settings or wheelhouse.settings()} if private else {}}
    (package / "lifecycle/platform-settings.json").write_text(json.dumps(node_settings))
    (fsx / "platform" / "current").symlink_to(PACKAGE)  # what install_package.sh leaves on a new cluster
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


def test_the_namespace_reaches_neither_the_index_nor_any_address(index):
    host, port = index.split("/")[2].split(":")
    for address in ((host, int(port)), ("151.101.0.223", 443)):  # the index; an address outside (PyPI's)
        probe = f"import socket; socket.create_connection({address!r}, timeout=5)"
        done = subprocess.run(["unshare", "--net", sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode != 0 and ("Network is unreachable" in done.stderr or "Connection refused"
                                         in done.stderr), done.stderr
    with socket.create_connection((host, int(port)), timeout=5):  # while this test's own namespace can
        pass


def test_private_env_from_the_wheelhouse_offline_equals_the_online_build(tmp_path, standins, requirements,
                                                                          wheelhouse, index):
    private = node(tmp_path / "private", standins, requirements, wheelhouse, private=True)
    result = env_step(private, offline=True)
    assert result.returncode == 0, result.stdout + result.stderr
    fetched = Path(private["FSX"]) / "wheelhouse" / f"gpu-{wheelhouse.key}"
    assert f"downloading the wheelhouse s3://{BUCKET}/{wheelhouse.prefix} to {fetched}" in result.stdout
    assert sorted(p.name for p in fetched.iterdir()) == sorted(p.name for p in wheelhouse.path.iterdir())
    assert oct(fetched.stat().st_mode & 0o777) == "0o755"
    online = node(tmp_path / "online", standins, requirements, wheelhouse, private=False)
    online["PIP_INDEX_URL"] = index
    result = env_step(online, offline=False)
    assert result.returncode == 0, result.stdout + result.stderr
    offline_freeze, online_freeze = freeze(Path(private["ENV_GPU_DIR"])), freeze(Path(online["ENV_GPU_DIR"]))
    assert offline_freeze == online_freeze
    assert offline_freeze == ["sana_app==1.0", "sana_dep==1.1", "sana_native==2.0", "torch==0.0.0"]
    # Both marked ready; the private env's key names its wheelhouse, so the two are different dirs.
    for env in (private, online):
        assert (Path(env["ENV_GPU_DIR"]).resolve() / ".sana-env-ready").is_file()
    assert os.readlink(private["ENV_GPU_DIR"]) != os.readlink(online["ENV_GPU_DIR"])


def test_a_missing_wheel_fails_the_step_in_one_line_naming_it(tmp_path, standins, requirements, wheelhouse):
    env = node(tmp_path, standins, requirements, wheelhouse, private=True)
    uploaded = tmp_path / "s3" / BUCKET / wheelhouse.prefix
    (gone,) = uploaded.glob("sana_dep-*.whl")
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


def test_a_fetched_wheelhouse_altered_on_fsx_is_checked_again_and_refused(tmp_path, standins, requirements,
                                                                          wheelhouse):
    env = node(tmp_path, standins, requirements, wheelhouse, private=True)
    assert env_step(env, offline=True).returncode == 0
    fsx = Path(env["FSX"])
    # A later build of the same package (a new base Python, a removed env) finds the fetched copy.
    (fsx / "envs/gpu").unlink()
    for built in (fsx / "envs").glob("gpu-*"):
        shutil.rmtree(built)
    fetched = fsx / "wheelhouse" / f"gpu-{wheelhouse.key}"
    (altered,) = fetched.glob("sana_native-*.whl")
    with altered.open("ab") as f:
        f.write(b"\0")
    result = env_step(env, offline=True)
    assert result.returncode == 1
    assert error_line(result) == (f"wheelhouse {fetched}: {altered.name} do not match their sha256 in "
                                  "requirements.lock; rebuild it (make wheelhouse) and redeploy the cluster stack (or, "
                                  f"for a copy changed on FSx since it was fetched: remove {fetched} to fetch it again)")
    assert "downloading the wheelhouse" not in result.stdout
