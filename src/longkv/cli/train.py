"""`longkv train`, `eval-loss`, `generate`, `compare-runs` and `tokenizer train`.

Each parses its options, calls `longkv.train` (runs: `train.run`, comparisons: `train.compare`,
tokenizers: `train.tokenizer`) and prints what it did.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longkv.checks import require_at_least, setting
from longkv.cli.args import HelpFormatter, command
from longkv.cli.common import require_own_page
from longkv.data.corpus import read_document
from longkv.models.pretrained import load_model, resolve_model
from longkv.results import OUT_DIR, OUT_DIR_HELP
from longkv.train.checkpoint import CHECKPOINT
from longkv.train.compare import compare_runs
from longkv.train.data import document_files, split_every
from longkv.train.loop import METRICS_FILE, Interrupted
from longkv.train.report import RUN_FILE
from longkv.train.rows import evaluate, world
from longkv.train.run import RunSections, describe_model, finished_run, load_run, train_run
from longkv.train.tokenizer import load_tokenizer, train_bpe


@dataclass(frozen=True)
class RunOptions:
    """A YAML run and the key=value entries over it."""

    config: str | None = setting(None, "YAML run file, e.g. configs/tiny_kvm.yaml", required=True)
    overrides: tuple[str, ...] = setting(
        (),
        "key=value entries over the run's, e.g. train.steps=10 (none: the run as written)",
        positional=True,
    )


@dataclass(frozen=True)
class TrainOptions:
    """`longkv train`."""

    dry_run: bool = setting(
        False, "print the run's model and its parameter counts, then stop (no data, no weights)"
    )


@dataclass(frozen=True)
class EvalOptions:
    """`longkv eval-loss`."""

    batches: int = setting(16, "held-out batches scored")

    def __post_init__(self) -> None:
        require_at_least(1, self, "batches")


@dataclass(frozen=True)
class GenerateOptions:
    """`longkv generate`."""

    model: str | None = setting(None, "a saved model folder, e.g. runs/x/model", required=True)
    tokenizer: str | None = setting(None, "default: the model folder's own, else the shipped GPT-2")
    prompt: str | None = setting(None, "the text to continue", required=True)
    max_new_tokens: int = setting(64, "new tokens at most")
    sample: bool = setting(False, "sample instead of greedy")
    temperature: float = setting(1.0, "sampling temperature")
    top_k: int | None = setting(None, "sample from the k likeliest (default: all)")
    seed: int = setting(0, "seed of the sampling")

    def __post_init__(self) -> None:
        require_at_least(1, self, "max_new_tokens")


@dataclass(frozen=True)
class CompareOptions:
    """`longkv compare-runs`."""

    configs: tuple[str, ...] = setting((), "YAML runs; the first is the base", required=True)
    batches: int = setting(64, "held-out batches (capped at all)")
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("compare_runs", "file name stem of the results")

    def __post_init__(self) -> None:
        require_at_least(1, self, "batches")


@dataclass(frozen=True)
class TokenizerOptions:
    """`longkv tokenizer train`."""

    out: str | None = setting(None, "folder for the tokenizer (data.tokenizer)", required=True)
    vocab_size: int = setting(8192, "tokens in the vocabulary")
    min_frequency: int = setting(2, "fewest occurrences of a pair to merge")
    corpus_dir: str | None = setting(
        None, "folder of training documents (default: $LONGKV_CORPUS_DIR)"
    )
    every: int = setting(20, "every n-th document is held out, never seen")

    def __post_init__(self) -> None:
        require_at_least(1, self, "vocab_size", "min_frequency", "every")


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `train`, `eval-loss`, `generate`, `compare-runs` or `tokenizer train`."""
    if name == "tokenizer":
        parser = parser.add_subparsers(
            dest="tokenizer_command", required=True, metavar="ACTION"
        ).add_parser(
            "train",
            help="train a byte-level BPE on a corpus's training documents",
            description="Train a byte-level BPE on a corpus's training documents.",
            formatter_class=HelpFormatter,
        )
    run, *settings = {
        "train": (run_train, RunOptions, TrainOptions),
        "eval-loss": (run_eval, RunOptions, EvalOptions),
        "generate": (run_generate, GenerateOptions),
        "compare-runs": (run_compare, CompareOptions),
        "tokenizer": (run_tokenizer_train, TokenizerOptions),
    }[name]
    command(parser, run, *settings)


def run_train(args: argparse.Namespace, argv: list[str]) -> int:
    o = args.settings[RunOptions]
    sections = RunSections.of(load_run(o.config, list(o.overrides)))
    if args.settings[TrainOptions].dry_run:
        print(describe_model(sections))
        return 0
    out = sections.out
    rank, command = world()[0], shlex.join(["longkv", *argv])
    try:
        metrics = train_run(sections, argv, rank)
    except KeyboardInterrupt as stop:  # no traceback: where the run stands and how to go on
        if rank == 0 and isinstance(stop, Interrupted):
            again = "resume with" if stop.checkpoint_step else "nothing to resume; rerun with"
            print(f"longkv train: {stop}; {again}: {command}", file=sys.stderr)
        elif rank == 0:  # outside the steps, which lose nothing (checkpoints are atomic)
            print(
                f"longkv train: interrupted outside the training steps; rerun: {command}",
                file=sys.stderr,
            )
        return 130
    if rank != 0:
        return 0
    last = metrics[-1]
    eval_loss = last.get("eval_loss", float("nan"))
    print(f"step {last['step']}: loss {last['loss']:.4f}, eval loss {eval_loss:.4f}")
    print(f"wrote {out}/{CHECKPOINT}, {out}/{METRICS_FILE}, {out}/model, {out}/{RUN_FILE}")
    return 0


def run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    o, batches = args.settings[RunOptions], args.settings[EvalOptions].batches
    run = finished_run(o.config, load_run(o.config, list(o.overrides)), "--config")
    batch_size = run.sections.train.batch_size
    loss = evaluate(run.model(), run.held_out(), batches, batch_size)
    print(f"held-out loss {loss:.4f} over {batches} batches of {batch_size}")
    return 0


def run_generate(args: argparse.Namespace, argv: list[str]) -> int:
    o = args.settings[GenerateOptions]
    path = resolve_model(o.model)
    model = load_model(path)  # any causal LM, as what it is; a longkv model is one
    own = (Path(path) / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(o.tokenizer or (path if own else None))
    eos = model.generation_config.eos_token_id  # the model's own, else the tokenizer's
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": o.temperature, "top_k": o.top_k or 0}
        if o.sample
        else {"do_sample": False}
    )  # top_k 0: every token
    torch.manual_seed(o.seed)
    out = model.generate(
        **tokenizer(o.prompt, return_tensors="pt"), max_new_tokens=o.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id if eos is None else eos, **sampling,
    )  # fmt: skip
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


def run_tokenizer_train(args: argparse.Namespace, argv: list[str]) -> int:
    o = args.settings[TokenizerOptions]
    train_files, held_files = split_every(document_files(o.corpus_dir), o.every)
    tokenizer = train_bpe(train_files, o.vocab_size, o.out, min_frequency=o.min_frequency)
    text = "".join(read_document(f) for f in held_files[:3])
    per_token = len(text) / max(1, len(tokenizer(text)["input_ids"]))
    short = "" if len(tokenizer) == o.vocab_size else " (no more pairs seen often enough)"
    print(f"{len(tokenizer)} tokens{short}; {per_token:.2f} characters per held-out token")
    print(f"wrote {o.out}; use it with data.tokenizer={o.out}")
    return 0


def run_compare(args: argparse.Namespace, argv: list[str]) -> int:
    o = args.settings[CompareOptions]
    stem = Path(o.out_dir) / o.name
    require_own_page(stem.with_suffix(".json"), {"configs": o.configs, "batches": o.batches}, o)
    table, paths = compare_runs(list(o.configs), o.batches, stem, argv)
    print("\n".join(table))
    print("wrote " + ", ".join(map(str, paths)))
    return 0
