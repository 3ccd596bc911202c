"""One training job through launch.sh's container path (SANA_CONTAINER_IMAGE), on the real
Slurm daemons of the fixture.

pyxis and enroot are not installable here (pyxis is a SPANK plugin built against the cluster's
Slurm; enroot needs its own setuid/caps packages), so two stand-ins on the job's PATH show the
real arguments and fail the way the real tools would:

- ``srun``: records its full argv, then validates the pyxis options as pyxis does (only options
  pyxis defines; the image must be a squashfs file, enroot create reads it; every mount source
  must exist, or enroot's mount fails) and runs the task with the REAL srun, the pyxis options
  removed, and the image's environment (its package root and package-hash variable) applied.
- ``enroot``: ``enroot import --output FILE docker://REGISTRY#IMAGE:sha256:DIGEST`` (the digest
  form lifecycle_scripts/import_image.sh uses) writes a real squashfs (mksquashfs) and counts
  imports. The import is root's (import_image.sh run for real against moto's ECR, which resolves
  the tag to its digest); jobs only run what the root-owned store holds and never import.

The image the job runs is the real training package + the tests' venv laid out as the image
(containers/*.Dockerfile: /opt/sana/training and /opt/sana/venv). Building a real image and
training in it is tests/containers/test_image_build.py.
"""

# ruff: noqa: F811  (pytest fixtures: `site` is imported from test_train_jobs and requested by name)
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
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
    from tests.slurm.conftest import SlurmCluster
    from tests.slurm.test_train_jobs import Site

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LIFECYCLE = Path(__file__).resolve().parents[2] / "lifecycle_scripts"
REGISTRY = "123456789012.dkr.ecr.us-east-1.amazonaws.com"
TAG = "0123456789abcdef-89abcdef"
MAX_STEPS = 8

# The options pyxis registers (NVIDIA/pyxis pyxis/args.c, its README "Usage"): anything else
# starting with --container is an unknown srun option.
SRUN_SHIM = r"""#!/bin/bash
set -euo pipefail
printf '%s\n' "$@" >"$PYXIS_RECORD"
image="" mounts=""
args=()
for arg in "$@"; do
  case $arg in
    --container-image=*) image=${arg#*=} ;;
    --container-mounts=*) mounts=${arg#*=} ;;
    --container-workdir=* | --container-name=* | --container-env=* | --container-save=*) ;;
    --container-mount-home | --no-container-mount-home | --container-remap-root | --no-container-remap-root) ;;
    --container-entrypoint | --no-container-entrypoint | --container-writable | --container-readonly) ;;
    --container-*) echo "srun: unrecognized option '$arg'" >&2; exit 1 ;;
    *) args+=("$arg") ;;
  esac
done
if [[ -n $image ]]; then
  [[ -f $image && $(head -c4 "$image") == hsqs ]] \
    || { echo "pyxis: failed to create container filesystem: $image is not a squashfs image" >&2; exit 1; }
  IFS=, read -ra entries <<<"$mounts"
  for entry in "${entries[@]}"; do
    [[ -e ${entry%%:*} ]] || { echo "pyxis: couldn't start container: mount source ${entry%%:*} missing" >&2; exit 1; }
  done
  # Where the image's package lives (containers/*.Dockerfile: /opt/sana) is this stand-in's root.
  export SANA_CONTAINER_ROOT=$PYXIS_IMAGE_ROOT
fi
exec "$REAL_SRUN" "${args[@]}"
"""

# enroot's reference grammar (NVIDIA/enroot src/docker.sh docker::import): docker://[USER@][REGISTRY#]IMAGE[:TAG]
# with TAG = [[:alnum:]._:-]+; the credentials file must be the private one import_image.sh wrote.
ENROOT_SHIM = r"""#!/bin/bash
set -euo pipefail
[[ $1 == import && $2 == --output ]] || { echo "enroot shim: unexpected $*" >&2; exit 1; }
[[ $4 =~ ^docker://[^/#]+#[a-z0-9/._-]+:sha256:[0-9a-f]{64}$ ]] || { echo "enroot: not a digest reference $4" >&2; exit 1; }
grep -q "^machine ${4#docker://}" <(sed 's/ login.*//; s/$/#/' "$ENROOT_CONFIG_PATH/.credentials") 2>/dev/null \
  || grep -q "^machine ${4%%#*}" <(sed 's|^machine |machine docker://|' "$ENROOT_CONFIG_PATH/.credentials") \
  || { echo "enroot: no credentials for ${4%%#*}" >&2; exit 1; }
echo "$4" >>"$ENROOT_IMPORTS"
mksquashfs "$PYXIS_IMAGE_ROOT" "$3" -all-root -comp lzo -noD -quiet -no-progress >/dev/null
"""


@pytest.fixture(scope="module")
def image_site(site: Site, s3_endpoint: str) -> dict:
    if not shutil.which("mksquashfs"):
        skip_unless_required("mksquashfs (squashfs-tools) not installed; run `make setup`")
    shims = site.root / "container-shims"
    shims.mkdir()
    for name, text in (("srun", SRUN_SHIM), ("enroot", ENROOT_SHIM)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    # The image's layout: /opt/sana/{training,venv}, here the installed package and the gpu env.
    image_root = site.root / "image-root"
    image_root.mkdir()
    (image_root / "training").symlink_to(site.package / "training")
    (image_root / "venv").symlink_to(site.envs["gpu"])
    (image_root / "image.env").write_text("SANA_IMAGE_PACKAGE_HASH=image-package-hash\n")  # containers/image.py
    images = site.fsx / "images"
    images.mkdir()  # the root-owned store, as container_runtime.sh makes it
    images.chmod(0o755)
    record = site.root / "pyxis-args"
    imports = site.root / "enroot-imports"
    for path in (record, imports):
        path.touch()
        path.chmod(0o666)
    digest = import_as_root(site, shims, image_root, imports, s3_endpoint)
    return {"shims": shims, "image_root": image_root, "images": images, "record": record, "imports": imports,
            "digest": digest}


def import_as_root(site: Site, shims, image_root, imports, endpoint: str) -> str:
    """The platform team's import: lifecycle_scripts/import_image.sh run for real as root, on a
    node state dir standing for a provisioned login node, against moto's ECR (the tag is pushed
    there first, as `make push-image` does); returns the digest ECR names for the tag."""
    import boto3

    ecr = boto3.client("ecr", endpoint_url=endpoint, region_name="us-east-1")
    if "sana/sana-gpu" not in {r["repositoryName"] for r in ecr.describe_repositories()["repositories"]}:
        ecr.create_repository(repositoryName="sana/sana-gpu")
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                           "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                                      "digest": "sha256:" + "1" * 64, "size": 1}, "layers": []})
    with contextlib.suppress(ecr.exceptions.ImageAlreadyExistsException):
        ecr.put_image(repositoryName="sana/sana-gpu", imageManifest=manifest, imageTag=TAG)
    node = site.root / "import-node"
    state = node / "var/lib/sana-platform"
    state.mkdir(parents=True)
    (state / "settings.env").write_text(f"export FSX={site.fsx}\nexport ENV_GPU_DIR={site.envs['gpu']}\n")
    (state / "node.env").write_text("export NODE_NAME=login-1 NODE_ROLE=login\n")
    env = dict(os.environ, PLATFORM_ROOT=str(node), PATH=f"{shims}:{os.environ['PATH']}", IMPORT_PYTHON=sys.executable,
               AWS_ENDPOINT_URL_ECR=endpoint, ENROOT_IMPORTS=str(imports), PYXIS_IMAGE_ROOT=str(image_root))
    done = subprocess.run(["bash", str(LIFECYCLE / "import_image.sh"), f"{REGISTRY}/sana/sana-gpu:{TAG}"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[import-image] IMPORTED" in done.stdout.strip().splitlines()[-1]
    return ecr.batch_get_image(repositoryName="sana/sana-gpu", imageIds=[{"imageTag": TAG}])["images"][0][
        "imageId"]["imageDigest"].removeprefix("sha256:")


def container_env(site: Site, image_site: dict, image: str | None = None) -> dict[str, str]:
    env = site.env(SANA_NPROC_PER_NODE="1", SANA_CONTAINER_IMAGE=image or f"{REGISTRY}/sana/sana-gpu:{TAG}")
    env.update(PATH=f"{image_site['shims']}:{env['PATH']}", REAL_SRUN=shutil.which("srun") or "srun",
               PYXIS_RECORD=str(image_site["record"]), PYXIS_IMAGE_ROOT=str(image_site["image_root"]),
               ENROOT_IMPORTS=str(image_site["imports"]))
    return env


def run_job(cluster: SlurmCluster, site: Site, image_site: dict, job_name: str, image: str | None = None) -> int:
    job_id = submit(cluster, site, "train-gpu.sbatch", str(site.tiny), "--set", f"data.path={site.features}",
                    "--set", "checkpoint.every_steps=4", "--max-steps", str(MAX_STEPS), job_name=job_name,
                    env=container_env(site, image_site, image))
    info = cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(cluster, site, info, job_name, job_id)
    return job_id


def test_train_job_runs_through_pyxis_the_image_root_imported_by_digest(slurm_cluster: SlurmCluster, site: Site,
                                                                       image_site: dict) -> None:
    job_name = "tiny-container"
    job_id = run_job(slurm_cluster, site, image_site, job_name)
    digest = image_site["digest"]
    sqsh = image_site["images"] / f"sha256-{digest}.sqsh"
    assert sqsh.read_bytes()[:4] == b"hsqs" and sqsh.stat().st_uid == 0
    index = image_site["images"] / "by-tag" / REGISTRY / "sana" / "sana-gpu" / TAG
    assert index.read_text() == f"sha256:{digest}\n"
    # Root imported the digest once; the jobs imported nothing.
    assert image_site["imports"].read_text().splitlines() == [f"docker://{REGISTRY}#sana/sana-gpu:sha256:{digest}"]
    assert not list(image_site["images"].glob(".incoming-*"))  # the import's temp file was renamed away

    argv = image_site["record"].read_text().splitlines()
    assert f"--container-image={sqsh}" in argv
    (mounts,) = [a.split("=", 1)[1] for a in argv if a.startswith("--container-mounts=")]
    assert mounts.split(",")[0] == f"{site.fsx}:{site.fsx}"
    assert "--no-container-mount-home" in argv
    # The same srun/torchrun flow as the venv path: one task per node, the launcher's node step.
    assert {"--ntasks-per-node=1", "--kill-on-bad-exit=1"} <= set(argv)
    node = argv.index("node")
    assert argv[node - 2] == "bash" and argv[node - 1].endswith("/training/slurm/launch.sh") and argv[node + 1] == "gpu"

    assert complete_checkpoints(site.run_dir(job_name))[-1] == MAX_STEPS
    state = json.loads((site.run_dir(job_name) / "checkpoints" / f"step-{MAX_STEPS:08d}" / "train_state.json").read_text())
    job = state["provenance"]["job"]
    # Provenance names the image: its package (root and hash inside the image) and the .sqsh.
    assert job["package_root"] == str(image_site["image_root"])
    assert job["package_hash"] == "image-package-hash"
    assert job["env_path"] == str(sqsh) and job["env_requirements_hash"] == f"sha256-{digest}"
    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert f"container image {sqsh}" in job_log
    assert f"SANA_CONTAINER_SQSH={sqsh}" in (site.log_dir(job_name, job_id) / "pinned-env").read_text()

    # A second job with the same image, by digest this time: the same file, no import.
    run_job(slurm_cluster, site, image_site, "tiny-container-2", image=f"{REGISTRY}/sana/sana-gpu@sha256:{digest}")
    assert len(image_site["imports"].read_text().splitlines()) == 1


def test_a_missing_image_file_fails_the_job_with_one_clear_line(slurm_cluster: SlurmCluster, site: Site,
                                                                image_site: dict) -> None:
    env = container_env(site, image_site)
    env["SANA_CONTAINER_IMAGE"] = str(site.fsx / "images" / "nope.sqsh")
    job_name = "tiny-container-missing"
    job_id = submit(slurm_cluster, site, "train-gpu.sbatch", str(site.tiny), job_name=job_name, env=env)
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "FAILED"
    out = site.slurm_out(job_name, job_id).read_text()
    assert f"SANA_CONTAINER_IMAGE={site.fsx}/images/nope.sqsh: no such file" in out
    assert "nope.sqsh" not in image_site["record"].read_text()  # failed before any srun
