"""The public-domain text corpus (../shared/data/corpus): where it is and how to read it.

The folder is, in order: the `corpus_dir` argument, $LONGKV_CORPUS_DIR, or `shared/data/corpus`
beside the repository checkout.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Any

CORPUS_ENV = "LONGKV_CORPUS_DIR"
DEFAULT_TEXT = "mobydick.txt.gz"


def corpus_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The corpus folder; FileNotFoundError naming the path and the fix when it is missing."""
    if path is not None:
        folder = Path(path)
    elif os.environ.get(CORPUS_ENV):
        folder = Path(os.environ[CORPUS_ENV])
    else:
        folder = Path(__file__).resolve().parents[4] / "shared" / "data" / "corpus"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"corpus folder {folder} not found; pass its path (corpus_dir= or --corpus-dir) or "
            f"set {CORPUS_ENV} to the folder holding shared/data/corpus"
        )
    return folder


def read_document(path: Path) -> str:
    """The text of a plain or gzipped (.gz) UTF-8 file."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def read_text(name: str, path: str | os.PathLike[str] | None = None) -> str:
    """The text of one corpus file, e.g. "mobydick.txt.gz" or "austen/emma.txt.gz"."""
    file = corpus_dir(path) / name
    if not file.is_file():
        raise FileNotFoundError(
            f"corpus file {file} not found; see shared/data/README.md for the files it holds"
        )
    return read_document(file)


def text_tokens(
    tokenizer: Any,
    n_tokens: int,
    name: str = DEFAULT_TEXT,
    path: str | os.PathLike[str] | None = None,
) -> list[int]:
    """The first n_tokens token ids of a corpus file under the tokenizer (no special tokens)."""
    ids: list[int] = tokenizer(read_text(name, path), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"{name} holds {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[:n_tokens]
