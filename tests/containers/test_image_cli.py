"""containers/image.py without building: the builder command line, tags, user errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from containers.image import (
    BuildOptions,
    HostPip,
    ImageError,
    build_command,
    detect_builder,
    image_meta,
    main,
    spec_of,
)
from stacks.cluster import deployment_package_hash
from stacks.platform import PlatformConfig, cdk_json_context

REPO = Path(__file__).resolve().parents[2]


def test_tag_is_the_package_hash_plus_a_recipe_hash_that_changes_with_base_and_efa():
    spec = spec_of("gpu")
    meta = image_meta(spec, BuildOptions())
    # The name the stack uploads (and the nodes install) this checkout's package under, with cdk.json's settings.
    assert meta.package_hash == deployment_package_hash(PlatformConfig.from_context(cdk_json_context()))
    assert meta.tag.startswith(meta.package_hash + "-") and len(meta.tag.split("-")[1]) == 8
    assert meta.requirements_hash == hashlib.sha256((REPO / "training/requirements-gpu.txt").read_bytes()).hexdigest()[:16]
    others = {image_meta(spec, BuildOptions(install_efa=True)).tag, image_meta(spec, BuildOptions(base_image="x")).tag}
    assert meta.tag not in others and len(others) == 2


def test_the_gpu_image_keeps_the_bases_network_stack_unless_efa_is_asked_for(tmp_path):
    """Default: no EFA reinstall over the DLC's matched EFA + aws-ofi-nccl, its LD_LIBRARY_PATH
    kept; EFA=1 (`--efa`): the installer runs and the nccl-tests Dockerfile's EFA library path
    goes in front."""
    spec = spec_of("gpu")
    default = build_command("buildah", spec, image_meta(spec, BuildOptions()), BuildOptions(), tmp_path)
    assert "INSTALL_EFA=0" in default and not [a for a in default if a.startswith("EFA_LD_LIBRARY_PATH=")]
    efa = BuildOptions(install_efa=True)
    cmd = build_command("buildah", spec, image_meta(spec, efa), efa, tmp_path)
    assert "INSTALL_EFA=1" in cmd
    (path,) = [a.split("=", 1)[1] for a in cmd if a.startswith("EFA_LD_LIBRARY_PATH=")]
    assert path.split(":")[:3] == ["/opt/amazon/openmpi/lib", "/opt/amazon/efa/lib", "/opt/amazon/ofi-nccl/lib"]
    assert path.endswith(":")  # joined to the base's LD_LIBRARY_PATH
    dockerfile = (REPO / "containers/gpu.Dockerfile").read_text()
    assert "\nARG INSTALL_EFA=0\n" in dockerfile and '\nARG EFA_LD_LIBRARY_PATH=""\n' in dockerfile
    assert "\nENV LD_LIBRARY_PATH=${EFA_LD_LIBRARY_PATH}${LD_LIBRARY_PATH}\n" in dockerfile
    assert "--efa" in (REPO / "Makefile").read_text().split("\nimage:")[1].split("\n")[1]


def test_buildah_command_isolation_network_mounts_args_and_labels(tmp_path):
    spec = spec_of("gpu")
    meta = image_meta(spec, BuildOptions(base_image="localhost/base:1", install_efa=False))
    pip = HostPip(args={"PIP_FIND_LINKS": "/opt/wheels"}, mounts=["/opt/wheels"])
    cmd = build_command("buildah", spec, meta, BuildOptions(base_image="localhost/base:1", install_efa=False),
                        tmp_path, pip)
    assert cmd[:2] == ["buildah", "bud"]
    joined = " ".join(cmd)
    for part in ("--isolation chroot", "--network host", "--format docker", "--volume /opt/wheels:/opt/wheels:ro",
                 "--build-arg INSTALL_EFA=0", "--build-arg BASE_IMAGE=localhost/base:1",
                 "--build-arg PIP_FIND_LINKS=/opt/wheels", f"--label sana.package-hash={meta.package_hash}",
                 f"-t {meta.reference}"):
        assert part in joined, part
    assert cmd[-1] == str(tmp_path)
    with pytest.raises(ImageError, match="needs podman or buildah"):
        build_command("docker", spec, meta, BuildOptions(), tmp_path, pip)


def test_user_errors_are_one_line(monkeypatch, capsys):
    monkeypatch.setenv("SANA_IMAGE_BUILDER", "kaniko")
    with pytest.raises(ImageError, match="SANA_IMAGE_BUILDER=kaniko: unknown"):
        detect_builder()
    assert main(["build", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == "containers.image: unknown image 'cpu'; use one of: gpu, neuron"
    assert main(["push", "gpu", "--registry", "example.com"]) == 2
    assert "not an ECR registry" in capsys.readouterr().err


def _recording_tools(bin_dir: Path, calls: Path, *, pull_ok: bool) -> None:
    """docker and aws that record their arguments (the registries they would reach are out of reach
    here): `docker pull` of nvcr.io succeeds or fails as asked, `aws ecr get-login-password` prints a token, the rest succeed."""
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f'#!/bin/sh\necho "docker $*" >>{calls}\n'
        f'case $1 in pull) {"exit 0" if pull_ok else "echo unauthorized >&2; exit 1"};; login) cat >>{calls};; esac\n')
    (bin_dir / "aws").write_text(f'#!/bin/sh\necho "aws $*" >>{calls}\necho token-from-aws\n')
    for tool in ("docker", "aws"):
        (bin_dir / tool).chmod(0o755)


def test_mirror_copies_the_pinned_dcgm_image_into_the_platforms_repository(tmp_path, monkeypatch, capsys):
    """`make mirror-dcgm-image`: the pinned tag (lifecycle_scripts/agent_releases.py) pulled from NGC, then
    tagged and pushed to <registry>/<project>/dcgm-exporter, the repository stacks/images.py creates and
    the private cluster's nodes pull (observability.dcgm_exporter_repository)."""
    from stacks.agent_releases import DCGM_EXPORTER

    calls = tmp_path / "calls"
    _recording_tools(tmp_path / "bin", calls, pull_ok=True)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SANA_IMAGE_BUILDER", "docker")
    registry = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"
    assert main(["mirror", "dcgm-exporter", "--registry", registry]) == 0
    source = f"nvcr.io/nvidia/k8s/dcgm-exporter:{DCGM_EXPORTER.tag}"
    remote = f"{registry}/sana/dcgm-exporter:{DCGM_EXPORTER.tag}"
    assert capsys.readouterr().out.strip() == remote
    assert calls.read_text().splitlines() == [
        f"docker pull {source}", "aws ecr get-login-password --region eu-west-1",
        f"docker login --username AWS --password-stdin {registry}", "token-from-aws",
        f"docker tag {source} {remote}", f"docker push {remote}"]


def test_a_mirror_that_cannot_pull_stops_before_any_login_in_one_line(tmp_path, monkeypatch, capsys):
    calls = tmp_path / "calls"
    _recording_tools(tmp_path / "bin", calls, pull_ok=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SANA_IMAGE_BUILDER", "docker")
    assert main(["mirror", "dcgm-exporter", "--registry", "123456789012.dkr.ecr.eu-west-1.amazonaws.com"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("containers.image: docker pull nvcr.io/nvidia/k8s/dcgm-exporter:") and \
        err[-1].endswith("failed: run the mirror where nvcr.io is reachable")
    assert "login" not in calls.read_text()
    assert main(["mirror", "node-exporter", "--registry", "123456789012.dkr.ecr.eu-west-1.amazonaws.com"]) == 2
    assert capsys.readouterr().err.strip() == "containers.image: mirror node-exporter: the mirrored images are dcgm-exporter"
