"""Every command's `--help`, rendered once and kept in help.json beside this file, so that
`longkv CMD --help` prints at once: building a command's options imports its module, and with it
torch and transformers (seconds). tests/test_cli.py checks that the kept text is what the
parsers render; after changing an option, write it again with `python -m longkv.cli.helptext`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

HELP_FILE = Path(__file__).with_name("help.json")
WIDTH = 100  # the columns the kept help is wrapped to
HELP_FLAGS = ("-h", "--help")


def rendered() -> dict[str, str]:
    """Each command's help, and each of its sub-commands' ("bench routing"), as the parsers
    render it at WIDTH columns, by the words that name it."""
    from longkv.cli.main import COMMANDS, build_parser  # main reads the kept text at start

    def walk(words: str, parser: argparse.ArgumentParser) -> None:
        out[words] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{words} {name}", sub)

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH + 2)  # argparse wraps at the terminal's columns - 2
    try:
        out: dict[str, str] = {}
        for command in COMMANDS:
            top = build_parser(command)
            subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
            walk(command, subs.choices[command])
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return out


def kept_help(argv: list[str]) -> str | None:
    """The kept help argv asks for (the words of a command, then -h or --help, nothing else),
    or None: then the parser is built and answers."""
    if len(argv) < 2 or argv[-1] not in HELP_FLAGS or not HELP_FILE.is_file():
        return None
    return json.loads(HELP_FILE.read_text(encoding="utf-8")).get(" ".join(argv[:-1]))


if __name__ == "__main__":
    HELP_FILE.write_text(json.dumps(rendered(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {HELP_FILE}")
