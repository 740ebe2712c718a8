"""Command-line flags generated from config dataclasses, so each setting (its name, type,
default and help) is written once, in the dataclass. Torch-free: the router and the load
generator use it too.

A field becomes a flag `--field-name` with the field's default; its help and anything unusual
live in the field's metadata, written with `setting(...)`:

    @dataclass(slots=True)
    class RouterConfig:
        port: int = setting(8000, "HTTP port (0: any free port)")

- `bool` fields get `--name/--no-name` (argparse's BooleanOptionalAction).
- `T | None` fields take a T and default to None.
- `choices`, `parse` (a str -> value function), `aliases` (extra flag spellings kept for
  compatibility) and `metavar` go in the metadata; `cli=False` keeps a field off the CLI.

`add_flags(parser, Config, title=..., exclude=...)` adds them (in an argument group), and
`values_from_args(Config, args)` collects the parsed values back, by field name, for
`Config(**values)` or to pass on as overrides.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

_MISSING = dataclasses.MISSING


def setting(
    default: Any = _MISSING,
    help: str = "",  # noqa: A002 - argparse's own word
    *,
    default_factory: Callable[[], Any] | Any = _MISSING,
    choices: Iterable[Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    cli: bool = True,
) -> Any:
    """A dataclass field that carries its CLI help (and flag details) in its metadata."""
    metadata = {
        "help": help,
        "choices": tuple(choices) if choices is not None else None,
        "parse": parse,
        "aliases": tuple(aliases),
        "metavar": metavar,
        "cli": cli,
    }
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type a flag parses, whether None is allowed) for a field's annotation."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) == 1:
            return args[0], optional
        return str, optional
    return hint, False


def cli_fields(cls: type, exclude: Iterable[str] = ()) -> list[dataclasses.Field]:
    skip = set(exclude)
    return [
        f
        for f in dataclasses.fields(cls)
        if f.name not in skip and f.metadata.get("cli", True) and f.init
    ]


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    title: str | None = None,
    exclude: Iterable[str] = (),
    required: Iterable[str] = (),
) -> argparse._ActionsContainer:
    """Add one flag per CLI field of dataclass `cls`. Fields without a default are required
    flags; `required` makes others required too. Returns the group the flags went into."""
    hints = typing.get_type_hints(cls)
    must = set(required)
    group = parser.add_argument_group(title) if title else parser
    for f in cli_fields(cls, exclude):
        kind, _ = _base_type(hints[f.name])
        meta = f.metadata
        names = [flag_name(f.name), *meta.get("aliases", ())]
        kwargs: dict[str, Any] = {"dest": f.name, "help": _help(f)}
        if f.default is not _MISSING:
            kwargs["default"] = f.default
        elif f.default_factory is not _MISSING:
            kwargs["default"] = f.default_factory()
        else:
            kwargs["required"] = True
        if f.name in must:
            kwargs["required"] = True
        if kind is bool and meta.get("parse") is None:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            parse = meta.get("parse")
            if parse is None and kind in (int, float, str):
                parse = kind
            if parse is None:
                raise TypeError(f"{cls.__name__}.{f.name}: give a `parse` for type {kind!r}")
            kwargs["type"] = parse
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        group.add_argument(*names, **kwargs)
    return group


def _help(f: dataclasses.Field) -> str:
    # argparse fills %(default)s in; a literal % in the help must be escaped.
    text = f.metadata.get("help", "").replace("%", "%%")
    if f.default is _MISSING or f.default is None:
        return text  # required, or "not set": the help says what happens then
    return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def values_from_args(
    cls: type, args: argparse.Namespace, exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """The parsed value of every CLI field of `cls` (by field name) present in `args`."""
    return {
        f.name: getattr(args, f.name) for f in cli_fields(cls, exclude) if hasattr(args, f.name)
    }


def field_default(cls: type, name: str) -> Any:
    """The default of one field, for a caller that must fall back to it without repeating it."""
    f = cls.__dataclass_fields__[name]
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def parse_int_list(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers (`--lengths 32,64,128`)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def parse_float_or_inf(text: str) -> float:
    """A float flag that also takes 'inf' (float() already does; named for the help)."""
    return float(text)
