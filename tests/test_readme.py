"""The README: every file or folder of the repository it names exists, and its Python blocks
run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# a path of the repository: under one of its folders, up to a character no path here holds
PATH = re.compile(r"(?<![\w/.-])((?:src|configs|results|docs|tests)/[\w./-]*[\w/])")


def test_every_path_the_readme_names_exists() -> None:
    named = sorted(set(PATH.findall((ROOT / "README.md").read_text())))
    assert "src/longkv/data/bundled/corpus/austen/" in named and len(named) > 20
    missing = [p for p in named if not (ROOT / p).exists()]
    assert missing == [], missing


def python_blocks() -> list[str]:
    """The README's Python code blocks, in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.smollm2
def test_every_python_block_of_the_readme_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In order, in one namespace (a block uses the model the one before loaded), in a folder
    holding the book.txt they read: a page of Pride and Prejudice."""
    from longkv.data.corpus import read_text

    blocks = python_blocks()
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    (tmp_path / "book.txt").write_text(read_text("austen/prideprejudice.txt.gz")[:3000])
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert (tmp_path / "book.read" / "manifest.json").is_file()
