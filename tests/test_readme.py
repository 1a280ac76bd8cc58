"""The README: every file or folder of the repository it names exists, and its Python blocks
run."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from longkv.bench.readme import ReadmeBenchSettings, python_blocks, run, run_blocks
from longkv.checks import SettingError

ROOT = Path(__file__).resolve().parents[1]
# a path of the repository: under one of its folders, up to a character no path here holds
PATH = re.compile(r"(?<![\w/.-])((?:src|configs|results|docs|tests)/[\w./-]*[\w/])")


def test_every_path_the_readme_names_exists() -> None:
    named = sorted(set(PATH.findall((ROOT / "README.md").read_text())))
    assert "src/longkv/data/bundled/corpus/austen/" in named and len(named) > 20
    missing = [p for p in named if not (ROOT / p).exists()]
    assert missing == [], missing


@pytest.mark.smollm2
def test_every_python_block_of_the_readme_runs(tmp_path: Path) -> None:
    """In order, in one namespace (a block uses the model the one before loaded), the long text
    and the book.txt they read a page of Pride and Prejudice (`longkv bench readme` runs them
    at length)."""
    from longkv.data.corpus import read_text

    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 3
    text = read_text("austen/prideprejudice.txt.gz")[:3000]
    rows = run_blocks(blocks, text, bound=3600, folder=tmp_path)
    assert all(r["finished"] for r in rows) and len(rows) > 20
    assert (tmp_path / "book.read" / "manifest.json").is_file()


def test_the_long_text_and_the_book_hold_the_text(tmp_path: Path) -> None:
    """The placeholder and book.txt are replaced in every block; a failing statement fails."""
    blocks = [
        'n = len("...a long text...")\nassert open("book.txt").read() == "...a long text..."\n',
        "assert n == 9, n\n",
    ]
    rows = run_blocks(blocks, "some text", bound=60, folder=tmp_path)
    assert [(r["block"], r["line"]) for r in rows] == [(1, 1), (1, 2), (2, 1)]
    assert rows[0]["statement"] == 'n = len("...a long text...")'
    with pytest.raises(AssertionError, match=r"^9$"):
        run_blocks(["assert len('x') == 0, 9\n"], "t", bound=60, folder=tmp_path)


def test_a_statement_past_the_bound_is_stopped_and_ends_the_run(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGALRM)
    rows = run_blocks(
        ["x = 1\nwhile True:\n    x += 1\n", "y = 2\n"], "t", bound=1.0, folder=tmp_path
    )
    assert [(r["line"], r["finished"]) for r in rows] == [(1, True), (2, False)]
    assert rows[1]["seconds"] >= 1.0 and rows[1]["statement"].startswith("while True:")
    assert signal.getsignal(signal.SIGALRM) == before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_readme_without_a_long_text_or_file_is_refused(tmp_path: Path) -> None:
    readme = tmp_path / "R.md"
    readme.write_text("```python\nx = 1\n```\n")
    with pytest.raises(SettingError, match="reads a long text"):
        run(ReadmeBenchSettings(readme=str(readme), out_dir=str(tmp_path)))
    with pytest.raises(SettingError, match="--readme PATH"):
        ReadmeBenchSettings(readme=str(tmp_path / "missing.md"))


def test_make_test_fast_runs_a_subset_and_each_test_target_says_how_long() -> None:
    make = (ROOT / "Makefile").read_text()
    fast = re.search(r"^FAST := ((?:.*\\\n)*.*)$", make, re.M)
    assert fast, "no FAST list in the Makefile"
    files = fast.group(1).replace("\\\n", " ").split()
    assert files and all((ROOT / f).is_file() for f in files), files
    assert len(files) < len(list((ROOT / "tests").glob("test_*.py"))) / 2
    for target in ("test", "test-fast"):
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", make, re.M)
        assert recipe and re.search(r"@echo .*about \d+ minutes?", recipe.group(1)), target
    assert "make test-fast" in (ROOT / "README.md").read_text()
