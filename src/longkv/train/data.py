"""Training text: documents from a folder, the GPT-2 tokenizer, packed fixed-length sequences.

Documents are whole files (plain or .gz text). The held-out split is by document, so no held-out
text is in the training mix: with `every` = k, the files at sorted positions k-1, 2k-1, ... are
held out. Packing joins each document's tokens and a separator token (GPT-2's <|endoftext|>)
into one stream and cuts it into rows of seq_len + 1 tokens (inputs and next-token labels);
the tail that does not fill a row is dropped.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from longkv.data.corpus import corpus_dir


def gpt2_tokenizer(path: str | Path | None = None) -> Any:
    """The GPT-2 BPE from shared/data/tokenizers/gpt2 (or `path`), loaded offline."""
    from transformers import GPT2TokenizerFast

    folder = Path(path) if path is not None else corpus_dir().parent / "tokenizers" / "gpt2"
    if not (folder / "vocab.json").is_file():
        raise FileNotFoundError(
            f"GPT-2 tokenizer files not found in {folder}; pass the folder holding vocab.json "
            "and merges.txt (shared/data/tokenizers/gpt2)"
        )
    return GPT2TokenizerFast.from_pretrained(folder)


def document_files(folder: str | Path | None = None) -> list[Path]:
    """Every .txt and .txt.gz file under folder (default: the shared corpus), sorted."""
    root = corpus_dir(folder)
    files = sorted(p for p in root.rglob("*") if p.name.endswith((".txt", ".txt.gz")))
    if not files:
        raise FileNotFoundError(f"no .txt or .txt.gz files under {root}")
    return files


def read_document(path: Path) -> str:
    """A document's text."""
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def split_files(files: list[Path], every: int = 20) -> tuple[list[Path], list[Path]]:
    """(train, held-out): every `every`-th file of the sorted list is held out."""
    if every < 2:
        raise ValueError(f"every: must be >= 2 so that something is left to train on, got {every}")
    held = [f for i, f in enumerate(files) if i % every == every - 1]
    return [f for f in files if f not in held], held


def pack(docs: list[list[int]], seq_len: int, separator: int) -> Tensor:
    """(N, seq_len + 1) rows of the stream doc0 + [sep] + doc1 + [sep] + ...; tail dropped."""
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    stream = [t for doc in docs for t in [*doc, separator]]
    rows = len(stream) // (seq_len + 1)
    return torch.tensor(stream[: rows * (seq_len + 1)], dtype=torch.long).view(rows, seq_len + 1)


@dataclass(frozen=True)
class PackedText:
    """Packed training and held-out rows, and the files each came from."""

    train: Tensor
    held_out: Tensor
    train_files: list[Path]
    held_out_files: list[Path]


def packed_corpus(
    tokenizer: Any, seq_len: int, folder: str | Path | None = None, every: int = 20
) -> PackedText:
    """Tokenize and pack a folder of documents into training and held-out rows."""
    train_files, held_files = split_files(document_files(folder), every)
    train = pack_files(tokenizer, train_files, seq_len)
    return PackedText(train, pack_files(tokenizer, held_files, seq_len), train_files, held_files)


def pack_files(tokenizer: Any, files: list[Path], seq_len: int) -> Tensor:
    """(N, seq_len + 1) packed rows of the documents in files, EOS between documents."""
    sep = tokenizer.eos_token_id
    if sep is None:
        raise ValueError("tokenizer: has no eos_token_id to separate documents")
    return pack([tokenizer(read_document(f))["input_ids"] for f in files], seq_len, sep)
