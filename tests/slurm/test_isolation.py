"""Two researchers on one cluster: user B cannot make user A's job load B's weights, compile
cache or image (issue 24). Real jobs on the fixture's Slurm daemons, as the two unprivileged
users of the fixture (same cluster group), on an FSx laid out by the real shared_dirs.sh.

Each attack is first made where the old layout let it succeed (a run directory keyed by the job
name alone, a group-writable image store reused by name, a compile cache the first user owned),
then A's job is shown to read only A's own directories, or to refuse in one line.
"""

# ruff: noqa: F811  (pytest fixtures: `site` is imported from test_train_jobs and requested by name)
from __future__ import annotations

import os
import shutil
import subprocess
from typing import TYPE_CHECKING

import pytest

from tests.slurm.conftest import skip_unless_required
from tests.slurm.test_train_jobs import (  # noqa: F401  (site: the shared fixture)
    JOB_TIMEOUT,
    complete_checkpoints,
    job_failure,
    site,
    submit,
)

if TYPE_CHECKING:
    from tests.slurm.conftest import JobUser, SlurmCluster
    from tests.slurm.test_train_jobs import Site

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REGISTRY = "123456789012.dkr.ecr.us-east-1.amazonaws.com"
TAG = "0123456789abcdef-89abcdef"
DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def two_users(site: Site) -> tuple[JobUser, JobUser]:
    if site.user is None or site.other is None:
        skip_unless_required("the isolation tests need two unprivileged users (run as root with useradd)")
    return site.user, site.other


def as_user(user: JobUser, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user.name, "--", *argv], capture_output=True, text=True, timeout=60)


def train(cluster: SlurmCluster, site: Site, user: JobUser, job_name: str, steps: int) -> tuple[int, str]:
    job_id = submit(cluster, site, "train-gpu.sbatch", str(site.tiny), "--set", f"data.path={site.features}",
                    "--set", "checkpoint.every_steps=2", "--max-steps", str(steps), job_name=job_name,
                    env=site.env(SANA_NPROC_PER_NODE="1"), user=user)
    info = cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(cluster, site, info, job_name, job_id)
    return job_id, (site.log_dir(job_name, job_id, user=user.name) / "job.log").read_text()


def failed_job(cluster: SlurmCluster, site: Site, user: JobUser, job_name: str, **env: str) -> str:
    """A job of ``user`` that must fail before any task starts; its Slurm output."""
    job_id = submit(cluster, site, "train-gpu.sbatch", str(site.tiny), job_name=job_name,
                    env=site.env(SANA_NPROC_PER_NODE="1", **env), user=user)
    info = cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "FAILED", info
    return site.slurm_out(job_name, job_id, user=user.name).read_text()


def test_b_cannot_plant_the_weights_that_as_resume_loads(slurm_cluster: SlurmCluster, site: Site, two_users):
    a, b = two_users
    name = "shared-name"  # the job name both pick (train-gpu.sbatch's default is the same for everyone)
    # B cannot write into A's run tree, nor make A's run directory before A does.
    assert as_user(b, "mkdir", str(site.run_dir(name, user=a.name))).returncode != 0
    assert as_user(b, "touch", str(site.fsx / "artefacts/checkpoints" / a.name / "planted")).returncode != 0
    # B trains a run under the same job name: it lands in B's own tree.
    _, _ = train(slurm_cluster, site, b, name, steps=4)
    assert complete_checkpoints(site.run_dir(name, user=b.name)) == [2, 4]
    # A's job of that name starts from scratch in A's tree: `--resume auto` saw nothing of B's.
    _, log = train(slurm_cluster, site, a, name, steps=2)
    assert "from step 0 to 2" in log, log[-3000:]
    assert complete_checkpoints(site.run_dir(name, user=a.name)) == [2]
    assert site.run_dir(name, user=a.name).stat().st_uid == a.uid
    assert f"run dir (checkpoints) {site.run_dir(name, user=a.name)}" in log


def test_b_cannot_plant_the_compile_cache_as_job_loads(slurm_cluster: SlurmCluster, site: Site, two_users):
    a, b = two_users
    for tree in ("cache/inductor", "cache/neuron"):
        assert as_user(b, "touch", str(site.fsx / tree / a.name / "planted.py")).returncode != 0, tree
        assert as_user(b, "mkdir", str(site.fsx / tree / "someone-new")).returncode != 0, tree
    # A's job names A's own cache (training/model/compile.py's default is <fsx>/cache/inductor/$USER).
    log = failed_job(slurm_cluster, site, a, "cache-ok", SANA_CONTAINER_IMAGE="/nonexistent.sqsh")
    assert "no such file" in log  # stops before any task; the cache was checked first
    # A cache directory of A's that B controls (an old layout's leftover): A's job refuses it.
    victim = site.fsx / "cache/inductor" / a.name
    os.chown(victim, b.uid, b.gid)
    try:
        log = failed_job(slurm_cluster, site, a, "cache-planted")
    finally:
        os.chown(victim, a.uid, a.gid)
    assert f"launch.sh: {victim} is not yours alone" in log, log[-2000:]


@pytest.fixture
def image_store(site: Site):
    """The root-owned store lifecycle_scripts/container_runtime.sh makes, with one image root
    imported (what import_image.sh leaves: the .sqsh by digest and the tag's index)."""
    store = site.fsx / "images"
    (store / "by-tag" / REGISTRY / "sana" / "sana-gpu").mkdir(parents=True, exist_ok=True)
    for path in (store, *store.rglob("*")):
        path.chmod(0o755)
    yield store
    shutil.rmtree(store)


def test_b_cannot_make_as_job_run_bs_image(slurm_cluster: SlurmCluster, site: Site, two_users, image_store):
    a, b = two_users
    uri = f"{REGISTRY}/sana/sana-gpu:{TAG}"
    # The old import reused <images>/<repo>-<tag>.sqsh from a store every user could write.
    for planted in (image_store / f"sana-gpu-{TAG}.sqsh", image_store / f"sha256-{DIGEST}.sqsh",
                    image_store / "by-tag" / REGISTRY / "sana" / "sana-gpu" / TAG):
        assert as_user(b, "sh", "-c", f"echo evil > {planted}").returncode != 0, planted
    # Not imported (by root) yet: A's job refuses, and never imports anything itself.
    log = failed_job(slurm_cluster, site, a, "img-missing", SANA_CONTAINER_IMAGE=uri)
    assert (f"launch.sh: SANA_CONTAINER_IMAGE={uri}: not imported on this cluster; the platform team imports "
            f"it: sudo bash /fsx/platform/current/lifecycle/import_image.sh {uri}") in log, log[-2000:]
    # An image B wrote where A can read it (the shared data tree): A's job refuses to run it.
    evil = site.fsx / "data" / "evil.sqsh"
    assert as_user(b, "sh", "-c", f"echo hsqs > {evil}").returncode == 0
    log = failed_job(slurm_cluster, site, a, "img-foreign", SANA_CONTAINER_IMAGE=str(evil))
    assert f"launch.sh: SANA_CONTAINER_IMAGE={evil}: not an image only you or root can change ({evil} belongs " \
           f"to uid {b.uid})" in log, log[-2000:]
    # A store entry that is not root's (a store left group-writable): refused too.
    index = image_store / "by-tag" / REGISTRY / "sana" / "sana-gpu" / TAG
    index.write_text(f"sha256:{DIGEST}\n")
    sqsh = image_store / f"sha256-{DIGEST}.sqsh"
    sqsh.write_text("hsqs")
    os.chown(sqsh, b.uid, b.gid)
    log = failed_job(slurm_cluster, site, a, "img-chowned", SANA_CONTAINER_IMAGE=uri)
    assert f"launch.sh: SANA_CONTAINER_IMAGE={uri}: {sqsh} is not root's ({sqsh} belongs to uid {b.uid})" in log
