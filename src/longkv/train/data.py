"""Training text: documents from a folder or a Hugging Face dataset, packed into fixed rows.

Documents are whole files (plain or .gz text), or the rows of a dataset's text field. The
held-out split is by document, so no held-out text is in the training mix: with `every` = k,
the documents at positions k-1, 2k-1, ... (files sorted by path) are held out. Packing joins
each document's tokens and a separator (the tokenizer's eos: <|endoftext|> for GPT-2 and for
`longkv tokenizer train`) into one stream and cuts it into rows of seq_len + 1 tokens (inputs
and next-token labels); the tail that does not fill a row is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from longkv.checks import require, require_at_least
from longkv.data.corpus import read_document, training_corpus_dir

Item = TypeVar("Item")
DATASET_KEYS = ("path", "name", "split", "field")


@dataclass(frozen=True)
class DataConfig:
    """Where a run's text comes from and how it is cut.

    folder: documents (default: $LONGKV_CORPUS_DIR; no training corpus is shipped); dataset: a
    Hugging Face dataset instead, {"path": ..., "name": None, "split": "train", "field": "text"}
    as `datasets.load_dataset` takes them (needs the `datasets` package and the hub or a local
    copy); tokenizer: a tokenizer folder (default: the GPT-2 BPE shipped with longkv).
    """

    SECTION: ClassVar[str] = "data"  # a run file's section: its refusals read "data.every"

    seq_len: int = 512
    every: int = 20
    folder: str | None = None
    dataset: dict[str, str] | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        require_at_least(1, self, "seq_len")
        require(
            self.every >= 2,
            self,
            "every",
            f"must be >= 2 so that something is left to train on, got {self.every}",
        )
        if self.dataset is not None:
            require(
                self.folder is None, self, "dataset", "give data.folder or data.dataset, not both"
            )
            unknown = sorted(set(self.dataset) - set(DATASET_KEYS))
            require(
                "path" in self.dataset and not unknown,
                self,
                "dataset",
                f"needs a path and only the keys {DATASET_KEYS}, got {sorted(self.dataset)}",
            )


def document_files(folder: str | Path | None = None) -> list[Path]:
    """Every .txt and .txt.gz file under folder (default: $LONGKV_CORPUS_DIR), sorted."""
    root = training_corpus_dir(folder)
    files = sorted(p for p in root.rglob("*") if p.name.endswith((".txt", ".txt.gz")))
    if not files:
        raise FileNotFoundError(f"no .txt or .txt.gz files under {root}")
    return files


def dataset_texts(spec: dict[str, str]) -> list[str]:
    """The non-empty texts of a Hugging Face dataset split (see DataConfig.dataset)."""
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ValueError(
            "data.dataset: needs the `datasets` package (pip install datasets), or use "
            "data.folder for a folder of text files"
        ) from err
    rows = load_dataset(spec["path"], spec.get("name"), split=spec.get("split", "train"))
    field = spec.get("field", "text")
    if field not in rows.column_names:
        raise ValueError(
            f"data.dataset.field: {field!r} is not a column of {spec['path']} "
            f"({rows.column_names}); set field to the text column"
        )
    return [text for text in rows[field] if text.strip()]


def split_every(items: list[Item], every: int = 20) -> tuple[list[Item], list[Item]]:
    """(train, held-out): the items at positions every-1, 2*every-1, ... are held out."""
    if every < 2:
        raise ValueError(f"every: must be >= 2 so that something is left to train on, got {every}")
    return (
        [x for i, x in enumerate(items) if i % every != every - 1],
        [x for i, x in enumerate(items) if i % every == every - 1],
    )


def pack(docs: list[list[int]], seq_len: int, separator: int) -> Tensor:
    """(N, seq_len + 1) rows of the stream doc0 + [sep] + doc1 + [sep] + ...; tail dropped."""
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    stream = [t for doc in docs for t in [*doc, separator]]
    rows = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: rows * (seq_len + 1)], dtype=torch.long).view(rows, seq_len + 1)


def pack_texts(tokenizer: Any, texts: Iterable[str], seq_len: int) -> Tensor:
    """(N, seq_len + 1) packed rows of the texts, the tokenizer's eos between documents."""
    sep = tokenizer.eos_token_id
    if sep is None:
        raise ValueError("tokenizer: has no eos_token_id to separate documents")
    return pack([tokenizer(text)["input_ids"] for text in texts], seq_len, sep)


@dataclass(frozen=True)
class PackedText:
    """Packed training and held-out rows, (N, seq_len + 1) each."""

    train: Tensor
    held_out: Tensor


def split_texts(data: DataConfig) -> tuple[Iterable[str], Iterable[str]]:
    """(training texts, held-out texts) of the run's folder or dataset, read lazily from files."""
    if data.dataset is not None:
        return split_every(dataset_texts(data.dataset), data.every)
    train, held = split_every(document_files(data.folder), data.every)
    return map(read_document, train), map(read_document, held)


def packed_corpus(tokenizer: Any, data: DataConfig) -> PackedText:
    """Tokenize and pack the run's documents into training and held-out rows."""
    train, held = split_texts(data)
    return PackedText(
        pack_texts(tokenizer, train, data.seq_len), pack_texts(tokenizer, held, data.seq_len)
    )
