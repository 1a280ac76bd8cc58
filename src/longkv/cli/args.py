"""Command-line options made from settings dataclasses, and the settings built back from them.

Each field of a settings dataclass declared with `longkv.checks.setting` becomes one option:
`--field-name` (or a positional argument), typed by the field's annotation (a tuple takes one or
more values, or one value per option given when `repeated`; a bool is a `--name/--no-name`
switch), with the field's default, choices, help and whether it is required. The parser
remembers which dataclasses it was made from; `build_settings` builds them from the parsed
options, so a bad value is refused before a command starts, and a `SettingError` about a field
is reported under the option it came from, or under the option that feeds it
(`longkv.checks.setting`'s `feeds`).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from fnmatch import fnmatch
from typing import Any, TypeVar

from longkv.checks import SettingError, typed

S = TypeVar("S")
Command = Callable[[argparse.Namespace, list[str]], int]  # (parsed options, argv) -> exit status
DECLARED = "declared"  # the Namespace attribute holding the chosen command's Declared
GIVEN = "given"  # the Namespace attribute holding the fields whose options the command line gave
Groups = tuple[tuple[str, tuple[str, ...]], ...]  # (title, fnmatch patterns of field names)


class Given(argparse.Action):
    """An action that also records its field in the Namespace's GIVEN set, so that a command
    can tell an option given at its default from one not given (`given`)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        super().__call__(parser, namespace, values, option_string)  # type: ignore[misc]
        if getattr(namespace, GIVEN, None) is None:
            setattr(namespace, GIVEN, set())
        getattr(namespace, GIVEN).add(self.dest)


class StoreGiven(Given, argparse._StoreAction):
    pass


class AppendGiven(Given, argparse._AppendAction):
    pass


class SwitchGiven(Given, argparse.BooleanOptionalAction):
    pass


def given(args: argparse.Namespace) -> frozenset[str]:
    """The fields whose options the command line gave (at any value, the default included)."""
    return frozenset(getattr(args, GIVEN, None) or ())


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's default once, after its help; none where the help already says it.

    A None default means "not set", an empty list "none", and a switch's default is its
    absence, so none of them is shown (nor the default of a required option, which is never
    taken); an option with such a default says in its help what happens then.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default:" in text
            or "%(default)" in text
            or default is None
            or default is argparse.SUPPRESS
            or action.required
            or default in ((), [])
            or (action.nargs == 0 and default is False)
        ):
            return text
        return f"{text} (default: {shown(default)})"


def shown(value: Any) -> str:
    """A default as it is typed on the command line (`typed`), %-escaped."""
    return typed(value).replace("%", "%%")


@dataclass
class Declared:
    """What a command's parser was made from: its settings classes, the flag of each field,
    and the fields of other settings classes that options feed."""

    parser: argparse.ArgumentParser
    classes: list[type] = field(default_factory=list)
    flags: dict[tuple[type, str], str] = field(default_factory=dict)  # (class, field) -> flag
    feeds: list[tuple[type, str, str]] = field(default_factory=list)  # (class, field, flag)

    def flag_of(self, err: SettingError) -> str | None:
        """The option that set the refused field, or that feeds it; None if none did."""
        if err.owner is None:
            return None
        for cls in err.owner.__mro__:  # a field a settings class inherited
            if (cls, err.name) in self.flags:
                return self.flags[cls, err.name]
        fed = (f for cls, name, f in self.feeds if name == err.name and issubclass(err.owner, cls))
        return next(fed, None)

    def explain(self, err: SettingError) -> str | None:
        """The error as the command line reports it, naming the option; None if no option
        of this command set the field."""
        flag = self.flag_of(err)
        if flag is None:
            return None
        return (
            f"{self.parser.format_usage()}{self.parser.prog}: error: argument {flag}: {err.message}"
        )


def declared(parser: argparse.ArgumentParser) -> Declared:
    """The parser's Declared, made on first use (and found in the parsed Namespace)."""
    found = parser.get_default(DECLARED)
    if found is None:
        found = Declared(parser)
        parser.set_defaults(**{DECLARED: found})
    return found


def add_settings(parser: argparse.ArgumentParser, cls: type, groups: Groups = ()) -> None:
    """One option per field of the settings dataclass cls (see the module docstring), but the
    fields it names in its class attribute `omitted` (inherited settings its command does not
    use: they keep their defaults); each in the first of `groups` whose patterns match its
    name (made in that order on first use), else among the parser's options."""
    hints = typing.get_type_hints(cls)
    spec = declared(parser)
    for f in sorted(fields(cls), key=lambda f: place(f.name, groups)):
        if f.name in getattr(cls, "omitted", ()):
            continue
        owner = f"{cls.__name__}.{f.name}"
        help_text = f.metadata.get("help")
        if not help_text or f.default is MISSING:
            raise TypeError(f"{owner}: declare it with longkv.checks.setting(default, help)")
        positional = f.metadata.get("positional", False)
        flag = f.name if positional else "--" + f.name.replace("_", "-")
        names = list(dict.fromkeys([f.metadata.get("flag") or flag, flag]))  # the alias after
        kind, options = hints[f.name], dict(default=f.default, help=help_text)
        if not positional:
            options.update(dest=f.name, required=f.metadata.get("required", False))
        target = group_for(parser, f.name, groups)
        if kind is bool:
            target.add_argument(*names, action=SwitchGiven, **options)
        else:
            options["action"] = StoreGiven
            if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: X
                kind = next(k for k in typing.get_args(kind) if k is not type(None))
            if typing.get_origin(kind) is tuple and f.metadata.get("repeated"):
                kind = typing.get_args(kind)[0]
                options.update(action=AppendGiven, default=None)
            elif typing.get_origin(kind) is tuple:
                single = f.metadata.get("flag") is not None
                kind = typing.get_args(kind)[0]
                options["nargs"] = 1 if single else "*" if positional else "+"
            choices = f.metadata.get("choices")
            if choices is not None:  # listed once in the help, not in every usage line
                options["help"] += f" (choices: {shown(choices)})"
            if choices is not None or len(names) > 1:  # the name shown, not the field's
                options["metavar"] = names[0].lstrip("-").replace("-", "_").upper()
            target.add_argument(*names, type=kind, choices=choices, **options)
        spec.flags[cls, f.name] = names[0]
        if f.metadata.get("feeds") is not None:
            spec.feeds.append((*f.metadata["feeds"], names[0]))
    spec.classes.append(cls)


def place(name: str, groups: Groups) -> tuple[int, int]:
    """Where field `name` goes among groups: (group, pattern) of the first match; after them."""
    for i, (_, patterns) in enumerate(groups):
        for j, pattern in enumerate(patterns):
            if fnmatch(name, pattern):
                return i, j
    return len(groups), 0


def group_for(parser: argparse.ArgumentParser, name: str, groups: Groups) -> Any:
    """The argument group of field `name`: the first of groups whose patterns match it (made,
    with every group before it, on first use, so they show in groups' order), else parser."""
    at = place(name, groups)[0]
    if at == len(groups):
        return parser
    title = groups[at][0]
    made = {g.title: g for g in parser._action_groups}
    for t, _ in groups:
        if t not in made:
            made[t] = parser.add_argument_group(t)
        if t == title:
            break
    return made[title]


Kept = str | Callable[[argparse.Namespace], str | None] | None


def command(
    parser: argparse.ArgumentParser, run: Command, *classes: type, kept: Kept = None,
    groups: Groups = (),
) -> None:  # fmt: skip
    """Make parser the command that runs `run(args, argv)` on the settings of classes: their
    fields become its options (`add_settings`, in `groups`), built into `args.settings` before
    it runs. kept: what an interrupted run keeps, for the one line Ctrl-C prints: a phrase, or a
    function of the parsed options that says what is kept now (None: nothing, the command
    starts over)."""
    for cls in classes:
        add_settings(parser, cls, groups)
    parser.set_defaults(func=run, kept=kept)


def settings_from_args(cls: type[S], args: argparse.Namespace) -> S:
    """cls built from the options named like its fields (lists become tuples); others default."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            if value is None and f.metadata.get("repeated"):  # never given: the default
                continue
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def build_settings(args: argparse.Namespace) -> None:
    """Build every settings class the chosen command declared into `args.settings` (class ->
    instance); a bad value raises SettingError."""
    spec: Declared = getattr(args, DECLARED)
    args.settings = {cls: settings_from_args(cls, args) for cls in spec.classes}
