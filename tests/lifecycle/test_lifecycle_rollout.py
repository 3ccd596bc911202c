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
from lifecycle_cluster import Cluster, bundle_hash, make_bundle, upload_bundle

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


def upload_new(c: Cluster, wheels, endpoint: str, bucket: str, label: str, **kwargs) -> tuple[Path, str]:
    """A new package as `cdk deploy` uploads it: under lifecycle/<its content hash>/."""
    bundle = make_bundle(c.base / f"bundle-{label}", wheels, package_hash=label, content_hash=True, **kwargs)
    h = bundle_hash(bundle)
    upload_bundle(bundle, endpoint, bucket, f"lifecycle/{h}/")
    return bundle, h


@pytest.fixture
def booted(make_cluster) -> Cluster:
    return boot(make_cluster(package_hash="pkg0001"))


@pytest.fixture(scope="module")
def shared_booted(tmp_path_factory, standins, wheels) -> Cluster:
    """One booted cluster for the tests whose rollout must change nothing."""
    base = tmp_path_factory.mktemp("rollout")
    return boot(Cluster(base, make_bundle(base / "bundle", wheels, package_hash="pkg0001"), standins))


@pytest.mark.slow
def test_rollout_flips_current_keeps_the_old_package_and_is_idempotent(booted, wheels, s3_endpoint, lifecycle_bucket):
    c = booted
    envs = c.fsx / "envs"
    old_gpu, old_neuron = os.readlink(envs / "gpu"), os.readlink(envs / "neuron")
    # What a job running now resolved at its start (launch.sh: readlink -f, once per job).
    running_package = (c.fsx / "platform/current").resolve()
    running_env = (envs / "gpu").resolve()
    _, new = upload_new(c, wheels, s3_endpoint, lifecycle_bucket, "pkg0002",
                        gpu_requirements=f"# pkg0002 changes the GPU requirements\n{wheels['torch']}\n")
    uri = f"s3://{lifecycle_bucket}/lifecycle/{new}/"

    # On a GPU node: fetch + the new GPU env; current waits for the Neuron side.
    result, outcome, rest = rollout(c, "gpu-1", uri)
    assert outcome == "PENDING", result.stdout[-3000:]
    assert "current stays pkg0001 until the neuron env is ready" in rest and "trn node" in rest
    assert os.readlink(c.fsx / "platform/current") == "pkg0001"
    assert os.readlink(envs / "gpu") == old_gpu  # built beside the old one, not switched yet
    new_gpu = [p.name for p in envs.glob("gpu-*") if p.name != old_gpu]
    assert len(new_gpu) == 1 and (envs / new_gpu[0] / ".sana-env-ready").exists()
    assert package_version(c.fsx / f"platform/{new}") == "pkg0002"
    assert (c.fsx / f"platform/{new}/lifecycle/rollout.sh").exists()
    assert (c.fsx / f"platform/{new}").stat().st_mode & 0o777 == 0o755

    # On a trn node, with the bare hash: the Neuron requirements did not change, so nothing is built; then the flip.
    result, outcome, rest = rollout(c, "trn-1", new)
    assert outcome == "ROLLED OUT", result.stdout[-3000:]
    assert "building env" not in result.stdout and "already built and ready" in result.stdout
    assert os.readlink(c.fsx / "platform/current") == new
    assert (os.readlink(envs / "gpu"), os.readlink(envs / "neuron")) == (new_gpu[0], old_neuron)
    assert f"current -> {new} (was pkg0001), gpu->{new_gpu[0]} neuron->{old_neuron}" in rest
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
        assert outcome == "ROLLED OUT" and f"package {new} is already at" in result.stdout
        assert "building env" not in result.stdout and "fetched" not in result.stdout
    assert {p: os.readlink(p) for p in before} == before
    assert sorted(p.name for p in (c.fsx / "platform").iterdir() if not p.name.startswith(".")) == \
        sorted(["current", "pkg0001", new])


HASH = "0123456789abcdef"


@pytest.mark.parametrize("target,expected", [
    ("s3://{bucket}/lifecycle/" + HASH + "/",
     r"s3://{bucket}/lifecycle/" + HASH + r"/ holds no objects: no package was uploaded under that hash; "
     r"`cdk deploy` uploads it \(list the hashes with: aws s3 ls s3://{bucket}/lifecycle/\)"),
    ("s3:/typo/" + HASH, r"'s3:/typo/" + HASH + r"' is neither a package hash \(16 hex digits, the end of the "
     r"cluster stack's LifecycleUri output\) nor an s3:// prefix"),
    ("pkg0002", r"'pkg0002' is neither a package hash .*"),
])
def test_bad_prefix_fails_in_one_line_and_changes_nothing(shared_booted, lifecycle_bucket, target, expected):
    c = shared_booted
    result, outcome, rest = rollout(c, "gpu-1", target.format(bucket=lifecycle_bucket))
    assert (result.returncode, outcome) == (1, "FAILED")
    assert re.fullmatch(": " + expected.format(bucket=re.escape(lifecycle_bucket)), rest), rest
    assert_nothing_installed(c)


def assert_nothing_installed(c: Cluster) -> None:
    assert os.readlink(c.fsx / "platform/current") == "pkg0001"
    assert sorted(p.name for p in (c.fsx / "platform").iterdir() if not p.name.startswith(".")) == ["current", "pkg0001"]
    assert not list((c.fsx / "platform").glob(".incoming-*"))


@pytest.mark.parametrize("where", ["another bucket", "another prefix", "a deeper prefix"])
def test_a_prefix_outside_this_clusters_lifecycle_bucket_is_refused_before_any_fetch(
        shared_booted, wheels, s3_endpoint, s3_bucket, lifecycle_bucket, where):
    """A package anyone else could have written (another bucket, or elsewhere in this one) is never
    fetched: root would run its pip and its code for every later job."""
    c = shared_booted
    bundle = make_bundle(c.base / f"bundle-foreign-{where.replace(' ', '-')}", wheels, package_hash="evil",
                         content_hash=True)
    h = bundle_hash(bundle)
    bucket, key = {"another bucket": (s3_bucket, f"lifecycle/{h}/"),
                   "another prefix": (lifecycle_bucket, f"uploads/{h}/"),
                   "a deeper prefix": (lifecycle_bucket, f"lifecycle/x/{h}/")}[where]
    upload_bundle(bundle, s3_endpoint, bucket, key)
    result, outcome, rest = rollout(c, "gpu-1", f"s3://{bucket}/{key}")
    assert outcome == "FAILED" and rest == (
        f": 's3://{bucket}/{key}' is not this cluster's lifecycle prefix s3://{lifecycle_bucket}/lifecycle/<hash>/; "
        "the rollout installs only packages `cdk deploy` uploaded there (the cluster stack's LifecycleUri output)")
    assert "fetch" not in result.stdout
    assert_nothing_installed(c)


def test_prefix_holding_another_hash_is_refused(shared_booted, wheels, s3_endpoint, lifecycle_bucket):
    """A prefix whose settings name another package (copied by hand, a typo'd key) is not installed."""
    c = shared_booted
    other = make_bundle(c.base / "bundle-x", wheels, package_hash="pkg0003", content_hash=True)
    upload_bundle(other, s3_endpoint, lifecycle_bucket, f"lifecycle/{HASH}/")
    result, outcome, rest = rollout(c, "gpu-1", f"s3://{lifecycle_bucket}/lifecycle/{HASH}/")
    assert outcome == "FAILED" and f"holds the package of hash {bundle_hash(other)}, not {HASH}" in rest
    assert not (c.fsx / f"platform/{HASH}").exists()
    assert_nothing_installed(c)


@pytest.mark.parametrize("tamper", ["changed file", "extra test file"])
def test_content_that_does_not_hash_to_the_prefix_is_refused(shared_booted, wheels, s3_endpoint, lifecycle_bucket,
                                                             tamper):
    """Files changed after `cdk deploy` (or added under a name the stack never uploads) under a
    genuine prefix: the recomputed hash differs, nothing is installed."""
    import boto3

    c = shared_booted
    bundle = make_bundle(c.base / f"bundle-t-{tamper.replace(' ', '-')}", wheels, package_hash="pkg0004",
                         content_hash=True)
    h = bundle_hash(bundle)
    if tamper == "changed file":
        (bundle / "training/__init__.py").write_text('VERSION = "pkg0004"\nimport os; os.system("id")\n')
    else:
        (bundle / "training/tests").mkdir()
        (bundle / "training/tests/conftest.py").write_text("import os\n")
    prefix = f"lifecycle/{h}/"
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for obj in s3.list_objects_v2(Bucket=lifecycle_bucket, Prefix=prefix).get("Contents", []):
        s3.delete_object(Bucket=lifecycle_bucket, Key=obj["Key"])
    upload_bundle(bundle, s3_endpoint, lifecycle_bucket, prefix)
    result, outcome, rest = rollout(c, "gpu-1", h)
    assert outcome == "FAILED", result.stdout[-2000:]
    if tamper == "changed file":
        assert re.fullmatch(rf": s3://{lifecycle_bucket}/{prefix} holds files whose content hash is [0-9a-f]{{16}}, "
                            rf"not {h}: changed after `cdk deploy` uploaded them; nothing was installed", rest), rest
    else:
        assert rest == (f": s3://{lifecycle_bucket}/{prefix} holds '{prefix}training/tests/conftest.py', a name the "
                        "cluster stack never uploads (caches, tests, hidden files); it was not uploaded by `cdk deploy`")
    assert not (c.fsx / f"platform/{h}").exists()
    assert_nothing_installed(c)


def test_the_rollout_writes_only_in_root_only_directories(shared_booted):
    """Where rollout.sh and rollout.sbatch's output write, no cluster user can put a link first."""
    c = shared_booted
    for rel in ("platform", "platform/.locks", "envs", "envs/.locks", "logs/root"):
        st = (c.fsx / rel).stat()
        assert st.st_uid == 0 and not st.st_mode & 0o022, rel
    header = (Path(__file__).parents[2] / "training/slurm/rollout.sbatch").read_text()
    assert "#SBATCH --output=/fsx/logs/%u/%x-%j.out\n" in header  # %u = root for `sudo sbatch`
