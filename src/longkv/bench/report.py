"""What every result file records: the command, commit and machine; atomic writes."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def provenance(argv: list[str] | None) -> dict[str, Any]:
    """Command, commit and machine, recorded next to every result."""
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


def write_atomic(path: Path, text: str) -> None:
    """Write text to path through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
