"""Result files: a page's files are replaced together or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longkv.results import markdown_table, provenance, replaced_together, write_report


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


def test_a_report_interrupted_while_plotting_leaves_the_old_page(tmp_path: Path) -> None:
    """write_report: json, md and the png its plot draws are replaced together."""
    stem = tmp_path / "r"
    paths = [stem.with_suffix(s) for s in (".json", ".md", ".png")]
    for path in paths:
        path.write_text("old")
    payload = {"provenance": provenance([]), "x": 1}

    def interrupted(png: Path) -> None:
        png.write_text("new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_report(stem, "t", payload, ["body"], interrupted)
    assert [p.read_text() for p in paths] == ["old"] * 3
    assert write_report(stem, "t", payload, ["body"], lambda png: png.write_text("png")) == paths
    assert json.loads(paths[0].read_text())["x"] == 1 and "body" in paths[1].read_text()
    assert paths[2].read_text() == "png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.png"]
    without = write_report(tmp_path / "q", "t", payload, [])
    assert without == [tmp_path / "q.json", tmp_path / "q.md"]


def test_a_pipe_inside_a_cell_stays_in_its_cell() -> None:
    header, row = ["statement", "seconds"], ["x = a | b", "0.1"]
    lines = markdown_table(header, [row], "<>")
    assert lines[0] == "| statement | seconds |"
    assert lines[2] == r"| x = a \| b | 0.1 |"
