"""Typed configuration: dataclasses that are at once the TOML schema and the CLI flags.

Each component declares one dataclass whose fields carry a help text
(`option(default, "help")`) and validates itself in `__post_init__`. From it,
`add_flags` makes the command-line options and `load` merges, in this order,
the dataclass defaults, the TOML file (`--config FILE`) and the flags actually
given. A TOML file has one table per component (`[broker]`, `[actor]`, ...);
keys at the top level apply to every component that has a field of that name
(a shared table's fields included). Unknown keys and values of the wrong type
fail at start with a message naming the key and the value.

Settings that two processes must agree on are one dataclass of their own,
embedded in each component's config with `nested(...)`: its own TOML table
(`[policy]`, shared by actor and learner; `[retrieval]`, shared by broker and
actor; `[store]`, the Redis of broker, actor, learner and `ppoz up`), so a file
states them once, and its fields' flags on every command that embeds it. A key
that used to sit in a component's table and moved to a shared one fails with a
message saying where to write it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

T = TypeVar("T", bound="DataclassInstance")

SECTIONS: dict[str, type] = {}
"""Every component's config class by its TOML table name."""


class ConfigError(ValueError):
    """Invalid configuration; the message names the bad key and value."""


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its default and the help text shown by --help.

    `path=local_path` (or `local_path_or_id`, `code_path`) marks a field that names a file or folder: `load` makes
    it absolute against the working directory the command started in, default included, so a child process
    that changes directory (redis-server does) or starts elsewhere reads the same file."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def curve_key_pair(owner: str, note: str) -> Any:
    """The option naming a process's own CURVE key pair file (NAME.key_secret from `ppoz keygen`), `owner` saying
    whose ("the broker's") and `note` what the help adds: where its public half goes, or what empty means."""
    return option("", f"CURVE: {owner} key pair file (NAME.key_secret from `ppoz keygen`){note}", path=local_path)


def curve_public_key(owner: str, effect: str) -> Any:
    """The option naming the public key file (NAME.key) of the server a process connects to; set, the link is encrypted."""
    return option("", f"CURVE: {owner} public key file (NAME.key); set, {effect}", path=local_path)


def curve_broker_key() -> Any:
    """The broker's public key file, as every process that connects to the broker names it (an actor, the gateway)."""
    return curve_public_key("the broker's", "the connection to the broker is encrypted (docs/security.md)")


def curve_allowed_keys(peers: str) -> Any:
    """The option naming a server's directory of the public key files of the peers it lets in (or '*': any key)."""
    return option("", f"CURVE: directory of the public key files (NAME.key) of the {peers}, or '*' for any key", path=local_path_or_any)


def nested(cls: type, flag_prefix: str = "") -> Any:
    """A field holding a shared section (`cls`, registered with `section`): read from its own TOML table,
    flags named `--{flag_prefix}{field}`. Keys `{flag_prefix}{field}` in the embedding table are reported as moved."""
    return dataclasses.field(default_factory=cls, metadata={"nested": True, "flag_prefix": flag_prefix, "help": cls.__doc__ or ""})


def _nested_fields(cls: type) -> list[tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("nested")]


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


def add_flags(parser: argparse.ArgumentParser, cls: type, flag_prefix: str = "", dest_prefix: str = "") -> None:
    """One --flag per field (and per field of each nested section); only flags actually given end up in the namespace."""
    hints = typing.get_type_hints(cls)
    name = getattr(cls, "section_name", cls.__name__)
    shared = f", shared: {cls.__doc__.strip().splitlines()[0]}" if dest_prefix and cls.__doc__ else ""
    group = parser.add_argument_group(f"{name} options (TOML table [{name}]{shared})")
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False or f.metadata.get("nested"):
            continue
        flag = "--" + (flag_prefix + f.name).replace("_", "-")
        dest = dest_prefix + f.name
        kind = _base_type(hints[f.name])
        default = _default(f)
        text = f"{f.metadata.get('help', '')} (default: {default!r})".replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        elif kind is list:
            item = type(default[0]) if default else str
            group.add_argument(flag, dest=dest, nargs="*", type=item, default=argparse.SUPPRESS, help=text, metavar=item.__name__.upper())
        else:
            group.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=text, metavar=kind.__name__.upper())
    for f, sub in _nested_fields(cls):
        add_flags(parser, sub, f.metadata["flag_prefix"], f"{dest_prefix}{f.name}.")


def load(cls: type[T], config_file: str | Path | None = None, flags: argparse.Namespace | dict | None = None) -> T:
    """Build a validated config: dataclass defaults < TOML file < flags (nested shared sections alike)."""
    where = str(config_file) if config_file is not None else "flags"
    table: dict[str, Any] = {}
    if config_file is not None:
        table = read_toml(config_file)
        known_anywhere = {f.name for c in SECTIONS.values() for f in dataclasses.fields(c)}
        for key, value in table.items():
            if isinstance(value, dict):
                if key not in SECTIONS:
                    raise ConfigError(f"{where}: unknown table [{key}]; known tables: {', '.join(sorted(SECTIONS))}")
            elif key not in known_anywhere:
                raise ConfigError(f"{where}: unknown top-level key {key!r} = {_shown(value)}")
    given = {} if flags is None else vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
    return _build(cls, table, given, where)


def _build(cls: type[T], table: dict[str, Any], given: dict[str, Any], where: str) -> T:
    name = getattr(cls, "section_name", cls.__name__)
    hints = typing.get_type_hints(cls)
    nested = {f.name: sub for f, sub in _nested_fields(cls)}
    field_names = {f.name for f in dataclasses.fields(cls)} - set(nested)
    moved = _moved_keys(cls)
    values: dict[str, Any] = {}
    for key, value in table.items():  # top-level keys apply to every component that has them
        if not isinstance(value, dict) and key in field_names:
            values[key] = _checked(hints[key], value, f"{where}: {key}")
    for key, value in table.get(name, {}).items():
        if key in moved:
            raise ConfigError(
                f"{where}: [{name}] {key} has moved: write it as `{moved[key][1]} = {_shown(value)}` in the [{moved[key][0]}] "
                f"table, which every component that must agree on it reads"
            )
        if key not in field_names:
            raise ConfigError(f"{where}: unknown key [{name}] {key!r} = {_shown(value)}; known keys: {', '.join(sorted(field_names))}")
        values[key] = _checked(hints[key], value, f"{where}: [{name}] {key}")
    for field_name, sub in nested.items():
        prefix = f"{field_name}."
        values[field_name] = _build(sub, table, {k[len(prefix) :]: v for k, v in given.items() if k.startswith(prefix)}, where)
    values.update({k: v for k, v in given.items() if k in field_names})
    for f in dataclasses.fields(cls):
        resolve = f.metadata.get("path")
        if resolve is not None and f.name not in nested:
            value = values.get(f.name, _default(f))
            if isinstance(value, str):
                values[f.name] = resolve(value)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid configuration [{name}] (from {where}): {e}") from e


def local_path(value: str) -> str:
    """A file or folder the user named, absolute against the working directory (`~` expanded); "" stays ""."""
    return os.path.abspath(os.path.expanduser(value)) if value else value


def is_local_path(value: str) -> bool:
    """Whether a model name is a folder here rather than a Hugging Face id (`Qwen/Qwen2.5-0.5B`): it exists here, or
    is written as a path (`./m`, `../m`, `~/m`, `/m`)."""
    return value.startswith(("./", "../", "~", "/")) or value in (".", "..") or os.path.exists(os.path.expanduser(value))


def local_path_or_id(value: str) -> str:
    """A local model folder made absolute, or a Hugging Face id left as it is (`is_local_path`)."""
    return local_path(value) if value and is_local_path(value) else value


def local_path_or_any(value: str) -> str:
    """An allow-list folder made absolute, or '*' (any key) as it is."""
    return value if value == "*" else local_path(value)


def code_path(value: str) -> str:
    """`path/to/file.py:function` with the file made absolute; `module:function` and built-in names as they are."""
    file, colon, function = value.rpartition(":")
    if colon and file.endswith(".py"):
        return f"{local_path(file)}:{function}"
    return value


def _moved_keys(cls: type) -> dict[str, tuple[str, str]]:
    """Old key in this component's table -> (shared table, key there): the nested sections' fields under their
    flag names, and any `MOVED_KEYS` the class lists itself (keys renamed on the way)."""
    moved: dict[str, tuple[str, str]] = dict(getattr(cls, "MOVED_KEYS", {}))
    for f, sub in _nested_fields(cls):
        for g in dataclasses.fields(sub):
            moved[f.metadata["flag_prefix"] + g.name] = (sub.section_name, g.name)  # type: ignore[attr-defined]
    return moved


def _shown(value: Any) -> str:
    """`value` as an error message shows it: its repr, a URL's password masked. Messages go to terminals and logs,
    and a key that moved or is misspelt (an old `[broker] redis_url`) never reaches the check that refuses passwords."""
    if isinstance(value, str) and "@" in value:
        try:
            password = urlsplit(value).password
        except ValueError:
            password = None
        if password:
            return repr(value.replace(f":{password}@", ":***@", 1))
    return repr(value)


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, naming the file in every error."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (None when it has none: a required field)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


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
        raise ConfigError(f"{where} = {_shown(value)}: expected a {kind.__name__}, got a {type(value).__name__}")
    return value
