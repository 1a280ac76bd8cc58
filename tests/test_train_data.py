"""Training text: packing, the held-out split by document, the offline GPT-2 tokenizer."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from longkv.train.data import document_files, gpt2_tokenizer, pack, packed_corpus, split_files


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
    train, held = split_files(files, every=5)
    assert [f.name for f in held] == ["doc4.txt.gz", "doc9.txt.gz"]
    assert not set(train) & set(held) and len(train) == 8
    text = packed_corpus(gpt2_tokenizer(), 16, tmp_path, every=5)
    assert text.train.shape[1] == text.held_out.shape[1] == 17
    tok = gpt2_tokenizer()
    held_text = tok.decode(text.held_out.flatten())
    assert "number 4" in held_text and "number 9" in held_text and "number 3" not in held_text
    assert "number 4" not in tok.decode(text.train.flatten())


def test_gpt2_tokenizer_is_the_shared_one() -> None:
    tok = gpt2_tokenizer()
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    assert tok("Hello world")["input_ids"] == [15496, 995]
    with pytest.raises(FileNotFoundError, match="GPT-2 tokenizer files not found"):
        gpt2_tokenizer("/nonexistent")
    with pytest.raises(ValueError, match="every: must be >= 2"):
        split_files([Path("a")], every=1)


def test_the_shared_corpus_splits_by_document() -> None:
    train, held = split_files(document_files())
    assert len(train) + len(held) == 283 and len(held) == 14
