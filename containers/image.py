"""Build, tag and push the training images with whatever container builder the machine has.

    python -m containers.image tag   gpu|neuron            the tag (package hash + recipe hash)
    python -m containers.image build gpu|neuron [--base IMAGE] [--efa] [--pip-from-host]
    python -m containers.image push  gpu|neuron --registry ACCOUNT.dkr.ecr.REGION.amazonaws.com
    python -m containers.image mirror dcgm-exporter --registry ACCOUNT.dkr.ecr.REGION.amazonaws.com

Why a helper and not a bare ``docker build``: the build context is staged with exactly the files
stacks/cluster.py ``package_hash`` covers (so the ``sana.package-hash`` label, deployment_hash, names the package
the lifecycle installs under the same hash on FSx), the labels are computed here once, and the
builder is detected (docker, podman or buildah: the laptop, the login node and CI differ).

The tag is ``<package hash>-<recipe hash>``: the package hash as the issue and the FSx layout
name it, plus 8 hex digits over the Dockerfile and the build arguments that change the image
(base, EFA), because the ECR repositories have immutable tags and a Dockerfile-only change must
not collide with the previous push.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTAINERS = REPO / "containers"
BUILDERS = ("docker", "podman", "buildah")


class ImageError(RuntimeError):
    """A user-fixable problem; main() prints it as one line."""


@dataclass(frozen=True)
class ImageSpec:
    """One image: its Dockerfile and the requirements file its venv is built from."""

    kind: str
    dockerfile: Path
    requirements: Path

    @property
    def name(self) -> str:
        """Repository / image name, also the ECR repository suffix (stacks/images.py)."""
        return f"sana-{self.kind}"


SPECS = {
    "gpu": ImageSpec("gpu", CONTAINERS / "gpu.Dockerfile", REPO / "training/requirements-gpu.txt"),
    "neuron": ImageSpec("neuron", CONTAINERS / "neuron.Dockerfile", REPO / "training/requirements-neuron.txt"),
}


def spec_of(kind: str) -> ImageSpec:
    try:
        return SPECS[kind]
    except KeyError:
        raise ImageError(f"unknown image '{kind}'; use one of: {', '.join(SPECS)}") from None


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def git_revision(repo: Path = REPO) -> str:
    """HEAD, with ``-dirty`` when the tree has uncommitted changes; ``unknown`` outside git."""
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "training"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev


# Where the EFA installer puts libfabric, the aws-ofi-nccl plugin (no arch subdirectory since
# EFA 1.48; the others for older installers) and Open MPI: the nccl-tests Dockerfile's
# LD_LIBRARY_PATH (awslabs/awsome-distributed-ai micro-benchmarks/nccl-tests/nccl-tests.Dockerfile),
# put in front of the base's with EFA=1 only. Ends in ':' (joined to the base's value).
EFA_LD_LIBRARY_PATH = ("/opt/amazon/openmpi/lib:/opt/amazon/efa/lib:/opt/amazon/ofi-nccl/lib:"
                       "/opt/amazon/ofi-nccl/lib/aarch64-linux-gnu:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:")


@dataclass(frozen=True)
class BuildOptions:
    """What changes the image besides the package: the base, EFA, the non-root user's uid.

    ``install_efa`` (GPU image): reinstall EFA over the base's network stack. Off by default:
    the DLC base ships a matched EFA + aws-ofi-nccl (containers/gpu.Dockerfile says why)."""

    base_image: str | None = None
    install_efa: bool = False
    uid: int = 10001

    def build_args(self) -> dict[str, str]:
        args = {"INSTALL_EFA": "1" if self.install_efa else "0", "SANA_UID": str(self.uid)}
        if self.install_efa:
            args["EFA_LD_LIBRARY_PATH"] = EFA_LD_LIBRARY_PATH
        if self.base_image:
            args["BASE_IMAGE"] = self.base_image
        return args


@dataclass(frozen=True)
class ImageMeta:
    """Labels and tag of one build."""

    spec: ImageSpec
    package_hash: str
    requirements_hash: str
    git_revision: str
    recipe_hash: str

    @property
    def tag(self) -> str:
        return f"{self.package_hash}-{self.recipe_hash}"

    @property
    def reference(self) -> str:
        return f"localhost/{self.spec.name}:{self.tag}"

    def labels(self) -> dict[str, str]:
        """Given with ``--label`` (not ARG + LABEL: buildah's layer cache keys a LABEL step by its
        unexpanded text, so a cached layer would keep an earlier build's hash)."""
        return {"sana.package-hash": self.package_hash, "sana.requirements-hash": self.requirements_hash,
                "org.opencontainers.image.revision": self.git_revision}

    def image_env(self) -> str:
        """/opt/sana/image.env: the same provenance inside the image (launch.sh reads it)."""
        return (f"SANA_IMAGE_PACKAGE_HASH={self.package_hash}\nSANA_IMAGE_REQUIREMENTS_HASH={self.requirements_hash}\n"
                f"SANA_IMAGE_REVISION={self.git_revision}\n")


def image_meta(spec: ImageSpec, options: BuildOptions) -> ImageMeta:
    recipe = hashlib.sha256(spec.dockerfile.read_bytes())
    for key, value in sorted(options.build_args().items()):
        recipe.update(f"\0{key}={value}".encode())
    return ImageMeta(spec=spec, package_hash=deployment_hash(),
                     requirements_hash=sha256_file(spec.requirements)[:16], git_revision=git_revision(),
                     recipe_hash=recipe.hexdigest()[:8])


def stage_context(dest: Path, meta: ImageMeta) -> Path:
    """The build context: the uploaded package files (stacks/cluster.py package_files) in
    ``dest/training`` and the provenance file ``dest/image.env``; nothing else of the checkout."""
    from stacks.cluster import TRAINING_DIR, package_files

    for path in package_files(TRAINING_DIR):
        target = dest / "training" / path.relative_to(TRAINING_DIR)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    (dest / "image.env").write_text(meta.image_env())
    return dest


def detect_builder(preferred: str | None = None) -> str:
    """SANA_IMAGE_BUILDER, else the first of docker, podman, buildah on PATH."""
    choice = preferred or os.environ.get("SANA_IMAGE_BUILDER")
    if choice:
        if choice not in BUILDERS:
            raise ImageError(f"SANA_IMAGE_BUILDER={choice}: unknown; use one of {', '.join(BUILDERS)}")
        if not shutil.which(choice):
            raise ImageError(f"SANA_IMAGE_BUILDER={choice}: not on PATH; install it or unset the variable")
        return choice
    for name in BUILDERS:
        if shutil.which(name) and (name != "docker" or _docker_daemon_up()):
            return name
    raise ImageError("no container builder found (docker with a running daemon, podman or buildah); "
                     "install one, e.g. apt-get install buildah")


def _docker_daemon_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@dataclass
class HostPip:
    """pip settings to hand into the build (PIP_* build args) and the host paths they need mounted."""

    args: dict[str, str] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)


def host_pip_settings(python: str = sys.executable) -> HostPip:
    """This machine's pip configuration as the build sees it: ``pip config list`` (files + PIP_*
    environment) -> PIP_* build args for index-url, extra-index-url, find-links and cert, with each
    local path they name bind-mounted read-only at the same path. So the build resolves packages
    exactly as the host's venv did (local wheels, a mirror, a TLS-inspecting proxy's CA bundle)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    settings: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.split(".", 1)[-1]
        if name in ("index-url", "extra-index-url", "find-links", "cert"):
            settings[name] = value.strip().strip("'\"")
    pip = HostPip()
    for name, value in settings.items():
        pip.args[f"PIP_{name.upper().replace('-', '_')}"] = value
        for item in value.split():
            path = item.removeprefix("file://").rstrip("/")
            if path.startswith("/") and os.path.exists(path):
                # A file:// index's pages link to files beside it (<root>/simple -> <root>/files):
                # mount the index root, not just its simple/ pages.
                pip.mounts.append(str(Path(path).parent) if path.endswith("/simple") else path)
    return pip


def build_command(builder: str, spec: ImageSpec, meta: ImageMeta, options: BuildOptions, context: Path,
                  pip: HostPip | None = None) -> list[str]:
    """The builder's command line. buildah/podman: chroot isolation and the host network (works
    unprivileged-in-a-container, as here and in CI), docker image format (keeps SHELL)."""
    args = {**options.build_args(), **(pip.args if pip else {})}
    cmd = [builder, "bud" if builder == "buildah" else "build"]
    if builder in ("podman", "buildah"):
        # --force-rm: a failed step's working container (and its overlay mount) goes too.
        cmd += ["--isolation", "chroot", "--network", "host", "--layers", "--force-rm", "--format", "docker"]
        for path in (pip.mounts if pip else []):
            cmd += ["--volume", f"{path}:{path}:ro"]
    elif pip and pip.mounts:
        raise ImageError("--pip-from-host needs podman or buildah (docker build has no --volume)")
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    for key, value in meta.labels().items():
        cmd += ["--label", f"{key}={value}"]
    return [*cmd, "-f", str(spec.dockerfile), "-t", meta.reference, str(context)]


def build(kind: str, options: BuildOptions, *, builder: str | None = None, pip: HostPip | None = None,
          global_args: list[str] | None = None) -> ImageMeta:
    """Build ``kind``; returns its meta (``meta.reference`` is the local image)."""
    spec = spec_of(kind)
    tool = detect_builder(builder)
    meta = image_meta(spec, options)
    with tempfile.TemporaryDirectory(prefix="sana-image-context-") as tmp:
        context = stage_context(Path(tmp), meta)
        cmd = build_command(tool, spec, meta, options, context, pip)
        cmd[1:1] = global_args or []
        print("containers.image:", " ".join(cmd), file=sys.stderr)
        done = subprocess.run(cmd)
    if done.returncode != 0:
        raise ImageError(f"{tool} build of {spec.name} failed (exit {done.returncode}); see its output above")
    return meta


def _cdk_json_config():
    from stacks.config import PlatformConfig

    return PlatformConfig.from_context(json.loads((REPO / "cdk.json").read_text())["context"])


def deployment_hash() -> str:
    """The hash the stack uploads this checkout's package under with cdk.json's settings
    (stacks/cluster.py deployment_package_hash: the code and the node settings), i.e. the name
    of /fsx/platform/<hash> on a cluster deployed from this checkout."""
    from stacks.cluster import deployment_package_hash

    return deployment_package_hash(_cdk_json_config())


def _repository_prefix() -> str:
    """PlatformConfig.retained_prefix of cdk.json's context: the first part of the repositories' names."""
    return _cdk_json_config().retained_prefix


def push(kind: str, registry: str, options: BuildOptions, *, builder: str | None = None) -> str:
    """Tag the local image for ``registry/<project>/<name>:<tag>`` and push it (after ECR login)."""
    spec = spec_of(kind)
    if not registry.endswith(".amazonaws.com") or ".dkr.ecr." not in registry:
        raise ImageError(f"--registry {registry}: not an ECR registry; use ACCOUNT.dkr.ecr.REGION.amazonaws.com")
    tool = detect_builder(builder)
    meta = image_meta(spec, options)
    # The repository is <projectName>/sana-<kind> (stacks/images.py), from cdk.json (with -g<N> from
    # deploymentGeneration 2 on: PlatformConfig.retained_prefix).
    prefix = os.environ.get("SANA_PROJECT") or _repository_prefix()
    remote = f"{registry}/{prefix}/{spec.name}:{meta.tag}"
    ecr_login(tool, registry)
    tag_cmd = [tool, "tag", meta.reference, remote]
    if subprocess.run(tag_cmd).returncode != 0:
        raise ImageError(f"no local image {meta.reference}; run `make image IMAGE={kind}` first")
    if subprocess.run([tool, "push", remote]).returncode != 0:
        raise ImageError(f"push of {remote} failed (an existing tag is immutable: rebuild after a change)")
    return remote


def ecr_login(tool: str, registry: str) -> None:
    """``aws ecr get-login-password | <tool> login`` for ``registry``; ImageError (one line) if refused."""
    region = registry.split(".dkr.ecr.")[1].removesuffix(".amazonaws.com")
    password = subprocess.run(["aws", "ecr", "get-login-password", "--region", region], capture_output=True,
                              text=True)
    if password.returncode != 0:
        raise ImageError(f"aws ecr get-login-password --region {region} failed: {password.stderr.strip()}")
    login = subprocess.run([tool, "login", "--username", "AWS", "--password-stdin", registry], input=password.stdout,
                           text=True, capture_output=True)
    if login.returncode != 0:
        raise ImageError(f"{tool} login {registry} failed: {(login.stderr.strip() or 'no output').splitlines()[-1]}")


def mirror(image: str, registry: str, *, builder: str | None = None) -> str:
    """Copy a pinned third-party image into this account's ECR, where a private cluster's nodes pull it
    (stacks/images.py MIRRORED_IMAGES; the pin is lifecycle_scripts/agent_releases.py's): pull the pinned
    tag, tag it ``<registry>/<prefix>/<image>:<tag>``, push. Run where its registry (nvcr.io) is
    reachable, with the platform team's credentials."""
    from stacks.agent_releases import DCGM_EXPORTER
    from stacks.images import MIRRORED_IMAGES, mirror_repository_name

    pins = {DCGM_EXPORTER.repository: DCGM_EXPORTER}
    if image not in MIRRORED_IMAGES or image not in pins:
        raise ImageError(f"mirror {image}: the mirrored images are {', '.join(MIRRORED_IMAGES)}")
    if not registry.endswith(".amazonaws.com") or ".dkr.ecr." not in registry:
        raise ImageError(f"--registry {registry}: not an ECR registry; use ACCOUNT.dkr.ecr.REGION.amazonaws.com")
    tool = detect_builder(builder)
    source = pins[image].reference()
    prefix = os.environ.get("SANA_PROJECT") or _repository_prefix()
    remote = pins[image].reference(registry, mirror_repository_name(prefix, image))
    if subprocess.run([tool, "pull", source]).returncode != 0:
        raise ImageError(f"{tool} pull {source} failed: run the mirror where {source.split('/')[0]} is reachable")
    ecr_login(tool, registry)
    if subprocess.run([tool, "tag", source, remote]).returncode != 0:
        raise ImageError(f"{tool} tag {source} {remote} failed")
    if subprocess.run([tool, "push", remote]).returncode != 0:
        raise ImageError(f"push of {remote} failed (the repository's tags are immutable: if this tag is there "
                         "already, the mirror is done)")
    return remote


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m containers.image", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("tag", "build", "push", "mirror"))
    parser.add_argument("kind", help="gpu or neuron (mirror: dcgm-exporter)")
    parser.add_argument("--base", help="base image (default: the Dockerfile's BASE_IMAGE)")
    parser.add_argument("--efa", action="store_true",
                        help="GPU: reinstall EFA over the base's (default: keep the DLC's matched stack)")
    parser.add_argument("--pip-from-host", action="store_true",
                        help="resolve packages as this machine's pip does (podman/buildah only)")
    parser.add_argument("--registry", help="push, mirror: ACCOUNT.dkr.ecr.REGION.amazonaws.com")
    parser.add_argument("--builder", choices=BUILDERS, help="default: detected (SANA_IMAGE_BUILDER)")
    ns = parser.parse_args(argv)
    options = BuildOptions(base_image=ns.base, install_efa=ns.efa)
    try:
        if ns.action == "mirror":
            if not ns.registry:
                raise ImageError("mirror needs --registry ACCOUNT.dkr.ecr.REGION.amazonaws.com "
                                 "(make mirror-dcgm-image REGISTRY=...)")
            print(mirror(ns.kind, ns.registry, builder=ns.builder))
        elif ns.action == "tag":
            print(image_meta(spec_of(ns.kind), options).tag)
        elif ns.action == "build":
            meta = build(ns.kind, options, builder=ns.builder, pip=host_pip_settings() if ns.pip_from_host else None)
            print(meta.reference)
        else:
            if not ns.registry:
                raise ImageError("push needs --registry ACCOUNT.dkr.ecr.REGION.amazonaws.com (make push-image REGISTRY=...)")
            print(push(ns.kind, ns.registry, options, builder=ns.builder))
    except ImageError as exc:
        print(f"containers.image: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
