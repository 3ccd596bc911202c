"""replace_dir: the output directory is always a whole tree, old or new."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.files.publish import replace_dir


def _tree(root: Path, text: str) -> Path:
    root.mkdir(parents=True)
    (root / "model.json").write_text(text)
    return root


def test_replaces_an_existing_output_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    out = _tree(tmp_path / "export", "old")
    (out / "stale.bin").write_text("from the old export")
    new = _tree(tmp_path / ".export.tmp", "new")

    assert replace_dir(new, out) == out

    assert (out / "model.json").read_text() == "new"
    assert not (out / "stale.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_creates_missing_parents_and_replaces_a_file_in_the_way(tmp_path: Path) -> None:
    in_the_way = tmp_path / "a" / "out"
    in_the_way.parent.mkdir()
    in_the_way.write_text("not a directory")
    new = _tree(tmp_path / "a" / ".out.tmp", "new")
    assert (replace_dir(new, in_the_way) / "model.json").read_text() == "new"

    deep = replace_dir(_tree(tmp_path / "tmp2", "x"), tmp_path / "b" / "c" / "out")
    assert (deep / "model.json").read_text() == "x"


def test_a_failed_move_keeps_the_old_output_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _tree(tmp_path / "export", "old")
    new = _tree(tmp_path / ".export.tmp", "new")
    real_rename = Path.rename

    def rename(self: Path, target: Path) -> Path:
        if self == new:  # the disk fails just as the new tree would move in
            raise OSError(28, "No space left on device")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space left"):
        replace_dir(new, out)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".export.replaced-")]
    assert len(aside) == 1 and (aside[0] / "model.json").read_text() == "old"
