"""`longkv` entry point: niah, fold, drift, train, eval, generate, study, bench and more.

The top-level parser lists the commands from the table below without importing them; only the
chosen command's module is imported (with torch and transformers), to build its options.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from tqdm import tqdm

from longkv.checks import SettingError
from longkv.cli.args import DECLARED, HelpFormatter, build_settings, declared
from longkv.cli.helptext import kept_help
from longkv.version import __version__

# command -> (module that builds its parser with `configure(name, parser)`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ask": (
        "longkv.cli.ask",
        "ask questions about a long document of any length (a file, stdin or a saved read), "
        "read once: by the exact fold while it fits the model's trained positions, else by a "
        "bounded cache (--method auto); each answer printed as it comes",
    ),
    "read": (
        "longkv.cli.ask",
        "read a long document once (any method of ask) and save the read, for ask --load",
    ),
    "serve": (
        "longkv.cli.serve",
        "an OpenAI-compatible server (chat and completions) that keeps each document's read and "
        "answers a second question about it from the kept read",
    ),
    "niah": (
        "longkv.cli.niah",
        "needle in a haystack: full, fold and bounded caches; JSON, table and heatmap",
    ),
    "fold": (
        "longkv.cli.fold",
        "fold a pretrained model over corpus text; time, memory and NLL against full",
    ),
    "drift": (
        "longkv.cli.fold",
        "per-chunk drift of the fold against one full forward, as a table and a PNG",
    ),
    "bounded": (
        "longkv.cli.bounded",
        "bounded caches (streaming, snapkv, kvm-fold, quest, infllm) against full: NLL, "
        "memory, needles",
    ),
    "bench": (
        "longkv.cli.bench",
        "benchmarks: bench kvm, train, document, qa, readme, routing (recall of retrieval caches), "
        "serve (longkv serve over HTTP), anchor (longkv against llama.cpp)",
    ),
    "models": (
        "longkv.cli.models",
        "the converted models and GGUF files in the cache ($LONGKV_CACHE) with their sizes; "
        "--remove NAME",
    ),
    "train": ("longkv.cli.train", "train a longkv language model from a YAML run"),
    "eval-loss": ("longkv.cli.train", "held-out loss of a trained run"),
    "eval": (
        "longkv.cli.evaluate",
        "lm-evaluation-harness tasks on a longkv model or any causal LM, any batch size",
    ),
    "generate": ("longkv.cli.train", "continue a prompt with a trained model"),
    "compare-runs": (
        "longkv.cli.train",
        "finished runs side by side: held-out loss on the same rows, time, loss curves",
    ),
    "tokenizer": ("longkv.cli.train", "tokenizers for longkv runs: tokenizer train"),
    "study": (
        "longkv.cli.study",
        "train a grid of model variants x seeds on the same rows, evaluate, report",
    ),
}


# command -> a command line that runs it, shown under its --help
EXAMPLES: dict[str, str] = {
    "ask": (
        'longkv ask --file book.txt --question "Who is Mr. Darcy?" '
        '--question "Where is Netherfield?"'
    ),
    "read": (
        "longkv read --file book.txt --method two-level --save book.read; "
        'longkv ask --load book.read --question "Who is Mr. Darcy?"'
    ),
    "serve": "longkv serve --port 8000 --api-key KEY",
    "niah": (
        "longkv niah --tasks niah_single_1 --lengths 4096 8192 --depths 0.25 0.5 0.75 "
        "--methods full fold"
    ),
    "fold": "longkv fold --tokens 8192 --chunk-size 1024",
    "drift": (
        "longkv drift --chunk-sizes 16 64 256 --dtypes fp32 bf16 "
        "--variants exact restart bf16-cache"
    ),
    "bounded": (
        "longkv bounded --methods full streaming snapkv kvm-fold quest infllm --budgets 512 1024"
    ),
    "bench": (
        "longkv bench routing --model gemma3 --lengths 8192 32768 --methods kvm-fold quest infllm"
    ),
    "models": "longkv models --remove gemma3",
    "train": "longkv train --config configs/tiny_kvm.yaml data.folder=CORPUS train.steps=100",
    "eval-loss": "longkv eval-loss --config configs/tiny_kvm.yaml",
    "eval": "longkv eval --model runs/tiny_kvm/model --tasks piqa hellaswag --batch-size 8",
    "generate": 'longkv generate --model runs/tiny_kvm/model --prompt "Once upon a time"',
    "compare-runs": (
        "longkv compare-runs --configs configs/tiny_full.yaml configs/tiny_kvm.yaml "
        "--name train_tiny"
    ),
    "tokenizer": "longkv tokenizer train --corpus-dir CORPUS --out runs/bpe_8k --vocab-size 8192",
    "study": "longkv study --config configs/study/example_mqar.yaml",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `longkv` parser; only `command`'s options are built (its module imported)."""
    parser = argparse.ArgumentParser(
        prog="longkv",
        description="Long-context memory for transformers. `longkv COMMAND --help` for a "
        "command's options.",
    )
    parser.add_argument("--version", action="version", version=f"longkv {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter,
            epilog=f"example:\n  {EXAMPLES[name]}",
        )  # fmt: skip
        declared(sub)
        if name == command:
            importlib.import_module(module).configure(name, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse argv (default sys.argv[1:]) and run the chosen command; 2 on bad input, 130 after
    Ctrl-C at any moment, the command's imports included (train and study say where their run
    stands themselves)."""
    argv = sys.argv[1:] if argv is None else argv
    if (stored := kept_help(argv)) is not None:  # without building the command's options
        print(stored, end="")
        return 0
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = None
    try:
        args = build_parser(command).parse_args(argv)
        build_settings(args)  # bad values are refused here, before the command starts
        return args.func(args, argv)
    except SettingError as err:
        explained = getattr(args, DECLARED).explain(err)
        print(explained or f"longkv: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:  # OSError: FileNotFoundError, a model not found
        print(f"longkv: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # one line: what was kept, and the command that goes on
        again = shlex.join(["longkv", *argv])
        kept = getattr(args, "kept", None)
        if callable(kept):
            kept = kept(args) if hasattr(args, "settings") else None
        said = f"{kept}; resume with: {again}" if kept else f"nothing kept; rerun: {again}"
        for bar in list(getattr(tqdm, "_instances", ())):  # the line is not glued to a bar's
            bar.close()
        who = f"longkv {command}" if command else "longkv"
        print(f"{who}: interrupted; {said}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
