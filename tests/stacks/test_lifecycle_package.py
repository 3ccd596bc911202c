"""The lifecycle upload's content hash: what it covers and what it ignores (no synth)."""

from __future__ import annotations

from stacks.cluster import package_files, package_hash


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
