"""`longkv ask`: questions about a long document (a file, standard input, or a read saved by
`longkv read`), the document read once by any method of the method table (full attention, the
fold, a bounded cache), each answer printed as it is generated (or as JSON lines); `longkv
read`: read a document once and save the read, to ask it later."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, ClassVar

import torch

from longkv.caches.bounded import BoundedConfig
from longkv.caches.kvm_fold import STATES, TWO_LEVEL, KVMFoldConfig
from longkv.caches.leaves import LEAF_STORES
from longkv.caches.methods import BOUNDED, BoundedOptions, keeps_positions
from longkv.caches.retrieval import check_exact_positions
from longkv.checks import refused_as, require, require_at_least, setting
from longkv.cli.args import Groups, command, given
from longkv.cli.common import LoadOptions, dtype_setting
from longkv.decoding import Pick, Sampler, greedy
from longkv.document.prompt import document_ids, question_ids
from longkv.document.read import (
    ASK_ROOM,
    AUTO,
    LONG_METHOD,
    LONG_OPTIONS,
    METHODS,
    PACKED_METHODS,
    Answer,
    Document,
    ReadSettings,
    auto_method,
    check_document,
    read_ids,
)
from longkv.document.save import load
from longkv.dtypes import DTYPES
from longkv.fold.fold import CLI_SWITCH, FOLD_CHUNK, check_positions


@dataclass(frozen=True)
class DocumentOptions(BoundedOptions):
    """The document and how the model reads it (`ask` and `read`): one method run, so the
    options that make several take one value each, and there is no --only."""

    omitted: ClassVar[tuple[str, ...]] = ("only",)
    # what else makes the read fit the model's positions, besides a bounded method
    fewer: ClassVar[str] = ""
    budgets: tuple[int, ...] = setting(
        (1024,),
        "entries per layer and KV head of the bounded method (the leaves of two-level "
        "kvm-fold, quest and infllm outside it)",
        feeds=(BoundedConfig, "budget"), flag="--budget",
    )  # fmt: skip
    kvm_states: tuple[str, ...] = setting(
        ("fixed",), "kvm-fold: its state budget", choices=STATES,
        feeds=(KVMFoldConfig, "state"), flag="--kvm-state",
    )  # fmt: skip
    kvm_open: tuple[int, ...] = setting(
        (0,),
        "kvm-fold: two-level KVM-Fold: slots each query head opens to the exact tokens they "
        "own (0: the coarse state alone)",
        feeds=(KVMFoldConfig, "open"), flag="--kvm-open",
    )  # fmt: skip
    kvm_leaves: tuple[str, ...] = setting(
        ("exact",), "kvm-fold: two-level KVM-Fold: the store of the tokens that left the "
        "window", choices=LEAF_STORES, feeds=(KVMFoldConfig, "leaves"), flag="--kvm-leaf-store",
    )  # fmt: skip
    file: str | None = setting(None, "the document: a text file, or - for standard input")
    method: str = setting(
        AUTO,
        "how the model reads the document: auto (the fold while the document, question and "
        "answer fit the model's trained positions, else infllm with --positions inside; one "
        "line says which), full (one forward), fold (chunks of --chunk-size, exact), a bounded "
        "cache (streaming, snapkv, kvm-fold, quest, infllm; one budget) or "
        "two-level (kvm-fold set as docs/kvfold.md's two-level setting: budget 2048 = "
        "4 sinks + 1024 slots + 1020 recent, --kvm-open 1024, --kvm-rerank 4096, "
        "--kvm-slot-cap 1, --routing token; an option given changes that part)",
        choices=METHODS,
    )
    chunk_size: int = setting(FOLD_CHUNK, "fold: chunk (tokens)")
    chat: bool = setting(
        True, "put document and question in the tokenizer's chat template when it has one"
    )
    dtype: str = dtype_setting()
    cache_dtype: str | None = setting(
        None,
        "full and fold: keep the cache's keys and values packed in this dtype, attended in "
        "float32 (docs/memory.md; default: transformers' cache, in --dtype)",
        choices=sorted(DTYPES),
    )

    def __post_init__(self) -> None:
        require_at_least(1, self, "chunk_size")
        if self.method in (AUTO, "two-level"):  # resolved by `chosen`
            return
        runs = self.labels((self.method,))
        require(
            len(runs) == 1, self, "budgets",
            f"a document is read with one method run; these options make {runs}: give one "
            "budget, one --kvm-state, one --kvm-open and one --kvm-leaf-store",
        )  # fmt: skip

    def document(self) -> str:
        """The document's text (the file, or standard input), refused unless it is text."""
        assert self.file is not None
        if self.file == "-":
            text = sys.stdin.read()
        else:
            path = Path(self.file)
            require(path.is_file(), self, "file", f"{self.file} is not a file")
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                byte = err.object[err.start]
                require(
                    False, self, "file",
                    f"{self.file} is not text (not UTF-8: byte {byte:#04x} at {err.start})",
                )  # fmt: skip
        name = "standard input" if self.file == "-" else self.file
        with refused_as(self, "file", f"{name} {{}}"):
            check_document(text)
        return text

    def read_settings(self, model: torch.nn.Module, allow_extrapolation: bool) -> ReadSettings:
        """How the document is read, its bounded config checked against the model."""
        configs = self.check_runs(model, (self.method,), "method")
        label = self.labels((self.method,))[0]
        packed = self.cache_dtype if self.method in PACKED_METHODS else None  # auto: its pick
        return ReadSettings(
            self.method, label, configs.get(label), self.chunk_size, self.stream_chunk,
            self.chat, allow_extrapolation, packed,
        )  # fmt: skip

    def chosen(
        self, config: Any, needed: int, given: frozenset[str], say: bool = True
    ) -> DocumentOptions:
        """These options with the method resolved: two-level as kvm-fold with `TWO_LEVEL`'s
        setting where no option was given; auto for `needed` positions of the model of `config`
        (`auto_method`), the choice said in one line on stderr (with say). An option `given`
        that a method named does not read is refused (`refuse_ignored`); under auto, it waits
        for an input long enough that a method that reads it is chosen."""
        o = self
        if o.method == "two-level":
            kept = {k: v for k, v in two_level_options().items() if k not in given}
            o = replace(o, method="kvm-fold", **kept)
        elif o.method == AUTO:
            method, why = auto_method(config, needed)
            if say:
                print(f"read by {why}", file=sys.stderr)
            chosen = LONG_OPTIONS if method == LONG_METHOD else {}
            o = replace(o, method=method, **{k: v for k, v in chosen.items() if k not in given})
            return o  # the options of the method auto did not choose wait for longer inputs
        o.refuse_ignored(given)
        return o

    def refuse_ignored(self, given: frozenset[str]) -> None:
        """Refuse an option given that this run's method does not read (`METHOD_OPTIONS`)."""
        for patterns, methods in METHOD_OPTIONS:
            for name in sorted(given):
                if any(fnmatch(name, p) for p in patterns) and self.method not in methods:
                    require(
                        False, self, name,
                        f"is read by {', '.join(methods)} only, and {self.method} ignores it: "
                        f"drop it, or pass --method {methods[0]}",
                    )  # fmt: skip

    def room(self, tokenizer: Any) -> int:
        """Positions past the document's that the read must have: none for `read` (its
        questions are not known)."""
        return 0

    def check_positions(self, config: Any, needed: int, allow_extrapolation: bool) -> None:
        """Refuse --method unless the model of `config` has positions for `needed` tokens read
        by it, before its weights load; the refusal names the options that fix it."""
        what = f"the document, question and answer under {self.method}"
        fix = f"read it with a bounded method (--method auto, the default, picks one){self.fewer}"
        if self.method in ("full", "fold"):  # each token at its own position
            switch = f"{fix}; {CLI_SWITCH}"
            with refused_as(self, "method"):
                check_positions(
                    config, needed, what, allow_extrapolation=allow_extrapolation, switch=switch
                )
        elif keeps_positions(next(iter(self.bounded_configs((self.method,)).values()))):
            with refused_as(self, "method"):  # so do the retrieval caches at exact positions
                check_exact_positions(config, needed, what)


# the options only some methods read: (fnmatch patterns of their fields, those methods)
METHOD_OPTIONS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("chunk_size",), ("fold",)),
    (("cache_dtype",), PACKED_METHODS),
    (("budgets", "sinks", "window", "stream_chunk"), BOUNDED),
    (("kvm_*",), ("kvm-fold",)),
    (("routing", "leaf_budget"), ("kvm-fold", "quest")),
    (("positions",), ("kvm-fold", "quest", "infllm")),
    (("quest_*",), ("quest",)),
    (("infllm_*",), ("infllm",)),
)
# the options `ask --load` reads: the rest are the save's
WITH_LOAD = ("device", "load", "question", "max_new_tokens", "stop_at_repeat", "sample",
             "temperature", "top_k", "top_p", "seed", "json")  # fmt: skip


def two_level_options() -> dict[str, Any]:
    """The options of `DocumentOptions` that make a kvm-fold run read as `TWO_LEVEL`."""
    c = TWO_LEVEL
    return {
        "budgets": (c.budget,), "sinks": c.sinks, "window": c.window, "kvm_states": (c.state,),
        "kvm_open": (c.open,), "kvm_rerank": c.rerank, "leaf_budget": c.leaf_budget or 0,
        "kvm_slot_cap": c.slot_cap, "routing": c.routing,
    }  # fmt: skip


@dataclass(frozen=True)
class AskOptions(DocumentOptions):
    """`longkv ask`: the document (or a saved read), the questions and how they are answered."""

    fewer: ClassVar[str] = " or ask for fewer --max-new-tokens"

    question: tuple[str, ...] = setting(
        (), "a question about the document; give it once per question (the document is read "
        "once)", required=True, repeated=True,
    )  # fmt: skip
    load: str | None = setting(
        None, "a read saved by `longkv read --save` (instead of --file): its model, method and "
        "settings are the save's",
    )  # fmt: skip
    max_new_tokens: int = setting(128, "answer tokens at most")
    stop_at_repeat: bool = setting(
        True, "stop an answer where it starts to repeat itself (8 tokens or a line said "
        "again; never printed) and, without a chat template, at the end of its first sentence",
    )  # fmt: skip
    sample: bool = setting(False, "sample instead of greedy")
    temperature: float = setting(1.0, "sampling temperature")
    top_k: int | None = setting(None, "sample from the k likeliest (default: all)")
    top_p: float = setting(1.0, "sample from the likeliest whose probability reaches p")
    seed: int = setting(0, "seed of the sampling")
    json: bool = setting(
        False, "print one JSON line per answer (question, answer, seconds, tokens) instead "
        "of the answers as they come",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(1, self, "max_new_tokens")
        require(
            (self.file is None) != (self.load is None), self, "file",
            "give the document (--file) or a saved read (--load), one of them",
        )  # fmt: skip
        for q in self.question:
            require(bool(q.strip()), self, "question", "is empty; ask something")
        with refused_as(self):  # the sampler's refusal, as this option's
            self.pick()

    def pick(self) -> Pick:
        """How the answer's tokens are chosen: greedy, or a seeded `Sampler`."""
        if not self.sample:
            return greedy
        generator = torch.Generator().manual_seed(self.seed)
        return Sampler(self.temperature, self.top_k, self.top_p, generator)

    def room(self, tokenizer: Any) -> int:
        """Positions past the document's: the longest question and its answer (the last answer
        token is never read)."""
        asked = max(len(question_ids(tokenizer, q, self.chat)) for q in self.question)
        return asked + self.max_new_tokens - 1


@dataclass(frozen=True)
class ReadOptions(DocumentOptions):
    """`longkv read`: the document, how it is read, and where the read is kept."""

    save: str | None = setting(
        None, "the folder the read is saved to (replaced when it holds an earlier save)",
        required=True,
    )  # fmt: skip
    kv_dtype: str = setting(
        AUTO, "the dtype the save keeps keys and values in: auto (float16 for a float32 read, "
        "which measured the same answers; else as held) or a dtype, used where narrower",
        choices=(AUTO, *sorted(DTYPES)),
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.file is not None, self, "file", "give the document to read")


# the options of ask and read by what they set: the document first, each method's own last
GROUPS: Groups = (
    ("the document and the questions", ("file", "question", "load", "save", "kv_dtype")),
    ("the answers", ("max_new_tokens", "stop_at_repeat", "json", "sample", "temperature",
                     "top_k", "top_p", "seed")),
    ("how the document is read (see below)", ("method", "chat", "dtype", "chunk_size",
                                              "budgets", "sinks", "window", "stream_chunk",
                                              "positions")),
    ("the model", ("model", "device", "device_map", "allow_extrapolation")),
    ("kvm-fold and two-level options (expert)", ("kvm_*", "routing", "leaf_budget")),
    ("quest options (expert)", ("quest_*",)),
    ("infllm options (expert)", ("infllm_*",)),
)  # fmt: skip
WHICH_METHOD = """
which method: leave --method at auto. It reads with the exact fold (the model's own answers,
chunk by chunk) while the document, question and answer fit the positions the model was
trained on (SmolLM2: 8192, Gemma 3 270M: 32768), and past them with infllm, its positions inside
its budget, one line saying so; --method fold past them is refused. --method two-level reads in
bounded memory at any length (docs/documents.md, docs/kvfold.md)."""


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `ask` and `read`, in GROUPS."""
    parser.epilog = f"{parser.epilog or ''}\n{WHICH_METHOD}"
    given = "--save DIR" if name == "read" else "(--file FILE | --load DIR) --question QUESTION"
    parser.usage = f"%(prog)s {'--file FILE ' if name == 'read' else ''}{given} [options]"
    if name == "read":
        command(parser, run_read, LoadOptions, ReadOptions, groups=GROUPS)
    else:
        command(parser, run, LoadOptions, AskOptions, groups=GROUPS)


def read_document(m: LoadOptions, o: DocumentOptions, given: frozenset[str]) -> Document:
    """Read the document by the options' method (auto: chosen by its length, `auto_method`;
    `given`: the options the command line gave), after checking, before the model's weights
    load, that the model has positions for it and for the longest question with its answer."""
    text = o.document()
    path, config, tokenizer = m.entrance()
    ids = document_ids(tokenizer, text, o.chat)
    room = o.room(tokenizer)
    o = o.chosen(config, len(ids) + (room or ASK_ROOM), given)
    o.check_positions(config, len(ids) + room, m.allow_extrapolation)
    model = m.load_weights(path, o.dtype)
    s = o.read_settings(model, m.allow_extrapolation)
    doc = read_ids(model, tokenizer, ids, s)
    doc.model_id = m.model
    print(f"{doc.tokens} tokens read by {s.label} in {doc.read_seconds:.1f} s", file=sys.stderr)
    return doc


def show(text: str) -> None:
    """Print a piece of an answer as it comes (`Document.ask`'s on_text)."""
    print(text, end="", flush=True)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[LoadOptions], args.settings[AskOptions]
    if o.load is not None:
        for name in sorted(given(args) - set(WITH_LOAD)):
            require(
                False, m if hasattr(m, name) else o, name,
                "is the saved read's (--load): its model, method and settings are kept with "
                "it; drop it, or read the document again with --file",
            )  # fmt: skip
        doc = load(o.load, device=m.device)
        print(f"{doc.tokens} tokens read by {doc.settings.label}, loaded", file=sys.stderr)
    else:
        doc = read_document(m, o, given(args))
    for i, question in enumerate(o.question):
        if len(o.question) > 1 and not o.json:
            print(f"question {i + 1} of {len(o.question)}: {question}", file=sys.stderr)
        answer: Answer = doc.ask(
            question, o.max_new_tokens, pick=o.pick(), on_text=None if o.json else show,
            stop_at_repeat=o.stop_at_repeat,
        )  # fmt: skip
        print(json.dumps(answer.as_json()) if o.json else "", flush=True)
    return 0


def run_read(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[LoadOptions], args.settings[ReadOptions]
    doc = read_document(m, o, given(args))
    assert o.save is not None
    start = time.perf_counter()
    where = doc.save(o.save, o.kv_dtype)
    print(f"saved to {where} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
