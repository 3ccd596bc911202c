"""lifecycle_scripts/rollout.sh on the pretend cluster against the loopback S3 (moto's server).

A cluster booted with package pkg0001 is rolled onto pkg0002, uploaded the way the cluster
stack uploads it (lifecycle/<hash>/: the scripts, platform-settings.json, training/). The
rollout runs from where rollout.sbatch runs it: the lifecycle copy inside the current
package on FSx.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lifecycle_cluster import Cluster, make_bundle, upload_bundle

ROLLOUT_LINE = re.compile(r"^\S+Z \[rollout\] (ROLLED OUT|PENDING|FAILED)\b(.*)$")


def rollout(c: Cluster, node: str, target: str) -> tuple[subprocess.CompletedProcess, str, str]:
    """Run rollout.sh on NODE as rollout.sbatch does; returns (result, outcome, rest of the last line)."""
    script = c.fsx / "platform/current/lifecycle/rollout.sh"
    # boto3 from an env: the platform env on a node; here this test's interpreter (the stand-in
    # envs hold only stand-in torch wheels).
    result = subprocess.run(["bash", str(script), target], env=c.env(node, ROLLOUT_PYTHON=sys.executable),
                            capture_output=True, text=True, timeout=300)
    lines = result.stdout.strip().splitlines()
    assert result.stderr == "", result.stderr
    assert lines and [line for line in lines if ROLLOUT_LINE.match(line)] == lines[-1:], result.stdout[-3000:]
    match = ROLLOUT_LINE.match(lines[-1])
    return result, match.group(1), match.group(2)


def package_version(path: Path) -> str:
    return re.search(r'VERSION = "(\w+)"', (path / "training/__init__.py").read_text()).group(1)


def boot(c: Cluster) -> Cluster:
    """gpu-1 and trn-1 provisioned with the cluster's package (pkg0001), at the same time."""
    procs = {node: c.start(node) for node in ("gpu-1", "trn-1")}
    for proc in procs.values():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
    return c


@pytest.fixture
def booted(make_cluster) -> Cluster:
    return boot(make_cluster(package_hash="pkg0001"))


@pytest.fixture(scope="module")
def shared_booted(tmp_path_factory, standins, wheels) -> Cluster:
    """One booted cluster for the tests whose rollout must change nothing."""
    base = tmp_path_factory.mktemp("rollout")
    return boot(Cluster(base, make_bundle(base / "bundle", wheels, package_hash="pkg0001"), standins))


@pytest.mark.slow
def test_rollout_flips_current_keeps_the_old_package_and_is_idempotent(booted, wheels, s3_endpoint, s3_bucket):
    c = booted
    envs = c.fsx / "envs"
    old_gpu, old_neuron = os.readlink(envs / "gpu"), os.readlink(envs / "neuron")
    # What a job running now resolved at its start (launch.sh: readlink -f, once per job).
    running_package = (c.fsx / "platform/current").resolve()
    running_env = (envs / "gpu").resolve()
    new = make_bundle(c.base / "bundle-pkg0002", wheels, package_hash="pkg0002",
                      gpu_requirements=f"# pkg0002 changes the GPU requirements\n{wheels['torch']}\n")
    upload_bundle(new, s3_endpoint, s3_bucket, "lifecycle/pkg0002/")
    uri = f"s3://{s3_bucket}/lifecycle/pkg0002/"

    # On a GPU node: fetch + the new GPU env; current waits for the Neuron side.
    result, outcome, rest = rollout(c, "gpu-1", uri)
    assert outcome == "PENDING", result.stdout[-3000:]
    assert "current stays pkg0001 until the neuron env is ready" in rest and "trn node" in rest
    assert os.readlink(c.fsx / "platform/current") == "pkg0001"
    assert os.readlink(envs / "gpu") == old_gpu  # built beside the old one, not switched yet
    new_gpu = [p.name for p in envs.glob("gpu-*") if p.name != old_gpu]
    assert len(new_gpu) == 1 and (envs / new_gpu[0] / ".sana-env-ready").exists()
    assert package_version(c.fsx / "platform/pkg0002") == "pkg0002"
    assert (c.fsx / "platform/pkg0002/lifecycle/rollout.sh").exists()
    assert (c.fsx / "platform/pkg0002").stat().st_mode & 0o777 == 0o755

    # On a trn node: the Neuron requirements did not change, so nothing is built; then the flip.
    result, outcome, rest = rollout(c, "trn-1", uri)
    assert outcome == "ROLLED OUT", result.stdout[-3000:]
    assert "building env" not in result.stdout and "already built and ready" in result.stdout
    assert os.readlink(c.fsx / "platform/current") == "pkg0002"
    assert (os.readlink(envs / "gpu"), os.readlink(envs / "neuron")) == (new_gpu[0], old_neuron)
    assert f"current -> pkg0002 (was pkg0001), gpu->{new_gpu[0]} neuron->{old_neuron}" in rest
    # The running job's resolved paths are untouched.
    assert package_version(running_package) == "pkg0001" and (running_env / ".sana-env-ready").exists()
    assert not list((c.fsx / "platform").glob(".incoming-*"))
    # What a job starting now imports: the new package, through the env's .pth.
    out = subprocess.run([str(envs / "gpu/bin/python"), "-I", "-c", "import training; print(training.VERSION)"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "pkg0002"

    # Again, from either node: nothing fetched, nothing built, nothing moved.
    before = {p: os.readlink(p) for p in (c.fsx / "platform/current", envs / "gpu", envs / "neuron")}
    for node in ("gpu-1", "trn-1"):
        result, outcome, _ = rollout(c, node, uri)
        assert outcome == "ROLLED OUT" and "package pkg0002 is already at" in result.stdout
        assert "building env" not in result.stdout and "fetched" not in result.stdout
    assert {p: os.readlink(p) for p in before} == before
    assert sorted(p.name for p in (c.fsx / "platform").iterdir() if not p.name.startswith(".")) == \
        ["current", "pkg0001", "pkg0002"]


@pytest.mark.parametrize("target,expected", [
    ("s3://{bucket}/lifecycle/nohash/",
     r"s3://{bucket}/lifecycle/nohash/ holds no objects: no package was uploaded under that hash; "
     r"`cdk deploy` uploads it \(list the hashes with: aws s3 ls s3://{bucket}/lifecycle/\)"),
    ("s3://no-such-bucket-here/lifecycle/pkg0002/",
     r"cannot read s3://no-such-bucket-here/lifecycle/pkg0002/: NoSuchBucket: .+"),
    ("s3:/typo/pkg0002", r"'s3:/typo/pkg0002' is neither a package hash nor an s3:// prefix"),
])
def test_bad_prefix_fails_in_one_line_and_changes_nothing(shared_booted, s3_endpoint, s3_bucket, target, expected):
    c = shared_booted
    result, outcome, rest = rollout(c, "gpu-1", target.format(bucket=s3_bucket))
    assert (result.returncode, outcome) == (1, "FAILED")
    assert re.fullmatch(": " + expected.format(bucket=re.escape(s3_bucket)), rest), rest
    assert os.readlink(c.fsx / "platform/current") == "pkg0001"
    assert sorted(p.name for p in (c.fsx / "platform").iterdir() if not p.name.startswith(".")) == ["current", "pkg0001"]
    assert not list((c.fsx / "platform").glob(".incoming-*"))


def test_prefix_holding_another_hash_is_refused(shared_booted, wheels, s3_endpoint, s3_bucket):
    """A prefix whose settings name another package (copied by hand, a typo'd key) is not installed."""
    c = shared_booted
    upload_bundle(make_bundle(c.base / "bundle-x", wheels, package_hash="pkg0003"), s3_endpoint, s3_bucket, "lifecycle/pkg0002/")
    result, outcome, rest = rollout(c, "gpu-1", "pkg0002".join(["s3://" + s3_bucket + "/lifecycle/", "/"]))
    assert outcome == "FAILED" and "holds the package of hash pkg0003, not pkg0002" in rest
    assert not (c.fsx / "platform/pkg0002").exists() and not list((c.fsx / "platform").glob(".incoming-*"))
    assert os.readlink(c.fsx / "platform/current") == "pkg0001"
