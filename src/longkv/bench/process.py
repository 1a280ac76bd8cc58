"""A benchmark's worker process, without torch: its resident memory, read from
/proc/self/status (Linux), and its entry point (`worker_main`). The workers of `longkv bench
anchor` use both, one of them in a process that runs another engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from longkv.results import write_atomic

STATUS = Path("/proc/self/status")


def status_bytes(key: str) -> int:
    """A memory field of /proc/self/status in bytes: VmRSS (resident now), VmHWM (the resident
    high-water mark since the process started or the mark was last reset)."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} missing from {STATUS}")


def resident() -> dict[str, int]:
    """Bytes resident now (`rss`) and at most so far (`peak`)."""
    return {"rss": status_bytes("VmRSS"), "peak": status_bytes("VmHWM")}


def worker_main(run: Callable[[dict[str, Any]], dict[str, Any]], argv: list[str]) -> int:
    """Run the JSON spec in the file argv[0] and write its result, as JSON, to argv[1]."""
    spec = json.loads(Path(argv[0]).read_text())
    write_atomic(Path(argv[1]), json.dumps(run(spec)))
    return 0
