"""The README's paths: every file or folder of the repository it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path of the repository: under one of its folders, up to a character no path here holds
PATH = re.compile(r"(?<![\w/.-])((?:src|configs|results|docs|tests)/[\w./-]*[\w/])")


def test_every_path_the_readme_names_exists() -> None:
    named = sorted(set(PATH.findall((ROOT / "README.md").read_text())))
    assert "src/longkv/data/bundled/corpus/austen/" in named and len(named) > 20
    missing = [p for p in named if not (ROOT / p).exists()]
    assert missing == [], missing
