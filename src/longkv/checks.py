"""Settings: fields that carry their help, and one way to reject a bad value.

A settings dataclass declares each field with `setting(default, help)`; the command line makes
its options from those fields (`longkv.cli.args`). Every bad value, in the library, a YAML file
or on the command line, is refused one way: `require(ok, owner, name, message)` raises a
`SettingError` carrying the settings class and the field's name (a class may set `SECTION`, the
YAML path its fields are read from). The command line reports it under the option that set the
field, or that `feeds` it; a library check made on a setting's behalf is reported as that
setting with `refused_as`. No table maps one name to another, and no string names a class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

S = TypeVar("S")


class SettingError(ValueError):
    """A bad setting: `field` (how the owner names it: "KVMConfig.chunk_len", or a YAML path
    like "mqar.train.rows") and `message` (what is wrong and the fix). `owner` is the settings
    class (None for a function's argument) and `name` the setting's own name in it."""

    def __init__(self, owner: type | None, name: str, message: str) -> None:
        prefix = None if owner is None else getattr(owner, "SECTION", owner.__name__)
        field = name if prefix is None else f"{prefix}.{name}"
        super().__init__(f"{field}: {message}")
        self.owner, self.name, self.field, self.message = owner, name, field, message


def refuse(owner: object, name: str, message: str) -> NoReturn:
    """Raise the SettingError of setting `name` of owner (a settings class or instance, or None
    for a function's argument). A dataclass owner must declare the field: a renamed field then
    fails loudly instead of naming a setting that no longer exists."""
    cls = owner if owner is None or isinstance(owner, type) else type(owner)
    declared = dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}
    held = cls is not owner and hasattr(owner, name)  # an instance's own setting
    if dataclasses.is_dataclass(cls) and not (declared or held):
        raise TypeError(f"{cls.__name__} has no setting {name!r} to refuse")
    raise SettingError(cls, name, message)


@contextmanager
def refused_as(owner: object, name: str | None = None, say: str = "{}") -> Iterator[None]:
    """Report a SettingError raised inside as setting `name` of owner (None: the refused
    setting's own name), its message `say` with the original message in place of {}: a check
    made on a setting's behalf (the positions a model can run, a budget it can hold, the rule a
    config makes) refuses that setting."""
    try:
        yield
    except SettingError as err:
        refuse(owner, err.name if name is None else name, say.format(err.message))


def setting(
    default: Any,
    help: str,
    *,
    choices: Sequence[Any] | None = None,
    required: bool = False,
    positional: bool = False,
    feeds: tuple[type, str] | None = None,
    repeated: bool = False,
    flag: str | None = None,
) -> Any:
    """A dataclass field with its default, a help text and (optionally) its allowed values;
    for a tuple field, `choices` are the allowed items. On the command line a `required` field
    must be given, and a `positional` one is given without a flag (a tuple: zero or more).
    feeds (cls, name): the value (each value, for a tuple) is passed on to field `name` of
    settings class cls, so a refusal of that field (or of a subclass's) is this setting's.
    repeated: a tuple field whose option is given once per value (`--question A --question B`).
    flag: the option's name where it is not --field-name (which stays an alias); a tuple field
    with a flag takes one value (a singular name for a field whose class holds several)."""
    metadata = {
        "help": help,
        "choices": None if choices is None else tuple(choices),
        "required": required,
        "positional": positional,
        "feeds": feeds,
        "repeated": repeated,
        "flag": flag,
    }
    return dataclasses.field(default=default, metadata=metadata)


def mirror(cls: type, name: str, help_prefix: str = "") -> Any:
    """A setting with the default, help and choices of field `name` of the settings dataclass
    cls (an option that passes its value on to cls), its help after help_prefix."""
    source = {f.name: f for f in dataclasses.fields(cls)}[name]
    help_text = help_prefix + source.metadata["help"]
    return setting(
        source.default, help_text, choices=source.metadata.get("choices"), feeds=(cls, name)
    )


def require(ok: bool, owner: object, name: str, message: str) -> None:
    """`refuse(owner, name, message)` unless ok."""
    if not ok:
        refuse(owner, name, message)


def typed(value: Any) -> str:
    """A value as the command line takes it: the items of a tuple or list space-separated."""
    return " ".join(map(str, value)) if isinstance(value, tuple | list) else str(value)


def require_known(owner: object, name: str, values: Iterable[Any], allowed: Sequence[Any]) -> None:
    """Refuse setting `name` of owner unless every value is one of allowed; the message names
    the unknown values and the allowed ones, in allowed's order."""
    unknown = sorted(set(values) - set(allowed))
    require(not unknown, owner, name, f"unknown {typed(unknown)}; choose from {typed(allowed)}")


def require_at_least(bound: float, owner: object, *names: str) -> None:
    """Each named setting of the settings object owner (a number, or a tuple of them) must be
    >= bound."""
    for name in names:
        value = getattr(owner, name)
        low = min(value) if isinstance(value, tuple) else value
        require(low >= bound, owner, name, f"must be >= {bound}, got {typed(value)}")


def require_known_keys(name: str, values: dict[str, Any], known: Iterable[str]) -> None:
    """Refuse section `name` of a YAML file if it has keys that are not in known; the message
    names them and the known ones."""
    names = sorted(known)
    unknown = sorted(set(values) - set(names))
    require(not unknown, None, name, f"unknown keys {unknown}; use {names}")


def settings_from_section(cls: type[S], name: str, values: dict[str, Any]) -> S:
    """cls built from one section of a YAML run; a key that is not a field is a ValueError."""
    require_known_keys(name, values, [f.name for f in dataclasses.fields(cls)])  # type: ignore[arg-type]
    return cls(**values)
