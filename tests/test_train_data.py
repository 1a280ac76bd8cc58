"""Training text: packing, the held-out split by document, datasets, tokenizers."""

from __future__ import annotations

import gzip
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from longkv.data.corpus import BUNDLED_CORPUS
from longkv.train.data import (
    DataConfig,
    dataset_texts,
    document_files,
    pack,
    packed_corpus,
    split_every,
)
from longkv.train.tokenizer import gpt2_tokenizer, load_tokenizer, train_bpe


def test_pack_joins_documents_with_separators_and_drops_the_tail() -> None:
    rows = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=3, separator=0)
    # stream: 1 2 3 0 4 5 0 6 7 8 9 0 -> 3 rows of 4
    assert rows.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    assert pack([[1, 2]], seq_len=3, separator=0).shape == (0, 4)
    with pytest.raises(ValueError, match="seq_len: must be >= 1"):
        pack([[1]], 0, 0)


def test_held_out_documents_are_never_trained_on(tmp_path: Path) -> None:
    for i in range(10):
        with gzip.open(tmp_path / f"doc{i}.txt.gz", "wt") as f:
            f.write(f"document number {i} " * 50)
    (tmp_path / "notes.md").write_text("ignored")
    files = document_files(tmp_path)
    assert len(files) == 10
    train, held = split_every(files, every=5)
    assert [f.name for f in held] == ["doc4.txt.gz", "doc9.txt.gz"]
    assert not set(train) & set(held) and len(train) == 8
    text = packed_corpus(gpt2_tokenizer(), DataConfig(seq_len=16, folder=str(tmp_path), every=5))
    assert text.train.shape[1] == text.held_out.shape[1] == 17
    tok = gpt2_tokenizer()
    held_text = tok.decode(text.held_out.flatten())
    assert "number 4" in held_text and "number 9" in held_text and "number 3" not in held_text
    assert "number 4" not in tok.decode(text.train.flatten())


def test_gpt2_tokenizer_is_the_shipped_one() -> None:
    tok = gpt2_tokenizer()
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    assert tok("Hello world")["input_ids"] == [15496, 995]
    with pytest.raises(FileNotFoundError, match="GPT-2 tokenizer files not found"):
        gpt2_tokenizer("/nonexistent")
    with pytest.raises(ValueError, match="every: must be >= 2"):
        split_every([Path("a")], every=1)
    with pytest.raises(FileNotFoundError, match="no tokenizer in /nonexistent"):
        load_tokenizer("/nonexistent")


def test_the_full_corpus_splits_by_document(shared_corpus: Path) -> None:
    train, held = split_every(document_files(shared_corpus))
    assert len(train) + len(held) == 283 and len(held) == 14


def test_a_trained_bpe_round_trips_text_and_reloads(tmp_path: Path) -> None:
    docs = document_files(BUNDLED_CORPUS)[:2]  # two novels of the shipped corpus
    tok = train_bpe(docs, 400, tmp_path / "bpe")
    assert len(tok) == 400 and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    text = "Call me Ishmael; ünïcode and 数字 too.\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: nothing is unknown
    english = "It is a truth universally acknowledged, that a single man in possession"
    assert len(tok(english)["input_ids"]) < 0.6 * len(english)  # merges were learned (bytes: 71)
    again = load_tokenizer(tmp_path / "bpe")
    assert again(text)["input_ids"] == ids and again.eos_token_id == tok.eos_token_id
    with pytest.raises(ValueError, match="vocab_size: must exceed the 256 byte tokens"):
        train_bpe(docs, 256, tmp_path / "small")


def test_dataset_text_is_split_and_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    class Rows:
        column_names = ("text", "id")

        def __getitem__(self, key: str) -> list[str]:
            return [f"row {i} " * 30 if i != 3 else "  " for i in range(10)]

    def load_dataset(path: str, name: str | None, split: str) -> Rows:
        calls.append((path, name, split))
        return Rows()

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    spec = {"path": "some/corpus", "split": "validation"}
    texts = dataset_texts(spec)
    assert calls == [("some/corpus", None, "validation")] and len(texts) == 9  # blank row dropped
    text = packed_corpus(gpt2_tokenizer(), DataConfig(seq_len=8, every=3, dataset=spec))
    held = gpt2_tokenizer().decode(text.held_out.flatten())
    assert "row 2" in held and "row 6" in held and "row 0" not in held  # 3rd, 6th, 9th texts
    with pytest.raises(ValueError, match="'body' is not a column"):
        dataset_texts({"path": "x", "field": "body"})
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="needs the `datasets` package"):
        dataset_texts(spec)


def test_data_config_errors() -> None:
    with pytest.raises(ValueError, match=r"data\.seq_len: must be >= 1"):
        DataConfig(seq_len=0)
    with pytest.raises(ValueError, match=r"data\.every: must be >= 2"):
        DataConfig(every=1)
    with pytest.raises(ValueError, match=r"give data\.folder or data\.dataset, not both"):
        DataConfig(folder="x", dataset={"path": "y"})
    with pytest.raises(ValueError, match="needs a path and only the keys"):
        DataConfig(dataset={"name": "y"})
