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
from stacks.cluster import LIFECYCLE_DIR, TRAINING_DIR, package_hash

REPO = Path(__file__).resolve().parents[2]


def test_tag_is_the_package_hash_plus_a_recipe_hash_that_changes_with_base_and_efa():
    spec = spec_of("gpu")
    meta = image_meta(spec, BuildOptions())
    assert meta.package_hash == package_hash(LIFECYCLE_DIR, TRAINING_DIR)
    assert meta.tag.startswith(meta.package_hash + "-") and len(meta.tag.split("-")[1]) == 8
    assert meta.requirements_hash == hashlib.sha256((REPO / "training/requirements-gpu.txt").read_bytes()).hexdigest()[:16]
    others = {image_meta(spec, BuildOptions(install_efa=False)).tag, image_meta(spec, BuildOptions(base_image="x")).tag}
    assert meta.tag not in others and len(others) == 2


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
