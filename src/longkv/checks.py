"""Settings: fields that carry their help, and one way to reject a bad value.

A settings dataclass declares each field with `setting(default, help)`; the command line makes
its options from those fields (`longkv.cli.args`). A bad value is a `SettingError` naming the
field as "Owner.name", so the command line can name the option it came from instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any


class SettingError(ValueError):
    """A bad setting: `field` ("Owner.name") and `message` (what is wrong and the fix)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def setting(default: Any, help: str, *, choices: Sequence[Any] | None = None) -> Any:
    """A dataclass field with its default, a help text and (optionally) its allowed values;
    for a tuple field, `choices` are the allowed items."""
    metadata = {"help": help, "choices": None if choices is None else tuple(choices)}
    return dataclasses.field(default=default, metadata=metadata)


def mirror(cls: type, name: str, help_prefix: str = "") -> Any:
    """A setting with the default, help and choices of field `name` of the settings dataclass
    cls (an option that passes its value on to cls), its help after help_prefix."""
    source = {f.name: f for f in dataclasses.fields(cls)}[name]
    help_text = help_prefix + source.metadata["help"]
    return setting(source.default, help_text, choices=source.metadata.get("choices"))


def require(ok: bool, field: str, message: str) -> None:
    """Raise SettingError(field, message) unless ok; field reads like "KVMConfig.chunk_len"."""
    if not ok:
        raise SettingError(field, message)


def require_known(field: str, values: Iterable[Any], allowed: Sequence[Any]) -> None:
    """SettingError on field unless every value is one of allowed; the message names the
    unknown values and the allowed ones, in allowed's order."""
    unknown = sorted(set(values) - set(allowed))
    require(not unknown, field, f"unknown {unknown}; choose from {list(allowed)}")


def require_at_least(bound: float, owner: str, obj: object, *names: str) -> None:
    """Each named attribute of obj (a number, or a tuple of them) must be >= bound; the error
    names it as f"{owner}.{name}"."""
    for name in names:
        value = getattr(obj, name)
        low = min(value) if isinstance(value, tuple) else value
        require(low >= bound, f"{owner}.{name}", f"must be >= {bound}, got {value!r}")
