"""Benchmarks: scripts that measure speed and memory and print ratios from one run.

Importing the package imports no torch: a benchmark's worker process that runs another engine
(`anchor_llamacpp`) holds none of torch's memory.
"""

from __future__ import annotations

from typing import Any

from longkv.checks import require, setting
from longkv.results import markdown_table

THREADS_HELP = "torch threads (torch.set_num_threads); default: as torch starts"


def threads_setting() -> Any:
    """The `threads` field of a benchmark's settings (None: torch's own count)."""
    return setting(None, THREADS_HELP)


def check_threads(owner: object) -> None:
    """Refuse the `threads` setting of owner unless it is None or >= 1."""
    threads = owner.threads  # type: ignore[attr-defined]
    require(threads is None or threads >= 1, owner, "threads", f"must be >= 1, got {threads}")


def use_threads(threads: int | None) -> None:
    """Run torch on `threads` threads (None: leave torch's count)."""
    if threads is not None:
        import torch  # here: importing the package imports no torch (above)

        torch.set_num_threads(threads)


def verdict(ratio: dict[str, Any]) -> str:
    """A ratio's target, the length it holds from and, where the ratio records it, whether it
    was met ("" without a target)."""
    target = ratio.get("target")
    if not target:
        return ""
    start = ratio.get("from")
    said = f"{target} from {start} tokens" if start else target
    if "met" not in ratio:
        return said
    met = ratio["met"]
    return f"{said}: " + (
        "not measured at this length" if met is None else "met" if met else "missed"
    )


def ratios_table(ratios: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown: each ratio of one run, its value and the target it is read against."""
    rows = [[name, f"{r['value']:.2f}", verdict(r)] for name, r in ratios.items()]
    return markdown_table(["ratio (same run)", "value", "target"], rows, "<><")
