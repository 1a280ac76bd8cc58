"""Where corpus text comes from: the shipped texts, $LONGKV_CORPUS_DIR, an explicit folder."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from conftest import bos_gpt2
from longkv.data.corpus import (
    BUNDLED,
    BUNDLED_CORPUS,
    DEFAULT_TEXT,
    GPT2_DIR,
    corpus_dir,
    read_text,
    special_prefix,
    text_tokens,
    training_corpus_dir,
)
from longkv.evals.haystack import ESSAY_FILES
from longkv.train.data import document_files
from longkv.train.tokenizer import gpt2_tokenizer


@pytest.fixture(autouse=True)
def _no_corpus_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LONGKV_CORPUS_DIR", raising=False)


def write_doc(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)


def test_the_shipped_texts_cover_the_default_commands() -> None:
    assert corpus_dir() == BUNDLED_CORPUS
    for name in (*ESSAY_FILES, DEFAULT_TEXT):
        assert len(read_text(name)) > 400_000, name  # a whole novel
    tok = gpt2_tokenizer()
    assert tok.decode(text_tokens(tok, 8)).startswith("ETYMOLOGY. (Supplied")  # Moby-Dick


def test_text_tokens_start_as_the_tokenizer_starts_a_text() -> None:
    """A tokenizer that adds a BOS gets it first, in the n tokens asked for; GPT-2 adds none."""
    plain, bos = gpt2_tokenizer(), bos_gpt2()
    assert special_prefix(plain) == [] and special_prefix(bos) == [50256]
    assert text_tokens(bos, 9) == [50256, *text_tokens(plain, 8)]

    class Rewrites:  # a tokenizer whose special tokens change the text's own ids
        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {"input_ids": [1, 5] if add_special_tokens else [4]}

    with pytest.raises(ValueError, match=r"\(\[1, 5\]\) do not hold the text's own \(\[4\]\)"):
        special_prefix(Rewrites())


def test_env_and_argument_take_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env, arg = tmp_path / "env", tmp_path / "arg"
    write_doc(env / DEFAULT_TEXT, "from the environment\n")
    write_doc(arg / DEFAULT_TEXT, "from the argument\n")
    monkeypatch.setenv("LONGKV_CORPUS_DIR", str(env))
    assert corpus_dir() == env and read_text(DEFAULT_TEXT) == "from the environment\n"
    assert read_text(DEFAULT_TEXT, arg) == "from the argument\n"
    assert training_corpus_dir() == env and document_files() == [env / DEFAULT_TEXT]
    assert training_corpus_dir(arg) == arg


def test_missing_folder_and_file_say_how_to_fix_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as err:
        corpus_dir(missing)
    # the folder itself is what LONGKV_CORPUS_DIR names (not a folder above it)
    assert str(err.value) == (
        f"corpus folder {missing} not found; pass the folder of text files (corpus_dir= or "
        "--corpus-dir) or set LONGKV_CORPUS_DIR to it"
    )
    with pytest.raises(FileNotFoundError) as err:
        read_text("kjv.txt.gz")  # in the full corpus, not shipped
    msg = str(err.value)
    assert str(BUNDLED_CORPUS / "kjv.txt.gz") in msg and "--corpus-dir" in msg
    assert "austen/emma.txt.gz" in msg and "mobydick.txt.gz" in msg  # what is shipped


def test_training_needs_a_corpus_of_its_own() -> None:
    for call in (training_corpus_dir, document_files):
        with pytest.raises(FileNotFoundError, match="no training corpus") as err:
            call()
        msg = str(err.value)
        assert "data.folder=PATH" in msg and "--corpus-dir PATH" in msg
        assert "LONGKV_CORPUS_DIR=PATH" in msg and "Data section of the longkv README" in msg


def test_shipped_files_are_those_of_the_full_corpus(shared_corpus: Path) -> None:
    shipped = sorted(p.relative_to(BUNDLED_CORPUS) for p in BUNDLED_CORPUS.rglob("*.gz"))
    assert [str(p) for p in shipped] == sorted([*ESSAY_FILES])  # the essay files hold DEFAULT_TEXT
    for rel in shipped:
        assert (BUNDLED_CORPUS / rel).read_bytes() == (shared_corpus / rel).read_bytes(), rel
    shared_gpt2 = shared_corpus.parent / "tokenizers" / "gpt2"
    for name in ("vocab.json", "merges.txt"):
        assert (GPT2_DIR / name).read_bytes() == (shared_gpt2 / name).read_bytes(), name
    assert (BUNDLED / "README.md").is_file()
