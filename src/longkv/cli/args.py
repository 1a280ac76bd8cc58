"""Turning parsed options into the settings dataclasses they describe."""

from __future__ import annotations

import argparse
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


def settings_from_section(cls: type[S], name: str, values: dict[str, Any]) -> S:
    """cls built from one section of a YAML run; a key that is not a field is a ValueError."""
    known = sorted(f.name for f in fields(cls))  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; use {known}")
    return cls(**values)
