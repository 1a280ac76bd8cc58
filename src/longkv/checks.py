"""Settings: fields that carry their help, and one way to reject a bad value.

A settings dataclass declares each field with `setting(default, help)`; the command line makes
its options from those fields (`longkv.cli.args`). A bad value is a `SettingError` naming the
field as "Owner.name", so the command line can name the option it came from instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

S = TypeVar("S")


class SettingError(ValueError):
    """A bad setting: `field` ("Owner.name") and `message` (what is wrong and the fix)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    required: bool = False,
    positional: bool = False,
) -> Any:
    """A dataclass field with its default, a help text and (optionally) its allowed values;
    for a tuple field, `choices` are the allowed items. On the command line a `required` field
    must be given, and a `positional` one is given without a flag (a tuple: zero or more)."""
    metadata = {
        "help": help,
        "choices": None if choices is None else tuple(choices),
        "required": required,
        "positional": positional,
    }
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


def require_known_keys(name: str, values: dict[str, Any], known: Iterable[str]) -> None:
    """A ValueError naming section `name`'s keys that are not in known, and the known ones."""
    names = sorted(known)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; use {names}")


def settings_from_section(cls: type[S], name: str, values: dict[str, Any]) -> S:
    """cls built from one section of a YAML run; a key that is not a field is a ValueError."""
    require_known_keys(name, values, [f.name for f in dataclasses.fields(cls)])  # type: ignore[arg-type]
    return cls(**values)
