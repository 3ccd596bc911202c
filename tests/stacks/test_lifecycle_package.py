"""The lifecycle upload's content hash: what it covers and what it ignores (no synth)."""

from __future__ import annotations

import json
import subprocess
import sys

from stacks.cluster import LIFECYCLE_DIR, package_files, package_hash
from stacks.config import PlatformConfig, PosixAccount


def make_trees(tmp_path):
    scripts, training = tmp_path / "lifecycle_scripts", tmp_path / "training"
    (scripts).mkdir()
    (training / "backends").mkdir(parents=True)
    (scripts / "on_init_complete.sh").write_text("#!/bin/bash\n")
    (training / "loop.py").write_text("x = 1\n")
    (training / "backends" / "gpu.py").write_text("y = 2\n")
    return scripts, training


def test_hash_changes_with_content_in_either_tree(tmp_path):
    scripts, training = make_trees(tmp_path)
    first = package_hash(scripts, training)
    assert len(first) == 16
    (training / "backends" / "gpu.py").write_text("y = 3\n")
    second = package_hash(scripts, training)
    (scripts / "on_init_complete.sh").write_text("#!/bin/bash\necho\n")
    third = package_hash(scripts, training)
    assert len({first, second, third}) == 3


def test_hash_ignores_caches_tests_and_hidden_files(tmp_path):
    scripts, training = make_trees(tmp_path)
    before = package_hash(scripts, training)
    for junk in ("__pycache__/loop.cpython-311.pyc", "tests/test_x.py", ".ruff_cache/x", "backends/a.pyc"):
        (training / junk).parent.mkdir(parents=True, exist_ok=True)
        (training / junk).write_text("junk")
    assert package_hash(scripts, training) == before
    assert [p.relative_to(training).as_posix() for p in package_files(training)] == ["backends/gpu.py", "loop.py"]


def test_moving_a_file_between_trees_changes_the_hash(tmp_path):
    scripts, training = make_trees(tmp_path)
    before = package_hash(scripts, training)
    (training / "loop.py").rename(scripts / "loop.py")
    assert package_hash(scripts, training) != before


def test_the_entry_script_the_cluster_names_is_in_the_lifecycle_package():
    from stacks.cluster import LIFECYCLE_DIR, ON_INIT_COMPLETE, package_files

    assert ON_INIT_COMPLETE == "on_init_complete.sh"
    assert LIFECYCLE_DIR / ON_INIT_COMPLETE in set(package_files(LIFECYCLE_DIR))
    assert not (LIFECYCLE_DIR / "on_create.sh").exists()  # Customer Managed mode's entry is gone


def test_node_settings_are_part_of_the_hash_and_the_environment_is_not(tmp_path):
    """A clusterUsers change alone must be a new prefix (a node never fetches an installed hash
    again); the account/region values are tokens at synth and left out on both ends."""
    scripts, training = make_trees(tmp_path)
    base = PlatformConfig()
    added = PlatformConfig(clusterUsers=(*base.clusterUsers, PosixAccount("carol", 2003)))
    code = package_hash(scripts, training)
    first = package_hash(scripts, training, base.node_settings())
    assert len({code, first, package_hash(scripts, training, added.node_settings())}) == 3
    deployed = base.settings(region="eu-west-1", data_bucket="d", artefacts_bucket="a", lifecycle_bucket="l",
                             package_hash=first)
    other_account = {**deployed, "region": "us-east-2", "data_bucket": "d2", "lifecycle_bucket": "l2"}
    assert package_hash(scripts, training, deployed) == package_hash(scripts, training, other_account) == first


def test_the_settings_keys_the_hash_skips_are_exactly_the_deployment_environment():
    hashed = set(PlatformConfig().node_settings())
    full = set(PlatformConfig().settings(region="r", data_bucket="d", artefacts_bucket="a", lifecycle_bucket="l",
                                         package_hash="h"))
    from stacks.cluster import _HASH

    assert full - hashed == set(_HASH.ENVIRONMENT_KEYS) and not hashed & set(_HASH.ENVIRONMENT_KEYS)


def test_the_node_side_cli_hashes_the_settings_file_next_to_the_scripts(tmp_path):
    """rollout.sh runs `python3 package_hash.py LIFECYCLE TRAINING` over a fetched prefix: the
    settings file beside the scripts is hashed, so one changed after `cdk deploy` is refused."""
    scripts, training = make_trees(tmp_path)
    settings = PlatformConfig().settings(region="eu-west-1", data_bucket="d", artefacts_bucket="a",
                                         lifecycle_bucket="l", package_hash="x")
    (scripts / "platform-settings.json").write_text(json.dumps(settings, indent=2))

    def cli() -> str:
        return subprocess.run([sys.executable, str(LIFECYCLE_DIR / "package_hash.py"), str(scripts), str(training)],
                              capture_output=True, text=True, check=True).stdout.strip()

    assert cli() == package_hash(scripts, training, PlatformConfig().node_settings())
    settings["cluster_users"].append({"name": "mallory", "uid": 2666})
    (scripts / "platform-settings.json").write_text(json.dumps(settings))
    assert cli() != package_hash(scripts, training, PlatformConfig().node_settings())
