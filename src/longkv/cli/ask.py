"""`longkv ask`: a question about a long document (a file or standard input), read by any
method of the method table (full attention, the fold, a bounded cache), the answer printed as
it is generated."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longkv.caches.methods import (
    CACHE_METHODS,
    BoundedOptions,
    keeps_positions,
    make_runner,
    read_and_answer,
)
from longkv.caches.retrieval import check_exact_positions
from longkv.checks import refused_as, require, require_at_least, setting
from longkv.cli.args import command
from longkv.cli.common import LoadOptions, dtype_setting, input_device
from longkv.decoding import Pick, Sampler, greedy
from longkv.fold.fold import CLI_SWITCH, check_positions


@dataclass(frozen=True)
class AskOptions(BoundedOptions):
    """`longkv ask`: the document, the question, how the model reads them and how it answers."""

    file: str | None = setting(
        None, "the document: a text file, or - for standard input", required=True
    )
    question: str | None = setting(None, "what to ask about the document", required=True)
    method: str = setting(
        "fold",
        "how the model reads document and question: full (one forward), fold (chunks of "
        "--chunk-size, exact) or a bounded cache (streaming, snapkv, kvm-fold, quest, infllm; "
        "one budget)",
        choices=CACHE_METHODS,
    )
    chunk_size: int = setting(1024, "fold: chunk (tokens)")
    chat: bool = setting(
        True, "put document and question in the tokenizer's chat template when it has one"
    )
    max_new_tokens: int = setting(128, "answer tokens at most")
    sample: bool = setting(False, "sample instead of greedy")
    temperature: float = setting(1.0, "sampling temperature")
    top_k: int | None = setting(None, "sample from the k likeliest (default: all)")
    top_p: float = setting(1.0, "sample from the likeliest whose probability reaches p")
    seed: int = setting(0, "seed of the sampling")
    dtype: str = dtype_setting()

    def __post_init__(self) -> None:
        require_at_least(1, self, "chunk_size", "max_new_tokens")
        require(
            self.method in CACHE_METHODS, self, "method", f"must be one of {CACHE_METHODS}"
        )  # fmt: skip
        runs = self.labels((self.method,))
        require(
            len(runs) == 1, self, "budgets",
            f"ask reads with one method run; these options make {runs}: give one budget, one "
            "--kvm-states and one --kvm-open",
        )  # fmt: skip
        with refused_as(self):  # the sampler's refusal, as this option's
            self.pick()

    def pick(self) -> Pick:
        """How the answer's tokens are chosen: greedy, or a seeded `Sampler`."""
        if not self.sample:
            return greedy
        generator = torch.Generator().manual_seed(self.seed)
        return Sampler(self.temperature, self.top_k, self.top_p, generator)


def prompt_ids(tokenizer: Any, document: str, question: str, chat: bool = True) -> list[int]:
    """The prompt's token ids: document and question as one user turn of the tokenizer's chat
    template (with the assistant's turn opened) when it has one and `chat`; else the document,
    a blank line, "Question: ..." and "Answer:"."""
    if chat and getattr(tokenizer, "chat_template", None):
        turn = [{"role": "user", "content": f"{document}\n\n{question}"}]
        encoded = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"])
    return list(tokenizer(f"{document}\n\nQuestion: {question}\nAnswer:")["input_ids"])


class Printer:
    """Prints the answer as its tokens come (`read_and_answer`'s on_token), up to eos."""

    def __init__(self, tokenizer: Any, eos: int | None) -> None:
        self.tokenizer, self.eos = tokenizer, eos
        self.tokens: list[int] = []
        self.shown = ""

    def __call__(self, ids: torch.Tensor) -> None:
        token = int(ids[0])
        if token == self.eos:
            return
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a character cut between tokens waits for the next
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `ask`."""
    command(parser, run, LoadOptions, AskOptions)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[LoadOptions], args.settings[AskOptions]
    assert o.file is not None and o.question is not None
    if o.file == "-":
        document = sys.stdin.read()
    else:
        path = Path(o.file)
        require(path.is_file(), o, "file", f"{o.file} is not a file")
        document = path.read_text(encoding="utf-8")
    model, tokenizer = m.load(o.dtype)
    ids = prompt_ids(tokenizer, document, o.question, o.chat)
    configs = o.check_runs(model, (o.method,), "method")
    label = o.labels((o.method,))[0]
    config = configs.get(label)
    needed = len(ids) + o.max_new_tokens - 1  # the last answer token is never read
    if config is None:  # full attention and the fold place every token at its own position
        with refused_as(o, "file"):
            check_positions(
                model, needed, f"the document, question and answer under {o.method}",
                allow_extrapolation=m.allow_extrapolation, switch=CLI_SWITCH,
            )  # fmt: skip
    elif keeps_positions(config):  # so do the retrieval caches
        with refused_as(o, "file"):
            check_exact_positions(model, needed, f"the document, question and answer ({label})")
    eos = getattr(tokenizer, "eos_token_id", None)
    tensor = torch.tensor([ids], device=input_device(model))
    runner = None if config is None else make_runner(model, config)
    print(f"{len(ids)} tokens read by {label}; answer:", file=sys.stderr)
    read_and_answer(
        model, tensor, label, o.max_new_tokens, runner=runner, chunk_size=o.chunk_size,
        stream_chunk=o.stream_chunk, eos_token_id=eos, allow_extrapolation=m.allow_extrapolation,
        pick=o.pick(), on_token=Printer(tokenizer, eos),
    )  # fmt: skip
    print()
    return 0
