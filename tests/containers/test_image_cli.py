"""containers/image.py without building: the builder command line, tags, user errors."""

from __future__ import annotations

import hashlib
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
