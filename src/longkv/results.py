"""Result files: what every one records (command, commit, machine), written atomically.

A result is `<stem>.json` (the numbers and their provenance), `<stem>.md` (a page of tables
that says what was run) and, where a picture helps, `<stem>.png`. Commands write them to OUT_DIR
(untracked) unless told otherwise; results/ holds the committed pages, rewritten only when a
command is given `--out-dir results`.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

OUT_DIR = "out"  # where the commands write results by default
OUT_DIR_HELP = "folder for the result files; results/ holds the committed pages"


def provenance(argv: list[str] | None) -> dict[str, Any]:
    """Command, commit and machine, recorded next to every result."""
    import torch  # here, so that a benchmark's worker without torch may import this module

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", False
    return {
        "command": shlex.join(["longkv", *(sys.argv[1:] if argv is None else argv)]),
        "commit": commit + ("+dirty" if dirty else ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
    }


def provenance_lines(p: dict[str, Any]) -> list[str]:
    """Markdown bullet lines for a provenance record."""
    m = p["machine"]
    return [
        f"- command: `{p['command']}`",
        f"- commit: `{p['commit']}`, run {p['date']}",
        f"- machine: {m['platform']}, {m['processor']}, {m['cpu_count']} CPUs, "
        f"{m['torch_threads']} torch threads, torch {m['torch']}, Python {m['python']}"
        + (f", {m['cuda_device']}" if m["cuda_device"] else ""),
    ]


@contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A temporary path beside `path`, renamed onto it when the block ends without error."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)


@contextmanager
def replaced_together(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """Temporary paths beside `paths`, renamed onto them one after another when the block ends
    without error, with Ctrl-C held back meanwhile (on the main thread): a page's files (json,
    md, png) are all the new ones or all the old ones, never a mix an interrupt left."""
    tmps = [path.with_name(path.name + ".tmp") for path in paths]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmps
    except BaseException:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        raise
    main = threading.current_thread() is threading.main_thread()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if main else None
    try:
        for tmp, path in zip(tmps, paths, strict=True):
            tmp.replace(path)
    finally:
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def follow_umask(path: Path) -> None:
    """Give path (a folder: and everything in it) the mode the user's umask gives new files and
    folders, where a writer left its temporary file's 0600 (transformers' safetensors writer,
    tempfile's folders)."""
    mask = os.umask(0)
    os.umask(mask)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


def write_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary file and a rename."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text)


def load_partial(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The parts a run saved at path (`save_partial`) when its settings equal these, as JSON
    sees them; {} when there is no file or it came from other settings."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    same = data.get("settings") == json.loads(json.dumps(settings))
    return data.get("parts", {}) if same else {}


def save_partial(path: Path, settings: dict[str, Any], parts: dict[str, Any]) -> None:
    """Keep the finished parts of a run at path (atomically), for `load_partial` to resume."""
    write_atomic(path, json.dumps({"settings": settings, "parts": parts}, indent=2))


def report_texts(title: str, payload: dict[str, Any], body: list[str]) -> tuple[str, str]:
    """The JSON (payload, holding "provenance") and the markdown page (title, provenance, body)
    of a report."""
    page = [f"# {title}", "", *provenance_lines(payload["provenance"]), *body]
    return json.dumps(payload, indent=2) + "\n", "\n".join(page) + "\n"


def write_report(
    stem: Path,
    title: str,
    payload: dict[str, Any],
    body: list[str],
    plot: Callable[[Path], object] | None = None,
) -> list[Path]:
    """<stem>.json and <stem>.md (`report_texts`), and <stem>.png where `plot` draws one (at
    the path it is given), replaced together (`replaced_together`)."""
    paths = [stem.with_suffix(s) for s in (".json", ".md", *((".png",) if plot else ()))]
    with replaced_together(paths) as tmps:
        for tmp, text in zip(tmps, report_texts(title, payload, body), strict=False):
            tmp.write_text(text)
        if plot is not None:
            plot(tmps[2])
    return paths


def markdown_table(
    header: Sequence[str], rows: Iterable[Sequence[str]], align: str | None = None
) -> list[str]:
    """The lines of a markdown table: the header, the alignment row, then one line per row.

    align: one character per column, "<" left or ">" right; every column left when None. A
    "|" inside a cell (a README statement on bench readme's page) is escaped: it stays in it."""
    marks = {"<": "---|", ">": "---:|"}
    columns = zip(header, "<" * len(header) if align is None else align, strict=True)

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", r"\|") for c in cells) + " |"

    return [line(header), "|" + "".join(marks[a] for _, a in columns), *map(line, rows)]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    """Save a matplotlib figure as PNG atomically and close it."""
    with replaced_atomically(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    pyplot().close(fig)


def finish_figure(
    fig: Any, path: Path, title: str | None = None, title_size: float | str = "large"
) -> None:
    """Put the title above the panels ("large" is matplotlib's own size), lay the figure out
    tight and save it (`save_figure`)."""
    if title is not None:
        fig.suptitle(title, fontsize=title_size)
    fig.tight_layout()
    save_figure(fig, path)
