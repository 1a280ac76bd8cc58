"""A document read once and asked many questions: `read` and `Document.ask`.

`read` runs a frozen model over a document's part of the prompt (`document.prompt`) by any
method of the method table and keeps what the method keeps: the fold's or full attention's
cache, or a bounded cache's runner (its leaves too). `Document.ask` forks the read
(`caches.fork`), reads the question's part on the fork and decodes the answer: the read is never
changed, so answers do not depend on the order of the questions.

A bounded method reads in chunks of `stream_chunk`, and what it keeps depends on where the
chunks fall; the read stops at the document's last whole chunk, and each question reads the
rest (fewer than `stream_chunk` tokens) before its own, so the chunks fall where a fresh read of
document and question puts them and the answer is the fresh read's, bit for bit. The fold and
full attention read the whole document: their cache is the same wherever the chunks fall, up to
the rounding of the forwards' shapes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from longkv.caches.bounded import (
    STREAM_CHUNK,
    BoundedConfig,
    BoundedRunner,
    bounded_fold,
    bounded_generate,
)
from longkv.caches.fork import fork
from longkv.caches.kvm_fold import TWO_LEVEL, KVMFoldConfig
from longkv.caches.methods import (
    BOUNDED,
    CACHE_METHODS,
    BoundedOptions,
    config_label,
    make_runner,
)
from longkv.caches.retrieval import RetrievalRunner, check_exact_positions
from longkv.checks import require
from longkv.decoding import Pick, greedy
from longkv.document.prompt import document_ids, question_ids
from longkv.document.repeat import AnswerWatch
from longkv.dtypes import DTYPES
from longkv.fold.compat import input_device
from longkv.fold.fold import FOLD_CHUNK, FoldRunner, kv_fold
from longkv.fold.generate import fold_generate

# "two-level" reads as kvm-fold with slots opened (KVMFoldConfig.open), by default TWO_LEVEL;
# "auto" as the document's length asks (`auto_method`)
AUTO = "auto"
METHODS = (*CACHE_METHODS, "two-level", AUTO)
PACKED_METHODS = ("full", "fold")  # the reads a cache dtype packs (`ReadSettings.cache_dtype`)
# `auto` past the model's trained positions: this bounded method, with these options over
# BoundedOptions' defaults (InfLLM@1024, its window at its cache index, so that no distance
# passes the budget): of the bounded methods measured past SmolLM2's 8K positions
# (results/long_smollm2.md, 16K-64K), it and two-level sqrt@2048 found the most needles (150
# points of 600 each), it with the lower NLL (3.85 / 3.89 / 3.83 against 3.90 / 4.01 / 4.02)
# in 0.8 of the time; StreamingLLM@1024 found none (docs/documents.md)
LONG_METHOD, LONG_OPTIONS = "infllm", {"positions": "inside"}
# positions an auto read keeps for the questions and answers where it does not know them
ASK_ROOM = 256
# what a fork (a question) may append before it copies the read's: leaves
# (`LeafStore.reserve`), a packed cache's rows (`kv_fold`'s room)
LEAF_ROOM = 1024


@dataclass(frozen=True)
class ReadSettings:
    """How a document is read: the method (`METHODS`) and its run label, the bounded config
    (None for full and fold), the fold's chunk, a bounded cache's chunk, whether the prompt
    goes into the chat template, whether positions past the model's may be run, and the
    dtype (`DTYPES` name) full and fold reads keep keys and values in (`kv_fold`'s
    cache_dtype; None: transformers' cache, in the model's dtype)."""

    method: str
    label: str
    config: BoundedConfig | None = None
    chunk_size: int = FOLD_CHUNK
    stream_chunk: int = STREAM_CHUNK
    chat: bool = True
    allow_extrapolation: bool = False
    cache_dtype: str | None = None

    def __post_init__(self) -> None:
        require(self.method in CACHE_METHODS, self, "method", f"must be one of {METHODS}")
        require(
            self.cache_dtype is None or self.cache_dtype in DTYPES, self, "cache_dtype",
            f"must be None or one of {sorted(DTYPES)}, got {self.cache_dtype!r}",
        )  # fmt: skip
        require(
            self.cache_dtype is None or self.method in PACKED_METHODS, self, "cache_dtype",
            f"{self.label} keeps its own entries; a cache dtype is for full and fold reads",
        )  # fmt: skip
        require(
            (self.config is None) == (self.method not in BOUNDED), self, "config",
            f"{self.method} {'takes no' if self.method not in BOUNDED else 'needs a'} "
            "bounded config",
        )  # fmt: skip
        for name in ("chunk_size", "stream_chunk"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, self, name, f"must be >= 1, got {value}")
        if self.config is not None:
            require(
                self.stream_chunk <= self.config.window_len, self, "stream_chunk",
                f"{self.stream_chunk} exceeds the window of {self.label} "
                f"({self.config.window_len} tokens)",
            )  # fmt: skip

    @property
    def packed(self) -> torch.dtype | None:
        """The dtype a full or fold read packs its cache in (`kv_fold`'s cache_dtype)."""
        return None if self.cache_dtype is None else DTYPES[self.cache_dtype]


def auto_method(config: Any, tokens: int) -> tuple[str, str]:
    """(method, why): how `auto` reads `tokens` positions (document, question and answer) with
    the model of `config` (its `PretrainedConfig`): the exact fold while they fit its
    max_position_embeddings, else LONG_METHOD; why says so in one line."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return "fold", "the exact fold: the model sets no bound on its positions"
    if tokens <= limit:
        return "fold", f"the exact fold: the {tokens} positions to read fit the model's {limit}"
    return LONG_METHOD, (
        f"{LONG_METHOD} with positions inside its budget: the {tokens} positions to read pass "
        f"the model's {limit} trained ones (--method fold reads exactly while they fit)"
    )


def read_settings(
    method: str,
    config: BoundedConfig | None = None,
    **settings: Any,
) -> ReadSettings:
    """The settings of a read by `method` (one of METHODS but auto, which `read` resolves); a
    bounded method without a config takes the command line's defaults (`BoundedOptions`;
    two-level: `TWO_LEVEL`)."""
    require(method in METHODS, None, "method", f"must be one of {METHODS}, got {method!r}")
    require(
        method != AUTO, None, "method",
        "auto is chosen from the document's length: read() resolves it (`auto_method`)",
    )  # fmt: skip
    if method == "two-level":
        method = "kvm-fold"
        config = config or TWO_LEVEL
        require(
            isinstance(config, KVMFoldConfig) and config.open > 0, None, "config",
            "two-level reads with a KVMFoldConfig that opens slots (open > 0)",
        )  # fmt: skip
    if method not in BOUNDED:
        return ReadSettings(method, method, None, **settings)
    if config is None:
        ((label, config),) = BoundedOptions().bounded_configs((method,)).items()
    else:
        label = config_label(method, config)
    return ReadSettings(method, label, config, **settings)


@dataclass
class Answer:
    """An answer: its text and tokens (eos not included), the seconds from the question to
    the first token and to the last, and the tokens read for the question (its part of the
    prompt, after the document's last chunk)."""

    question: str
    text: str
    tokens: list[int]
    first_token_seconds: float
    seconds: float
    read_tokens: int

    def as_json(self) -> dict[str, Any]:
        """The answer for scripts: question, answer, seconds, tokens."""
        return {
            "question": self.question, "answer": self.text, "seconds": self.seconds,
            "first_token_seconds": self.first_token_seconds, "tokens": len(self.tokens),
        }  # fmt: skip


@dataclass
class Document:
    """A document read by one method: the runner as the read left it, the document's tokens it
    has not read yet (`pending`, read with each question), the number of the document's
    tokens, and the model's id for a save (default: the folder or hub id it was loaded from).
    Ask it questions (`ask`), keep it (`save`, `longkv.load`)."""

    model: nn.Module
    tokenizer: Any
    settings: ReadSettings
    runner: FoldRunner | BoundedRunner
    pending: list[int]
    tokens: int
    read_seconds: float = 0.0
    model_id: str = ""

    def __post_init__(self) -> None:
        self.model_id = self.model_id or str(getattr(self.model, "name_or_path", ""))

    def save(self, path: str | Path, kv_dtype: str = AUTO) -> Path:
        """Keep the read in folder `path`, atomically, its keys and values in kv_dtype (AUTO:
        float16 for a float32 read; `longkv.document.save.save`)."""
        from longkv.document.save import save  # save imports this module

        return save(self, path, kv_dtype)

    def ask(
        self,
        question: str,
        max_new_tokens: int = 128,
        *,
        pick: Pick = greedy,
        on_text: Callable[[str], object] | None = None,
        stop_at_repeat: bool = True,
        progress: bool = False,
    ) -> Answer:
        """Answer a question from the read, without changing it: greedy unless `pick` samples;
        on_text sees the answer's text in pieces as they come, which join into its text;
        stop_at_repeat: stop where the answer starts to repeat itself, and without a chat
        template at the end of its first sentence (`document.repeat`; the repeat is never in a
        piece nor in the text)."""
        require(bool(question.strip()), None, "question", "is empty; ask something")
        ids = question_ids(self.tokenizer, question, self.settings.chat)
        return self.answer(
            ids, max_new_tokens, question=question, pick=pick, on_text=on_text,
            stop_at_repeat=stop_at_repeat, progress=progress,
        )  # fmt: skip

    def answer(
        self,
        ids: list[int],
        max_new_tokens: int = 128,
        *,
        question: str = "",
        pick: Pick = greedy,
        on_text: Callable[[str], object] | None = None,
        stop_at_repeat: bool = True,
        progress: bool = False,
        cancelled: Callable[[], bool] | None = None,
    ) -> Answer:
        """`ask` for the prompt's part after the document given as token ids (a question's
        part, `question_ids`, or any continuation of the prompt), the answer labelled
        `question`; cancelled: asked after each token, True stops the answer there."""
        require(bool(ids), None, "ids", "is empty: a continuation has at least one token")
        require(max_new_tokens >= 1, None, "max_new_tokens", f"must be >= 1, got {max_new_tokens}")
        s, tok = self.settings, self.tokenizer
        tensor = torch.tensor([self.pending + list(ids)], device=input_device(self.model))
        eos = getattr(tok, "eos_token_id", None)
        start = time.perf_counter()
        first: list[float] = []
        watch = AnswerWatch.of_prompt(tok, s.chat, stops=stop_at_repeat)
        shown = [0]  # the characters of the text given to on_text

        def show(text: str) -> None:
            if on_text is not None and len(text) > shown[0]:
                on_text(text[shown[0] :])
                shown[0] = len(text)

        def seen(token: torch.Tensor) -> bool:
            if not first:
                first.append(time.perf_counter() - start)
            if int(token[0]) == eos:
                return False
            stop = watch(token)
            show(watch.final() if stop else watch.text[: watch.shown])
            return stop or (cancelled is not None and cancelled())

        runner = fork(self.runner)
        if isinstance(runner, FoldRunner):
            chunk = tensor.shape[1] if s.method == "full" else s.chunk_size
            out = fold_generate(
                self.model, tensor, chunk, max_new_tokens, eos_token_id=eos,
                cache=runner.cache, allow_extrapolation=s.allow_extrapolation,
                progress=progress, pick=pick, on_token=seen,
            )  # fmt: skip
        else:
            out = bounded_generate(
                runner, tensor, s.stream_chunk, max_new_tokens, eos_token_id=eos,
                progress=progress, pick=pick, on_token=seen, desc=s.label,
            )  # fmt: skip
        tokens = [t for t in out[0].tolist() if t != eos]
        text = watch.final()
        show(text)
        return Answer(
            question, text, tokens, first[0], time.perf_counter() - start, tensor.shape[1]
        )  # fmt: skip

    def extend(self, ids: list[int], progress: bool = False) -> Document:
        """The read continued by more of the prompt (token ids after the document's), as a
        new Document; this one is left as it was. It reads as `read` does (`read_on`), so the
        extended read is a fresh read's of document and ids."""
        start = time.perf_counter()
        ids = self.pending + [int(t) for t in ids]
        before = self.tokens - len(self.pending)
        runner, pending = read_on(
            self.model, fork(self.runner), ids, self.settings, before, progress
        )
        return Document(
            self.model, self.tokenizer, self.settings, runner, pending, before + len(ids),
            self.read_seconds + time.perf_counter() - start, self.model_id,
        )  # fmt: skip


def check_document(text: str) -> None:
    """Refuse a document that is empty (or whitespace) or not text (it holds NUL characters)."""
    require(bool(text.strip()), None, "document", "is empty: there is nothing to read")
    require("\x00" not in text, None, "document", "holds NUL characters: it is not text")


def read(
    model: nn.Module,
    tokenizer: Any,
    document: str | list[int],
    method: str = AUTO,
    *,
    config: BoundedConfig | None = None,
    progress: bool = True,
    **settings: Any,
) -> Document:
    """Read a document (a text, or its token ids as the prompt's document part) once, by
    `method` (`METHODS`; a bounded one with `config`, else the command line's defaults; auto:
    the exact fold while the document and ASK_ROOM positions fit the model's, else
    LONG_METHOD, `auto_method`), to ask it questions. settings: chunk_size (fold; FOLD_CHUNK,
    1024), stream_chunk (bounded; STREAM_CHUNK, 64; both chosen by measurement, see them), chat
    (put the prompt in the tokenizer's chat template, True), allow_extrapolation (False)."""
    chat = settings.get("chat", True)
    if isinstance(document, str):
        check_document(document)
        ids = document_ids(tokenizer, document, chat)
    else:
        ids = [int(t) for t in document]
        require(bool(ids), None, "document", "has no tokens: there is nothing to read")
    if method == AUTO:
        require(
            config is None, None, "config",
            "belongs to the method it configures; pass that method, not auto",
        )  # fmt: skip
        method = auto_method(model.config, len(ids) + ASK_ROOM)[0]
        if method == LONG_METHOD:
            ((_, config),) = BoundedOptions(**LONG_OPTIONS).bounded_configs((method,)).items()
    return read_ids(model, tokenizer, ids, read_settings(method, config, **settings), progress)


def read_ids(
    model: nn.Module, tokenizer: Any, ids: list[int], s: ReadSettings, progress: bool = True
) -> Document:
    """`read` of the document part's token ids under settings s."""
    start = time.perf_counter()
    fresh = None if s.config is None else make_runner(model, s.config)
    runner, pending = read_on(model, fresh, ids, s, 0, progress)
    return Document(model, tokenizer, s, runner, pending, len(ids), time.perf_counter() - start)


def read_on(
    model: nn.Module, runner: FoldRunner | BoundedRunner | None, ids: list[int],
    s: ReadSettings, before: int, progress: bool,
) -> tuple[FoldRunner | BoundedRunner, list[int]]:  # fmt: skip
    """The runner (None: the fold's or full attention's, none read yet) after reading token ids
    by settings s, past the `before` tokens it has read, and the ids it leaves pending: the fold
    reads them all (refusing positions the model lacks); a bounded cache reads whole chunks of
    `stream_chunk` (a retrieval cache at exact positions refused past the model's), each
    question then reading the rest before its own, and keeps room for a fork's leaves."""
    tensor = torch.tensor([ids], device=input_device(model))
    if s.config is None:
        if not ids:
            assert runner is not None
            return runner, []
        chunk = len(ids) if s.method == "full" else s.chunk_size
        fold = kv_fold(
            model, tensor, chunk, cache=None if runner is None else runner.cache, score=False,
            allow_extrapolation=s.allow_extrapolation, progress=progress, room=LEAF_ROOM,
            cache_dtype=s.packed,
        )  # fmt: skip
        return FoldRunner(model, fold.cache, fold.next_position), []
    assert isinstance(runner, BoundedRunner)
    if isinstance(runner, RetrievalRunner) and not runner.inside:
        check_exact_positions(model.config, before + len(ids), f"the document ({s.label})")
    whole = len(ids) // s.stream_chunk * s.stream_chunk
    if whole:
        bounded_fold(
            runner, tensor[:, :whole], s.stream_chunk, score=False, progress=progress,
            desc=s.label,
        )  # fmt: skip
    if isinstance(runner, RetrievalRunner):
        for store in runner.leaves:
            if store is not None:
                store.reserve(LEAF_ROOM)
    return runner, ids[whole:]
