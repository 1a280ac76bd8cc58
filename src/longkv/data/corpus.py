"""Text corpora: the texts shipped with longkv, or a folder of documents, and how to read them.

The package ships the texts its default commands read (`BUNDLED_CORPUS`: Austen's six novels and
Moby-Dick, see bundled/README.md) and the GPT-2 tokenizer (`GPT2_DIR`). Reading a corpus file
looks in the `path` argument (`corpus_dir=`, `--corpus-dir`), else in $LONGKV_CORPUS_DIR, else in
the shipped folder. A training corpus (`training_corpus_dir`) is not shipped: it is the argument
or $LONGKV_CORPUS_DIR.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Any

CORPUS_ENV = "LONGKV_CORPUS_DIR"
DEFAULT_TEXT = "mobydick.txt.gz"
BUNDLED = Path(__file__).resolve().parent / "bundled"
BUNDLED_CORPUS = BUNDLED / "corpus"
GPT2_DIR = BUNDLED / "tokenizers" / "gpt2"


def _configured(path: str | os.PathLike[str] | None) -> Path | None:
    """The folder the caller or $LONGKV_CORPUS_DIR names; None when neither does."""
    if path is not None:
        return Path(path)
    if os.environ.get(CORPUS_ENV):
        return Path(os.environ[CORPUS_ENV])
    return None


def _existing(folder: Path) -> Path:
    if not folder.is_dir():
        raise FileNotFoundError(
            f"corpus folder {folder} not found; pass the folder of text files (corpus_dir= or "
            f"--corpus-dir) or set {CORPUS_ENV} to it"
        )
    return folder


def corpus_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The folder to read corpus files from: path, else $LONGKV_CORPUS_DIR, else the shipped one.

    FileNotFoundError naming the folder and the fix when it is missing.
    """
    return _existing(_configured(path) or BUNDLED_CORPUS)


def training_corpus_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The folder of training documents: path, else $LONGKV_CORPUS_DIR; nothing is shipped."""
    folder = _configured(path)
    if folder is None:
        raise FileNotFoundError(
            "no training corpus: pass a folder of .txt / .txt.gz documents (longkv train: "
            "data.folder=PATH; longkv tokenizer train: --corpus-dir PATH) or set "
            f"{CORPUS_ENV}=PATH. longkv ships only the texts its evaluations read; the Data "
            "section of the longkv README says which corpus the example runs used and where it "
            "comes from"
        )
    return _existing(folder)


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
        shipped = sorted(str(p.relative_to(BUNDLED_CORPUS)) for p in BUNDLED_CORPUS.rglob("*.gz"))
        raise FileNotFoundError(
            f"corpus file {file} not found; the shipped corpus holds {', '.join(shipped)}. "
            f"For other files pass their folder (corpus_dir= or --corpus-dir) or set {CORPUS_ENV}"
        )
    return read_document(file)


def special_prefix(tokenizer: Any) -> list[int]:
    """The ids a tokenizer puts before a text's own: its BOS where it adds one (Gemma's
    `<bos>`), none for GPT-2 or SmolLM2. A model reads every input after them, as it was
    trained to."""
    plain = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    ids = list(tokenizer("x")["input_ids"])
    for i in range(len(ids) - len(plain) + 1):
        if ids[i : i + len(plain)] == plain:
            return ids[:i]
    raise ValueError(
        f"the tokenizer's ids of a text with its special tokens ({ids}) do not hold the text's "
        f"own ({plain}); longkv cannot tell which ids it puts before a text"
    )


def text_tokens(
    tokenizer: Any,
    n_tokens: int,
    name: str = DEFAULT_TEXT,
    path: str | os.PathLike[str] | None = None,
) -> list[int]:
    """n_tokens token ids: the tokenizer's `special_prefix`, then the first tokens of a corpus
    file."""
    prefix = special_prefix(tokenizer)
    ids: list[int] = tokenizer(read_text(name, path), add_special_tokens=False)["input_ids"]
    if len(prefix) + len(ids) < n_tokens:
        raise ValueError(
            f"{name} holds {len(ids)} tokens, fewer than the {n_tokens - len(prefix)} asked for"
        )
    return prefix + ids[: n_tokens - len(prefix)]
