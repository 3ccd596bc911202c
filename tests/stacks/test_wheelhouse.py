"""stacks/wheelhouse.py (``make wheelhouse``) and the lock check the nodes run (lifecycle_scripts/wheelhouse.py).

Offline: wheels are small stand-ins built here, pip runs with a local find-links directory and no
index. A wheelhouse built from a package index (on loopback) and installed by the env step in a
network namespace with no route out is tests/lifecycle/test_private_env.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging import tags

from stacks import wheelhouse as wh
from tests.stacks.conftest import stand_in_wheelhouse

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "lifecycle_scripts" / "wheelhouse.py"


def wheel(dist: Path, name: str, version: str = "1.0", size: int = 0, tag: str = "py3-none-any") -> Path:
    """A wheel pip installs (PEP 427: the package plus its .dist-info), with the tag given."""
    path = dist / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "x = 1\n")
        if size:
            z.writestr(f"{name}/blob", os.urandom(size), compress_type=zipfile.ZIP_STORED)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: sana-tests\nRoot-Is-Purelib: true\nTag: {tag}\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def offline_pip(find_links: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(find_links))
    return env


def test_the_platform_tags_are_the_ones_a_node_pip_accepts():
    """packaging (what pip uses) lists the manylinux tags of this machine's glibc, newest first,
    each legacy alias after its glibc version: the same list for the same glibc."""
    import packaging._manylinux as manylinux

    major, minor = manylinux._get_glibc_version()
    glibc = f"{major}.{minor}"
    assert list(wh.Target(glibc=glibc).platforms) == list(manylinux.platform_tags(["x86_64"]))
    assert wh.Target().platforms[0] == "manylinux_2_35_x86_64" and wh.Target().platforms[-1] == "manylinux1_x86_64"
    assert "manylinux_2_36_x86_64" not in wh.Target().platforms  # newer than Ubuntu 22.04's glibc
    assert tags.Tag("cp311", "cp311", "manylinux_2_28_x86_64") in {
        tags.Tag("cp311", "cp311", p) for p in wh.Target().platforms}


@pytest.mark.parametrize(("field", "value"), [("python", "3"), ("python", "2.7x"), ("glibc", "2.5"), ("glibc", "x")])
def test_a_bad_target_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        wh.Target(**{field: value})


def test_the_key_follows_the_requirements_the_target_and_the_index(tmp_path):
    req = tmp_path / "req.txt"
    req.write_text("a==1\n")
    base = wh.key("gpu", wh.Target(), req)
    assert base == wh.key("gpu", wh.Target(), req)
    assert base != wh.key("neuron", wh.Target(), req)  # Neuron's index is part of it
    assert base != wh.key("gpu", wh.Target(python="3.12"), req)
    assert base != wh.key("gpu", wh.Target(glibc="2.39"), req)
    req.write_text("a==2\n")
    assert base != wh.key("gpu", wh.Target(), req)


def test_build_downloads_once_locks_every_wheel_and_is_cached(tmp_path):
    dist = tmp_path / "dist"
    dist.mkdir()
    wheel(dist, "alpha", "1.0")
    wheel(dist, "Beta_Pkg", "2.0.post1")
    req = tmp_path / "requirements-gpu.txt"
    req.write_text("alpha==1.0\nbeta-pkg==2.0.post1\n")
    built, downloaded = wh.build("gpu", requirements=req, root=tmp_path / "root", env=offline_pip(dist))
    assert downloaded and built.path == tmp_path / "root" / f"gpu-{wh.key('gpu', wh.Target(), req)}"
    lock = (built.path / wh.LOCK).read_text().splitlines()
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dist.glob("*.whl")}
    assert [line for line in lock if not line.startswith("#")] == [
        f"alpha==1.0 --hash=sha256:{sha['alpha-1.0-py3-none-any.whl']}  # alpha-1.0-py3-none-any.whl",
        f"beta-pkg==2.0.post1 --hash=sha256:{sha['Beta_Pkg-2.0.post1-py3-none-any.whl']}  "
        "# Beta_Pkg-2.0.post1-py3-none-any.whl"]
    assert built.lock_sha256 == hashlib.sha256((built.path / wh.LOCK).read_bytes()).hexdigest()
    assert (built.wheels, built.python, built.prefix) == (2, "3.11", f"wheelhouse/gpu-{built.key}/")
    assert list((tmp_path / "root").iterdir()) == [built.path]  # no incoming directory left
    # pip's own hash-checking mode installs exactly the locked files from it, offline.
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(built.path),
                           "--require-hashes", "--only-binary=:all:", "--target", str(target), "-r",
                           str(built.path / wh.LOCK)], env=offline_pip(tmp_path / "nothing"), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert (target / "alpha/__init__.py").is_file() and (target / "Beta_Pkg/__init__.py").is_file()
    shutil.rmtree(dist)  # cached: nothing is downloaded again
    again, downloaded = wh.build("gpu", requirements=req, root=tmp_path / "root", env=offline_pip(dist))
    assert not downloaded and again == built


def test_a_requirement_without_a_wheel_stops_the_build_in_one_line(tmp_path):
    dist = tmp_path / "dist"
    dist.mkdir()
    with tarfile.open(dist / "onlysdist-1.0.tar.gz", "w:gz") as tar:  # an sdist: nothing for the nodes
        info = tarfile.TarInfo("onlysdist-1.0/setup.py")
        tar.addfile(info)
    req = tmp_path / "requirements-gpu.txt"
    req.write_text("onlysdist==1.0\n")
    with pytest.raises(wh.WheelhouseError) as err:
        wh.build("gpu", requirements=req, root=tmp_path / "root", env=offline_pip(dist))
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("make wheelhouse gpu: pip download of requirements-gpu.txt for CPython 3.11 "
                                     "manylinux_2_35_x86_64 failed: ERROR: ")
    assert "onlysdist==1.0" in str(err.value)
    assert not (tmp_path / "root").exists() or list((tmp_path / "root").iterdir()) == []


def test_a_build_python_other_than_the_nodes_is_refused(tmp_path):
    """Markers are resolved for the interpreter pip runs in; a 3.12 must not build a 3.11 wheelhouse."""
    other = tmp_path / "python3.12"
    other.write_text("#!/bin/sh\necho 3.12\n")  # answers the version question as a Python 3.12 would
    other.chmod(0o755)
    req = tmp_path / "requirements-gpu.txt"
    req.write_text("alpha==1.0\n")
    with pytest.raises(wh.WheelhouseError, match=r"^make wheelhouse: this pip runs on Python 3\.12 but the nodes' "
                                                 r"envs use 3\.11, and pip resolves environment markers"):
        wh.build("gpu", requirements=req, root=tmp_path / "root", python=str(other))
    with pytest.raises(wh.WheelhouseError, match=r"^make wheelhouse: cannot run "):
        wh.build("gpu", requirements=req, root=tmp_path / "root", python=str(tmp_path / "no-python"))


def check(directory: Path, lock_sha256: str | None = None) -> subprocess.CompletedProcess:
    """The node's check, with the AMI-like interpreter (no venv, standard library only)."""
    args = [sys.executable, "-I", str(CHECK), "check", str(directory)]
    return subprocess.run(args + (["--lock-sha256", lock_sha256] if lock_sha256 else []), capture_output=True,
                          text=True)


def test_the_node_check_names_every_missing_or_altered_wheel_in_one_line(tmp_path):
    path = stand_in_wheelhouse(tmp_path, "gpu", ("torch", "numpy", "pillow"))
    built = wh.load("gpu", root=tmp_path)
    ok = check(path, built.lock_sha256)
    assert ok.returncode == 0 and ok.stdout == f"wheelhouse {path}: 3 wheels, each present with its sha256\n"
    (path / "numpy-0.0.0-py3-none-any.whl").unlink()
    (path / "torch-0.0.0-py3-none-any.whl").unlink()
    missing = check(path, built.lock_sha256)
    assert missing.returncode == 1 and missing.stderr == (
        f"wheelhouse {path} lacks 2 of 3 wheels in requirements.lock: numpy-0.0.0-py3-none-any.whl, "
        "torch-0.0.0-py3-none-any.whl; rebuild it (make wheelhouse) and redeploy the cluster stack\n")
    with (path / "pillow-0.0.0-py3-none-any.whl").open("ab") as f:
        f.write(b"x")
    shutil.copy(path / "pillow-0.0.0-py3-none-any.whl", path / "numpy-0.0.0-py3-none-any.whl")
    shutil.copy(path / "pillow-0.0.0-py3-none-any.whl", path / "torch-0.0.0-py3-none-any.whl")
    altered = check(path)
    assert altered.returncode == 1 and altered.stderr.count("\n") == 1
    assert "numpy-0.0.0-py3-none-any.whl, pillow-0.0.0-py3-none-any.whl, torch-0.0.0-py3-none-any.whl do not " \
           "match their sha256 in requirements.lock" in altered.stderr
    other = check(path, "f" * 64)
    assert other.returncode == 1 and "the deployed package names ffffffffffff" in other.stderr
    (path / wh.LOCK).unlink()
    assert "has no requirements.lock" in check(path).stderr


def test_upload_parts_keep_each_part_under_the_limit_and_the_lock_first(tmp_path):
    incoming = tmp_path / ".incoming"
    incoming.mkdir()
    for name, size in (("a", 300), ("b", 300), ("c", 2500), ("d", 100)):  # a + b fit one part, c does not
        wheel(incoming, name, size=size)
    built = wh.finish(incoming, kind="gpu", target=wh.Target(), root=tmp_path, requirements=REPO / "training" /
                      "requirements-gpu.txt")
    sizes = {p.name: p.stat().st_size for p in built.path.glob("*.whl")}
    parts = built.upload_parts(max_bytes=2100)
    assert parts[0][:2] == [wh.LOCK, wh.MANIFEST]
    assert sorted(n for part in parts for n in part if n.endswith(".whl")) == sorted(sizes)
    for part in parts:
        wheels = [n for n in part if n.endswith(".whl")]
        assert sum(sizes[n] for n in wheels) <= 2100 or len(wheels) == 1, part  # a big wheel travels alone
    assert parts == [[wh.LOCK, wh.MANIFEST, "a-1.0-py3-none-any.whl", "b-1.0-py3-none-any.whl"],
                     ["c-1.0-py3-none-any.whl"], ["d-1.0-py3-none-any.whl"]], sizes


def test_each_upload_part_carries_exactly_its_files(tmp_path):
    """The parts are CDK assets of the one wheelhouse directory, each excluding every other file
    (stacks/wheelhouse_upload.py); what CDK stages for each is what its deployment copies."""
    import json

    import aws_cdk as cdk
    from aws_cdk import aws_s3 as s3

    from stacks.wheelhouse_upload import WheelhouseUpload

    incoming = tmp_path / ".incoming"
    incoming.mkdir()
    for name, size in (("a", 300), ("b", 300), ("c", 2500), ("d", 100)):
        wheel(incoming, name, size=size)
    built = wh.finish(incoming, kind="gpu", target=wh.Target(), root=tmp_path,
                      requirements=REPO / "training" / "requirements-gpu.txt")
    app = cdk.App(outdir=str(tmp_path / "out"))
    stack = cdk.Stack(app, "parts")
    WheelhouseUpload(stack, "Wheelhouses", wheelhouses={"gpu": built},
                     bucket=s3.Bucket.from_bucket_name(stack, "Lifecycle", "sagemaker-x-lc"), part_bytes=2100)
    app.synth()
    template = json.loads((tmp_path / "out" / "parts.template.json").read_text())
    staged = []
    for resource in template["Resources"].values():
        if resource["Type"] != "Custom::CDKBucketDeployment":
            continue
        props = resource["Properties"]
        assert props["DestinationBucketKeyPrefix"] == built.prefix and props["Prune"] is False
        (key,) = props["SourceObjectKeys"]
        staged.append(sorted(p.name for p in (tmp_path / "out" / f"asset.{key.removesuffix('.zip')}").iterdir()))
    assert sorted(staged) == sorted(sorted(part) for part in built.upload_parts(2100))


def test_versions_an_online_build_would_pick_differently_stop_the_build_in_one_line(tmp_path):
    """gamma 1.1 has a wheel only for this machine's newer glibc: an online pip here takes 1.1, the
    nodes' wheelhouse (one glibc older) can only take 1.0. Such a set is refused, naming gamma."""
    import packaging._manylinux as manylinux

    major, minor = manylinux._get_glibc_version()
    dist = tmp_path / "dist"
    dist.mkdir()
    wheel(dist, "gamma", "1.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    wheel(dist, "gamma", "1.1", tag=f"cp311-cp311-manylinux_{major}_{minor}_x86_64")
    req = tmp_path / "requirements-gpu.txt"
    req.write_text("gamma>=1.0\n")
    with pytest.raises(wh.WheelhouseError) as err:
        wh.build("gpu", wh.Target(glibc=f"{major}.{minor - 1}"), requirements=req, root=tmp_path / "root",
                 env=offline_pip(dist))
    assert str(err.value) == ("make wheelhouse gpu: an online build would install other versions than the wheels "
                              "for the nodes (gamma 1.1 online, 1.0 as a wheel): pin them in "
                              "training/requirements-gpu.txt to versions that have wheels")
    assert list((tmp_path / "root").iterdir()) == []
