"""`longkv bench readme`: the README's Python blocks run as a user pastes them, on text of
realistic length, each statement timed against a bound.

The blocks run in order, in one namespace (a block uses the model the one before loaded), in a
scratch folder. The README's placeholder text (`PLACEHOLDER`) and the file `book.txt` its blocks
open hold the first `tokens` tokens of Pride and Prejudice (by the default model's tokenizer:
with its chat template, a document that fills most of SmolLM2's 8192 positions). Each top-level
statement is timed; one still running after `bound` seconds is stopped there (SIGALRM, between
two Python steps) and the run ends with it, as a user would stop a call that says nothing new for
minutes. The seconds are what one run took on the machine it ran on: run it alone.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from longkv.checks import require, require_at_least, setting
from longkv.results import OUT_DIR, OUT_DIR_HELP, markdown_table, provenance, write_report

PLACEHOLDER = '"...a long text..."'
BOOK = "book.txt"
TEXT = "austen/prideprejudice.txt.gz"


@dataclass(frozen=True)
class ReadmeBenchSettings:
    """`longkv bench readme`: the README, the text's length, the bound."""

    readme: str = setting("README.md", "the README whose Python blocks run")
    tokens: int = setting(7800, f"tokens of {TEXT} the long text and {BOOK} hold")
    bound: float = setting(180.0, "seconds a statement may run before it is stopped")
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("readme_bench", "stem of the result files")

    def __post_init__(self) -> None:
        require_at_least(1, self, "tokens", "bound")
        require(
            Path(self.readme).is_file(), self, "readme",
            f"{self.readme} is not a file; run from the repository's root or pass --readme PATH",
        )  # fmt: skip


def python_blocks(readme: str) -> list[str]:
    """The Python code blocks of a README's text, in order."""
    return re.findall(r"```python\n(.*?)```", readme, flags=re.S)


class OverBoundError(BaseException):
    """A statement ran past its bound (a BaseException, as KeyboardInterrupt: no `except
    Exception` inside the statement swallows it)."""


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise OverBoundError in the block once it has run `seconds` (main thread only)."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise OverBoundError

    before = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def statements(block: str) -> list[tuple[int, str, ast.Module]]:
    """Each top-level statement of a block: (its first line, its source, itself as a module)."""
    tree = ast.parse(block)
    return [
        (s.lineno, ast.get_source_segment(block, s) or "", ast.Module(body=[s], type_ignores=[]))
        for s in tree.body
    ]


def run_blocks(blocks: list[str], text: str, bound: float, folder: Path) -> list[dict[str, Any]]:
    """Run the blocks' statements in order in `folder`, PLACEHOLDER and BOOK holding `text`;
    each statement's block, line, source, seconds and whether it finished within `bound`.
    The run ends at the first statement stopped at its bound."""
    (folder / BOOK).write_text(text)
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    rows: list[dict[str, Any]] = []
    before = Path.cwd()
    os.chdir(folder)
    try:
        for b, block in enumerate(blocks, 1):
            for line, source, module in statements(block.replace(PLACEHOLDER, repr(text))):
                code = compile(module, f"README.md block {b}", "exec")
                start = time.perf_counter()
                try:
                    with bounded(bound):
                        exec(code, namespace)
                    finished = True
                except OverBoundError:
                    finished = False
                seconds = time.perf_counter() - start
                shown = source.replace(repr(text), PLACEHOLDER)
                rows.append({"block": b, "line": line, "statement": shown, "seconds": seconds,
                             "finished": finished})  # fmt: skip
                print(f"block {b}, line {line}: {seconds:.1f} s"
                      + ("" if finished else f", stopped at the bound ({bound:g} s)"),
                      flush=True)  # fmt: skip
                if not finished:
                    return rows
    finally:
        os.chdir(before)
    return rows


def long_text(tokens: int) -> str:
    """The first `tokens` tokens of TEXT by the default model's tokenizer, as text."""
    from transformers import AutoTokenizer

    from longkv.bench.document import document_text
    from longkv.models.pretrained import resolve_model

    return document_text(AutoTokenizer.from_pretrained(resolve_model(None)), TEXT, tokens)


def run(s: ReadmeBenchSettings, argv: list[str] | None = None) -> dict[str, Any]:
    """The README's blocks on the long text (`run_blocks`), with the provenance."""
    blocks = python_blocks(Path(s.readme).read_text())
    require(
        any(PLACEHOLDER in b or BOOK in b for b in blocks), s, "readme",
        f"no Python block of {s.readme} reads a long text ({PLACEHOLDER} or {BOOK}): "
        "nothing would run at length",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="longkv-readme-") as folder:
        rows = run_blocks(blocks, long_text(s.tokens), s.bound, Path(folder))
    return {"provenance": provenance(argv), "settings": asdict(s), "statements": rows}


def within_bound(report: dict[str, Any]) -> bool:
    """Whether every statement finished within the bound (the run reached the README's end)."""
    return all(r["finished"] for r in report["statements"])


def write_page(report: dict[str, Any], s: ReadmeBenchSettings) -> list[Path]:
    """<out_dir>/<name>.json and .md: each statement's seconds against the bound."""
    rows = [
        [str(r["block"]), str(r["line"]), "`" + " ".join(r["statement"].split())[:90] + "`",
         f"{r['seconds']:.1f}", "yes" if r["finished"] else "stopped"]
        for r in report["statements"]
    ]  # fmt: skip
    total = sum(r["seconds"] for r in report["statements"])
    body = [
        "",
        f"- the README's Python blocks in order, {PLACEHOLDER} and {BOOK} holding the first "
        f"{s.tokens} tokens of {TEXT}; a statement is stopped after {s.bound:g} s",
        f"- {len(rows)} statements, {total:.0f} s in all: "
        + ("every one finished within the bound" if within_bound(report) else
           "stopped at the bound; the statements after it did not run"),
        "",
        *markdown_table(["block", "line", "statement", "seconds", "within bound"], rows, ">><><"),
    ]  # fmt: skip
    out = Path(s.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_report(out / s.name, "The README's snippets at length", report, body)
