"""Training text: packing, the held-out split by document, datasets, tokenizers."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path
from typing import Any

import pytest

from longkv.data.corpus import BUNDLED_CORPUS
from longkv.train.data import (
    DataConfig,
    cram,
    dataset_texts,
    document_files,
    pack,
    pack_texts,
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


TEXTS = [f"document {i}: " + "the cat sat on the mat. " * (5 + 3 * i) for i in range(12)]
TEXTS[4] = "   "  # a blank row is no document


def dataset_sources(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """The same rows (column "body") as each kind of local dataset DataConfig.dataset reads."""
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"body": TEXTS, "id": list(range(len(TEXTS)))})
    rows.save_to_disk(tmp_path / "disk")
    datasets.DatasetDict({"validation": rows}).save_to_disk(tmp_path / "dict")
    rows.to_json(tmp_path / "rows.jsonl")
    (tmp_path / "parquet").mkdir()
    (tmp_path / "parquet" / "README.md").write_text("not data")  # a folder's other files
    rows.select(range(6)).to_parquet(tmp_path / "parquet" / "a.parquet")
    rows.select(range(6, len(TEXTS))).to_parquet(tmp_path / "parquet" / "b.parquet")
    return {
        "save_to_disk": {"path": str(tmp_path / "disk")},
        "dataset_dict": {"path": str(tmp_path / "dict"), "split": "validation"},
        "json": {"path": str(tmp_path / "rows.jsonl")},
        "parquet_folder": {"path": str(tmp_path / "parquet")},
    }


@pytest.mark.parametrize("packing", ["stream", "cram"])
def test_every_local_dataset_gives_the_rows_of_its_texts(tmp_path: Path, packing: str) -> None:
    """save_to_disk folders, JSON lines and a folder of Parquet files, read whole or streamed:
    the rows their non-blank texts make, held out by document (every 3rd)."""
    tok = gpt2_tokenizer()
    texts = [t for t in TEXTS if t.strip()]
    train, held = split_every(texts, 3)
    expected = [pack_texts(tok, t, 16, packing) for t in (train, held)]
    assert all(len(rows) > 1 for rows in expected)
    for name, spec in dataset_sources(tmp_path).items():
        for streaming in (False, True):
            source = {**spec, "field": "body", "streaming": streaming}
            data = DataConfig(seq_len=16, every=3, dataset=source, packing=packing)
            text = packed_corpus(tok, data)
            assert text.train.equal(expected[0]) and text.held_out.equal(expected[1]), name
    capped = {"path": str(tmp_path / "rows.jsonl"), "field": "body", "max_documents": 5}
    assert list(dataset_texts({**capped, "streaming": True})) == texts[:5]


def test_dataset_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = dataset_sources(tmp_path)
    with pytest.raises(ValueError, match="'text' is not a column of"):
        list(dataset_texts(sources["json"]))
    with pytest.raises(ValueError, match=r"'train' is not a split of .*\(\['validation'\]\)"):
        list(dataset_texts({"path": sources["dataset_dict"]["path"]}))
    with pytest.raises(ValueError, match="max_documents: a number of documents >= 1"):
        DataConfig(dataset={"path": "x", "max_documents": 0})
    with pytest.raises(ValueError, match=r"data\.packing: must be one of"):
        DataConfig(packing="tight")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="needs the `datasets` package"):
        dataset_texts(sources["json"])


def test_cram_packs_as_the_papers_reference() -> None:
    """Each document cut to a row, documents joined without a separator until a row is full;
    the rest of the document that filled it, and an unfilled last row, are dropped."""
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17, 18, 19, 20], [21]]
    assert cram(docs, 3).tolist() == [[1, 2, 3, 4], [11, 12, 13, 14], [16, 17, 18, 19]]
    assert cram([[1, 2]], 3).shape == (0, 4)


def test_data_config_errors() -> None:
    with pytest.raises(ValueError, match=r"data\.seq_len: must be >= 1"):
        DataConfig(seq_len=0)
    with pytest.raises(ValueError, match=r"data\.every: must be >= 2"):
        DataConfig(every=1)
    with pytest.raises(ValueError, match=r"give data\.folder or data\.dataset, not both"):
        DataConfig(folder="x", dataset={"path": "y"})
    with pytest.raises(ValueError, match="needs a path and only the keys"):
        DataConfig(dataset={"name": "y"})
