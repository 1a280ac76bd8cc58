"""One way to refuse a bad setting: the owner's class and the field travel with the error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from longkv.checks import SettingError, refuse, refused_as, require, require_at_least, setting


@dataclass(frozen=True)
class Knobs:
    size: int = setting(1, "a size")

    def __post_init__(self) -> None:
        require_at_least(1, self, "size")


@dataclass(frozen=True)
class Section:
    SECTION: ClassVar[str] = "run.part"
    rows: int = 1


def test_a_refusal_carries_the_class_and_the_field() -> None:
    with pytest.raises(SettingError) as err:
        Knobs(size=0)
    assert (err.value.owner, err.value.name, err.value.field) == (Knobs, "size", "Knobs.size")
    assert str(err.value) == "Knobs.size: must be >= 1, got 0"


def test_a_yaml_section_and_a_function_argument_name_themselves() -> None:
    with pytest.raises(SettingError, match=r"^run\.part\.rows: none") as err:
        refuse(Section(), "rows", "none")
    assert err.value.owner is Section
    with pytest.raises(SettingError, match=r"^batch_size: too small$") as err:
        require(False, None, "batch_size", "too small")
    assert err.value.owner is None


def test_a_field_the_owner_does_not_declare_fails_loudly() -> None:
    with pytest.raises(TypeError, match="Knobs has no setting 'sise'"):
        refuse(Knobs, "sise", "renamed")


def test_a_check_on_a_settings_behalf_is_reported_as_that_setting() -> None:
    with pytest.raises(SettingError) as err, refused_as(Knobs, "size", "at 3: {}"):
        refuse(None, "budget", "too big")
    assert (err.value.owner, err.value.name, err.value.message) == (Knobs, "size", "at 3: too big")
    with pytest.raises(SettingError) as err, refused_as(Knobs()):  # the refused name kept
        refuse(None, "size", "no")
    assert err.value.field == "Knobs.size"
