"""Result files: a page's files are replaced together or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from longkv.results import replaced_together


def test_a_pages_files_are_all_new_or_all_old(tmp_path: Path) -> None:
    paths = [tmp_path / name for name in ("p.json", "p.md", "p.png")]
    for path in paths:
        path.write_text("old")
    with pytest.raises(KeyboardInterrupt), replaced_together(paths) as tmps:
        tmps[0].write_text("new")
        tmps[1].write_text("new")
        raise KeyboardInterrupt  # before the last file was written
    assert [p.read_text() for p in paths] == ["old"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "p.md", "p.png"]
    with replaced_together(paths) as tmps:
        for tmp in tmps:
            tmp.write_text("new")
    assert [p.read_text() for p in paths] == ["new"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "p.md", "p.png"]
