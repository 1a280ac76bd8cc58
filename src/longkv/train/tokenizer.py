"""Tokenizers for training: the shipped GPT-2 BPE, or a byte-level BPE trained on a corpus.

`train_bpe` learns GPT-2's kind of tokenizer (byte-level pre-tokenization with GPT-2's split
pattern, so any text encodes and decodes losslessly) with <|endoftext|> as its only special
token, which separates documents when rows are packed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from longkv.checks import require
from longkv.data.corpus import GPT2_DIR, read_document

EOS = "<|endoftext|>"


def gpt2_tokenizer(path: str | Path | None = None) -> Any:
    """The GPT-2 BPE shipped with longkv (or the one in `path`), loaded offline."""
    from transformers import GPT2TokenizerFast

    folder = Path(path) if path is not None else GPT2_DIR
    if not (folder / "vocab.json").is_file():
        raise FileNotFoundError(
            f"GPT-2 tokenizer files not found in {folder}; pass the folder holding vocab.json "
            "and merges.txt"
        )
    return GPT2TokenizerFast.from_pretrained(folder)


def load_tokenizer(path: str | Path | None = None) -> Any:
    """The tokenizer in a folder: one saved by save_pretrained (`longkv tokenizer train`, a
    trained model's folder), GPT-2's vocab.json + merges.txt, or None for the shipped GPT-2."""
    if path is None:
        return gpt2_tokenizer()
    folder = Path(path)
    if (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    if (folder / "vocab.json").is_file():
        return gpt2_tokenizer(folder)
    raise FileNotFoundError(
        f"no tokenizer in {folder}: pass a folder written by `longkv tokenizer train` (or any "
        "save_pretrained), or one holding GPT-2's vocab.json and merges.txt"
    )


def train_bpe(
    files: list[Path], vocab_size: int, out_dir: str | Path, *, min_frequency: int = 2
) -> Any:
    """Train a byte-level BPE of vocab_size tokens on the files' text; save it to out_dir.

    Fewer tokens when no pair is left that occurs min_frequency times. Returns the tokenizer
    as transformers loads it (eos = bos = unk = <|endoftext|>).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    require(
        vocab_size > len(alphabet),
        None,
        "vocab_size",
        f"must exceed the {len(alphabet)} byte tokens plus {EOS}, got {vocab_size}",
    )
    require(min_frequency >= 1, None, "min_frequency", f"must be >= 1, got {min_frequency}")
    require(bool(files), None, "files", "no documents to train the tokenizer on")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
        initial_alphabet=alphabet, show_progress=False,
    )  # fmt: skip
    texts = (read_document(f) for f in tqdm(files, desc="tokenizer", unit="file"))
    bpe.train_from_iterator(texts, trainer=trainer, length=len(files))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
