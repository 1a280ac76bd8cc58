"""Training text: documents from a folder or a Hugging Face dataset, packed into fixed rows.

Documents are whole files (plain or .gz text), or the rows of a dataset's text field. The
held-out split is by document, so no held-out text is in the training mix: with `every` = k,
the documents at positions k-1, 2k-1, ... (files sorted by path) are held out. Rows have
seq_len + 1 tokens (inputs and next-token labels), packed one of two ways (`PACKINGS`):
"stream" joins each document's tokens and a separator (the tokenizer's eos: <|endoftext|> for
GPT-2 and for `longkv tokenizer train`) into one stream and cuts it into rows, dropping the tail
that does not fill one; "cram" (the KVM paper's) truncates each document to a row, concatenates
documents without a separator until a row is full, emits it and discards the rest of the last
document.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from longkv.checks import require, require_at_least
from longkv.data.corpus import read_document, training_corpus_dir

Item = TypeVar("Item")
DATASET_KEYS = ("path", "name", "split", "field", "streaming", "max_documents")
PACKINGS = ("stream", "cram")
DATA_FILES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # suffix -> builder


@dataclass(frozen=True)
class DataConfig:
    """Where a run's text comes from and how it is cut.

    folder: documents (default: $LONGKV_CORPUS_DIR; no training corpus is shipped); dataset: a
    Hugging Face dataset instead (`dataset_texts`): {"path": a hub id, a `save_to_disk` folder,
    or JSON / JSON lines / Parquet files (a file, a folder of them or a glob), "name": None,
    "split": "train", "field": "text", "streaming": False, "max_documents": None (all)}; needs
    the `datasets` package. tokenizer: a tokenizer folder (default: the GPT-2 BPE shipped with
    longkv); packing: "stream" or "cram" (`PACKINGS`).
    """

    SECTION: ClassVar[str] = "data"  # a run file's section: its refusals read "data.every"

    seq_len: int = 512
    every: int = 20
    folder: str | None = None
    dataset: dict[str, Any] | None = None
    tokenizer: str | None = None
    packing: str = "stream"

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
            most = self.dataset.get("max_documents")
            require(
                most is None or (isinstance(most, int) and most >= 1), self, "dataset",
                f"max_documents: a number of documents >= 1 (or null: all), got {most!r}",
            )  # fmt: skip
        require(self.packing in PACKINGS, self, "packing", f"must be one of {PACKINGS}")


def document_files(folder: str | Path | None = None) -> list[Path]:
    """Every .txt and .txt.gz file under folder (default: $LONGKV_CORPUS_DIR), sorted."""
    root = training_corpus_dir(folder)
    files = sorted(p for p in root.rglob("*") if p.name.endswith((".txt", ".txt.gz")))
    if not files:
        raise FileNotFoundError(f"no .txt or .txt.gz files under {root}")
    return files


def load_rows(spec: dict[str, Any]) -> Any:
    """The rows of a dataset split (see DataConfig.dataset): `datasets.load_from_disk` for a
    `save_to_disk` folder, the json or parquet builder for data files, else
    `datasets.load_dataset` (a hub id or a folder it reads); an IterableDataset if streaming."""
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            "data.dataset: needs the `datasets` package (pip install datasets), or use "
            "data.folder for a folder of text files"
        ) from err
    path, split = str(spec["path"]), spec.get("split", "train")
    streaming = bool(spec.get("streaming", False))
    local = Path(path)
    if (local / "state.json").is_file() or (local / "dataset_dict.json").is_file():
        rows = datasets.load_from_disk(path)
        if isinstance(rows, datasets.DatasetDict):
            if split not in rows:
                raise ValueError(
                    f"data.dataset.split: {split!r} is not a split of {path} ({sorted(rows)})"
                )
            rows = rows[split]
        return rows.to_iterable_dataset() if streaming else rows
    files = [f for f in (sorted(local.iterdir()) if local.is_dir() else [local])
             if f.suffix in DATA_FILES]  # fmt: skip
    builders = {DATA_FILES[f.suffix] for f in files}
    if len(builders) == 1:  # data files: the split takes them all (a folder's other files not)
        (builder,) = builders
        data_files = {split: [str(f) for f in files] if local.is_dir() else path}
        return datasets.load_dataset(
            builder, data_files=data_files, split=split, streaming=streaming
        )
    return datasets.load_dataset(path, spec.get("name"), split=split, streaming=streaming)


def dataset_texts(spec: dict[str, Any]) -> Iterator[str]:
    """The non-empty texts of a Hugging Face dataset split (see DataConfig.dataset), read
    lazily, the first max_documents of them if given."""
    rows = load_rows(spec)
    field = spec.get("field", "text")
    names = rows.column_names
    if names is not None and field not in names:
        raise ValueError(
            f"data.dataset.field: {field!r} is not a column of {spec['path']} ({names}); set "
            "field to the text column"
        )
    texts = (row[field] for row in rows)
    return itertools.islice((t for t in texts if t.strip()), spec.get("max_documents"))


def split_every(items: Iterable[Item], every: int = 20) -> tuple[list[Item], list[Item]]:
    """(train, held-out): the items at positions every-1, 2*every-1, ... are held out."""
    return list(every_kth(items, every, False)), list(every_kth(items, every, True))


def every_kth(items: Iterable[Item], every: int, held_out: bool) -> Iterator[Item]:
    """The items at positions every-1, 2*every-1, ... (held_out) or all the others, lazily."""
    if every < 2:
        raise ValueError(f"every: must be >= 2 so that something is left to train on, got {every}")
    return (x for i, x in enumerate(items) if (i % every == every - 1) == held_out)


def pack(docs: list[list[int]], seq_len: int, separator: int) -> Tensor:
    """(N, seq_len + 1) rows of the stream doc0 + [sep] + doc1 + [sep] + ...; tail dropped."""
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    stream = [t for doc in docs for t in [*doc, separator]]
    rows = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: rows * (seq_len + 1)], dtype=torch.long).view(rows, seq_len + 1)


def cram(docs: Iterable[list[int]], seq_len: int) -> Tensor:
    """(N, seq_len + 1) rows packed as the KVM paper's reference does: each document truncated
    to seq_len + 1 tokens, documents concatenated without a separator until a row is full, the
    row emitted and the rest of the last document discarded (as is a last, unfilled row)."""
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    rows: list[list[int]] = []
    row: list[int] = []
    for doc in docs:
        row += doc[: seq_len + 1]
        if len(row) >= seq_len + 1:
            rows.append(row[: seq_len + 1])
            row = []
    return torch.tensor(rows, dtype=torch.long).view(len(rows), seq_len + 1)


def pack_texts(
    tokenizer: Any, texts: Iterable[str], seq_len: int, packing: str = "stream"
) -> Tensor:
    """(N, seq_len + 1) rows of the texts packed by `packing` (`PACKINGS`): "stream", the
    tokenizer's eos between documents (`pack`), or "cram" (`cram`)."""
    ids = (tokenizer(text)["input_ids"] for text in texts)
    if packing == "cram":
        return cram(ids, seq_len)
    sep = tokenizer.eos_token_id
    if sep is None:
        raise ValueError("tokenizer: has no eos_token_id to separate documents")
    return pack(list(ids), seq_len, sep)


@dataclass(frozen=True)
class PackedText:
    """Packed training and held-out rows, (N, seq_len + 1) each."""

    train: Tensor
    held_out: Tensor


def split_texts(data: DataConfig) -> tuple[Iterable[str], Iterable[str]]:
    """(training texts, held-out texts) of the run's folder or dataset, read lazily."""
    if data.dataset is not None:
        spec = data.dataset
        return (
            every_kth(dataset_texts(spec), data.every, False),
            every_kth(dataset_texts(spec), data.every, True),
        )
    train, held = split_every(document_files(data.folder), data.every)
    return map(read_document, train), map(read_document, held)


def packed_corpus(tokenizer: Any, data: DataConfig) -> PackedText:
    """Tokenize and pack the run's documents into training and held-out rows."""
    train, held = split_texts(data)
    return PackedText(
        pack_texts(tokenizer, train, data.seq_len, data.packing),
        pack_texts(tokenizer, held, data.seq_len, data.packing),
    )
