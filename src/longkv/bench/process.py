"""This process's resident memory, read from /proc/self/status (Linux), without torch: the
workers of `longkv bench anchor` read it in a process that runs another engine."""

from __future__ import annotations

from pathlib import Path

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
