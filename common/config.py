"""Typed configuration: dataclasses that are at once the TOML schema and the CLI flags.

Each component declares one dataclass whose fields carry a help text
(`option(default, "help")`) and validates itself in `__post_init__`. From it,
`add_flags` makes the command-line options and `load` merges, in this order,
the dataclass defaults, the TOML file (`--config FILE`) and the flags actually
given. A TOML file has one table per component (`[broker]`, `[actor]`, ...);
keys at the top level apply to every component that has a field of that name
(handy for `redis_url`). Unknown keys and values of the wrong type fail at
start with a message naming the key and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

T = TypeVar("T")

SECTIONS: dict[str, type] = {}
"""Every component's config class by its TOML table name."""


class ConfigError(ValueError):
    """Invalid configuration; the message names the bad key and value."""


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its default and the help text shown by --help."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def section(name: str):
    """Class decorator that registers a config dataclass under its TOML table name."""

    def register(cls: type[T]) -> type[T]:
        SECTIONS[name] = cls
        cls.section_name = name  # type: ignore[attr-defined]
        return cls

    return register


def check(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition; for use in __post_init__."""
    if not condition:
        raise ValueError(message)


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per field; only flags actually given end up in the namespace."""
    hints = typing.get_type_hints(cls)
    name = getattr(cls, "section_name", cls.__name__)
    group = parser.add_argument_group(f"{name} options (TOML table [{name}])")
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        text = f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        elif kind is list:
            item = type(default[0]) if default else str
            group.add_argument(flag, dest=f.name, nargs="*", type=item, default=argparse.SUPPRESS, help=text, metavar=item.__name__.upper())
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS, help=text, metavar=kind.__name__.upper())


def load(cls: type[T], config_file: str | Path | None = None, flags: argparse.Namespace | dict | None = None) -> T:
    """Build a validated config: dataclass defaults < TOML file < flags."""
    name = getattr(cls, "section_name", cls.__name__)
    hints = typing.get_type_hints(cls)
    field_names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    where = "flags"
    if config_file is not None:
        where = str(config_file)
        table = read_toml(config_file)
        known_anywhere = {f.name for c in SECTIONS.values() for f in dataclasses.fields(c)}
        for key, value in table.items():
            if isinstance(value, dict):
                if key not in SECTIONS:
                    raise ConfigError(f"{where}: unknown table [{key}]; known tables: {', '.join(sorted(SECTIONS))}")
                continue
            if key not in known_anywhere:
                raise ConfigError(f"{where}: unknown top-level key {key!r} = {value!r}")
            if key in field_names:
                values[key] = _checked(hints[key], value, f"{where}: {key}")
        for key, value in table.get(name, {}).items():
            if key not in field_names:
                raise ConfigError(f"{where}: unknown key [{name}] {key!r} = {value!r}; known keys: {', '.join(sorted(field_names))}")
            values[key] = _checked(hints[key], value, f"{where}: [{name}] {key}")
    if flags is not None:
        given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
        values.update({k: v for k, v in given.items() if k in field_names})
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid configuration [{name}] (from {where}): {e}") from e


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, naming the file in every error."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e


def _base_type(hint: Any) -> type:
    origin = typing.get_origin(hint)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _base_type(args[0])
    if origin is not None:
        return origin
    return hint


def _checked(hint: Any, value: Any, where: str) -> Any:
    kind = _base_type(hint)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float) and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"{where} = {value!r}: expected a {kind.__name__}, got a {type(value).__name__}")
    return value
