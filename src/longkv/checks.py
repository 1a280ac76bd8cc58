"""One way to reject a bad setting: a ValueError that names the field and the fix."""

from __future__ import annotations


def require(ok: bool, field: str, message: str) -> None:
    """Raise ValueError(f"{field}: {message}") unless ok; field reads like "KVMConfig.chunk_len"."""
    if not ok:
        raise ValueError(f"{field}: {message}")
