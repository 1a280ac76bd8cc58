"""Turning parsed options into the settings dataclasses they describe."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import fields
from typing import Any, TypeVar

S = TypeVar("S")


def settings_from_args(cls: type[S], args: argparse.Namespace) -> S:
    """cls built from the options named like its fields (lists become tuples); others default."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def require_known_keys(name: str, values: dict[str, Any], known: Iterable[str]) -> None:
    """A ValueError naming section `name`'s keys that are not in known, and the known ones."""
    names = sorted(known)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; use {names}")


def settings_from_section(cls: type[S], name: str, values: dict[str, Any]) -> S:
    """cls built from one section of a YAML run; a key that is not a field is a ValueError."""
    require_known_keys(name, values, [f.name for f in fields(cls)])  # type: ignore[arg-type]
    return cls(**values)
