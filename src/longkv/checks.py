"""One way to reject a bad setting: a ValueError that names the field and the fix."""

from __future__ import annotations


def require(ok: bool, field: str, message: str) -> None:
    """Raise ValueError(f"{field}: {message}") unless ok; field reads like "KVMConfig.chunk_len"."""
    if not ok:
        raise ValueError(f"{field}: {message}")


def require_at_least(bound: float, owner: str, obj: object, *names: str) -> None:
    """Each named attribute of obj (a number, or a tuple of them) must be >= bound; the error
    names it as f"{owner}.{name}"."""
    for name in names:
        value = getattr(obj, name)
        low = min(value) if isinstance(value, tuple) else value
        require(low >= bound, f"{owner}.{name}", f"must be >= {bound}, got {value!r}")
