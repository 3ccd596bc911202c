"""One training job through launch.sh's container path (SANA_CONTAINER_IMAGE), on the real
Slurm daemons of the fixture.

pyxis and enroot are not installable here (pyxis is a SPANK plugin built against the cluster's
Slurm; enroot needs its own setuid/caps packages), so two stand-ins on the job's PATH show the
real arguments and fail the way the real tools would:

- ``srun``: records its full argv, then validates the pyxis options as pyxis does (only options
  pyxis defines; the image must be a squashfs file, enroot create reads it; every mount source
  must exist, or enroot's mount fails) and runs the task with the REAL srun, the pyxis options
  removed, and the image's environment (its package root and package-hash variable) applied.
- ``enroot``: ``enroot import --output FILE docker://REGISTRY#IMAGE:TAG`` writes a real squashfs
  (mksquashfs) and counts imports, so "imported once, then reused" is checked.

The image the job runs is the real training package + the tests' venv laid out as the image
(containers/*.Dockerfile: /opt/sana/training and /opt/sana/venv). Building a real image and
training in it is tests/containers/test_image_build.py.
"""

# ruff: noqa: F811  (pytest fixtures: `site` is imported from test_train_jobs and requested by name)
from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING

import pytest

from tests.slurm.conftest import skip_unless_required
from tests.slurm.test_train_jobs import (  # noqa: F401  (site: the shared fixture)
    JOB_TIMEOUT,
    complete_checkpoints,
    job_failure,
    shared_dir,
    site,
    submit,
)

if TYPE_CHECKING:
    from tests.slurm.conftest import SlurmCluster
    from tests.slurm.test_train_jobs import Site

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

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

ENROOT_SHIM = r"""#!/bin/bash
set -euo pipefail
[[ $1 == import && $2 == --output ]] || { echo "enroot shim: unexpected $*" >&2; exit 1; }
[[ $4 =~ ^docker://[^/#]+#[^#]+:[^:/]+$ ]] || { echo "enroot: invalid image reference $4" >&2; exit 1; }
echo "$4" >>"$ENROOT_IMPORTS"
mksquashfs "$PYXIS_IMAGE_ROOT" "$3" -all-root -comp lzo -noD -quiet -no-progress >/dev/null
"""


@pytest.fixture(scope="module")
def image_site(site: Site) -> dict:
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
    shared_dir(images, site.user)
    record = site.root / "pyxis-args"
    imports = site.root / "enroot-imports"
    for path in (record, imports):
        path.touch()
        path.chmod(0o666)
    return {"shims": shims, "image_root": image_root, "images": images, "record": record, "imports": imports}


def container_env(site: Site, image_site: dict) -> dict[str, str]:
    env = site.env(SANA_NPROC_PER_NODE="1", SANA_CONTAINER_IMAGE=f"{REGISTRY}/sana/sana-gpu:{TAG}")
    env.update(PATH=f"{image_site['shims']}:{env['PATH']}", REAL_SRUN=shutil.which("srun") or "srun",
               PYXIS_RECORD=str(image_site["record"]), PYXIS_IMAGE_ROOT=str(image_site["image_root"]),
               ENROOT_IMPORTS=str(image_site["imports"]))
    return env


def run_job(cluster: SlurmCluster, site: Site, image_site: dict, job_name: str) -> int:
    job_id = submit(cluster, site, "train-gpu.sbatch", str(site.tiny), "--set", f"data.path={site.features}",
                    "--set", "checkpoint.every_steps=4", "--max-steps", str(MAX_STEPS), job_name=job_name,
                    env=container_env(site, image_site))
    info = cluster.wait(job_id, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", job_failure(cluster, site, info, job_name, job_id)
    return job_id


def test_train_job_runs_through_pyxis_with_the_image_imported_once(slurm_cluster: SlurmCluster, site: Site,
                                                                   image_site: dict) -> None:
    job_name = "tiny-container"
    job_id = run_job(slurm_cluster, site, image_site, job_name)
    sqsh = image_site["images"] / f"sana-gpu-{TAG}.sqsh"
    assert sqsh.read_bytes()[:4] == b"hsqs"
    assert image_site["imports"].read_text().splitlines() == [f"docker://{REGISTRY}#sana/sana-gpu:{TAG}"]
    assert not list(image_site["images"].glob("*.tmp.*"))  # the import's temp file was renamed away

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
    assert job["env_path"] == str(sqsh) and job["env_requirements_hash"] == f"sana-gpu-{TAG}"
    job_log = (site.log_dir(job_name, job_id) / "job.log").read_text()
    assert f"container image {sqsh}" in job_log
    assert f"SANA_CONTAINER_SQSH={sqsh}" in (site.log_dir(job_name, job_id) / "pinned-env").read_text()

    # A second job with the same image: no second import.
    run_job(slurm_cluster, site, image_site, "tiny-container-2")
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
