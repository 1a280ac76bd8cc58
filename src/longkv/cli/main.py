"""`longkv` entry point: niah, fold, drift, train, eval-loss, generate, bench kvm, bench train."""

from __future__ import annotations

import argparse
import sys

from longkv.cli import bench as bench_commands
from longkv.cli import fold as fold_commands
from longkv.cli import niah as niah_command
from longkv.cli import train as train_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longkv", description="Long-context memory for transformers."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    bench_commands.add_parsers(commands)
    fold_commands.add_parsers(commands)
    niah_command.add_parser(commands)
    train_commands.add_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse argv (default sys.argv[1:]) and run the chosen command."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"longkv: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
