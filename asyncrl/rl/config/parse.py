"""Config trees of frozen dataclasses, overridable from the command line as ``--section.key value``.

Each section is a small frozen dataclass with a default and a docstring per field (validated in
its own ``__post_init__``); a run's config is a tree of them. `parse_overrides` turns
``["--trainer.lr", "1e-5", "--run.mode=sync"]`` into a new tree, casting each value to the field's
annotated type. Every mistake is a one-line `ConfigError` that names the flag and its value and
says what would be accepted: an unknown key (with the closest keys that exist), a value of the
wrong type (with an example of the right one), a value the section's validation refuses (naming
the override that broke it), a stray word. `config_to_dict` gives the plain tree that is written
into the run directory.

The keys, docstrings and config.json form live in `asyncrl.rl.config.tree`, ``--help`` in
`asyncrl.rl.config.helptext`.

Why our own parser. Tried (scratch venv, this tree, 2026): tyro 1.0.17, jsonargparse 4.53,
pydantic-settings 2.16 and draccus 0.11. Only tyro does most of it: both ``--run.steps 7`` and
``=7``, both spellings (``use_underscores=True``), docstrings, ``default=`` an instance (a resumed
config.json), close-key suggestions, a flat sub-section as ``Annotated[DataConfig,
tyro.conf.arg(name="run", prefix_name=False)]`` (so ``--run.n_train``), a fast import. But every
error is a 5-13 line box ("Unrecognized options: --trainer.lrr, 5 / Perhaps you meant: /
--trainer.lr FLOAT / <docstring> / For full helptext..."); a section's check names the section, not
the flag ("Error parsing run.deadlines: generate_timeout_s (5000) must be shorter..."), a rule
across sections names the class ("Error parsing Top: ..."); ``steps=3`` gets no suggestion; with
``console_outputs=False`` an unknown key is a bare ``SystemExit(2)`` with no message to reword, and
a value error still prints its box; ``--help`` is boxed and keeps docstrings' hard line breaks
mid-sentence. jsonargparse: no flat sub-section (``--run.n_train`` "unrecognized arguments"), no
dash spelling, no suggestion, a ``__post_init__`` error escapes ``instantiate_classes`` as a
traceback, each error after a full usage block. pydantic-settings: sections must become pydantic
models (stdlib dataclasses are one JSON-valued ``--run RunConfig`` flag), no flat sub-section, one
spelling only (``cli_kebab_case=True`` refuses ``--run.generate_timeout_s``), no suggestion, a
``ValidationError`` traceback for a bad value, a slow import. draccus: no flat sub-section, no
dash spelling, no suggestion, tracebacks (``DecodingError: `trainer.lr`: Couldn't parse 'abc' into
a float``; ``ParsingError: Couldn't instantiate class GRPOConfig``). Ours does all of it, in one
line each, in about 250 lines and no dependency.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Protocol

from asyncrl.errors import UsageError
from asyncrl.rl.config.helptext import help_text
from asyncrl.rl.config.tree import (
    S,
    Section,
    config_to_dict,
    docstrings,
    field_path,
    fields_of,
    flat_section,
    is_flat,
    is_section,
    sentence,
    toml_value,
    typed,
)

__all__ = [
    "ConfigError",
    "config_to_dict",
    "field_path",
    "flat_section",
    "help_text",
    "is_flat",
    "parse_overrides",
    "take_option",
]


class ConfigError(UsageError, ValueError):
    """A command-line override names no field, its value does not fit the field's type or its
    section's validation, or the run refuses a setting. The message is one line that names the
    flag; ``asyncrl launch`` prints it and exits with status 2."""


class ConfigValues(Protocol):
    """A config file's tables as read (`asyncrl.rl.config.files.ConfigFile`), and where each key is."""

    @property
    def values(self) -> Mapping[str, object]: ...

    def where(self, dotted: str) -> str: ...


Override = dict[str, "Override | _Setting"]
"""The settings of one section, by field name: a value's, or a sub-section's (its own)."""


def parse_overrides(config: S, argv: list[str], files: Sequence[ConfigValues] = ()) -> S:
    """Apply ``--a.b.c value`` / ``--a.b.c=value`` pairs to the dataclass tree ``config``, over
    the keys of ``files`` (`asyncrl.rl.config.files.ConfigFile`s, in order: a later one, and any
    flag, wins). Each section is rebuilt once with all of its overrides, so fields that are
    validated together (say, a hidden size and a head count) can change together, one from a
    file and one from a flag included. Dashes in keys count as underscores (``--run.max-staleness``)."""
    tree: Override = {}
    settings = [s for file in files for s in _file_settings(config, file)]
    for dotted, raw in _pairs(config, argv):
        path, current = _resolve(config, dotted, raw)
        if raw is None:
            raise ConfigError(f"--{dotted} needs a value" + _example(dotted, current, ", e.g. "))
        settings.append((path, _Setting(raw, dotted)))
    for path, setting in settings:
        node = tree
        for name in path[:-1]:
            inner = node.setdefault(name, {})
            if not isinstance(inner, dict):  # a path is a field's: none runs through another's value
                raise ConfigError(f"{setting.shown()}: {'.'.join(path[:-1])} is a value, not a section")
            node = inner
        node[path[-1]] = setting
    return _apply(config, tree)


def take_option(argv: list[str], flag: str, metavar: str = "VALUE") -> tuple[str, list[str]]:
    """Remove ``flag value`` (or ``flag=value``) from ``argv``: (value, the rest); ("", argv)
    when ``flag`` is absent. A flag without a value is a `ConfigError`."""
    for i, arg in enumerate(argv):
        if arg == flag or arg.startswith(flag + "="):
            if arg == flag:
                value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else ""
                rest = argv[:i] + argv[i + 2 :]
            else:
                value, rest = arg[len(flag) + 1 :], argv[:i] + argv[i + 1 :]
            if not value:
                raise ConfigError(f"{flag} needs a value: {flag} {metavar}")
            return value, rest
    return "", list(argv)


# --- parsing --------------------------------------------------------------------------------------


def _pairs(config: Section, argv: list[str]) -> list[tuple[str, str | None]]:
    """(key, raw value) per override; the value is None when the flag has none (reported once
    the key is known to exist, so a misspelt flag is named as such first)."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) < 3 or arg[2] == "-":
            raise ConfigError(_stray(config, arg))
        raw: str | None
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, raw = arg[2:], argv[i + 1]
            i += 2
        else:  # the last word, or followed by the next flag: nothing was given for it
            key, raw = arg[2:], None
            i += 1
        pairs.append((key, raw))
    return pairs


def _resolve(config: Section, dotted: str, raw: str | None) -> tuple[list[str], object]:
    """The field names along ``dotted`` and the current value there; an unknown key, or a
    section given a value, is a `ConfigError`."""
    node: object = config
    parent: Section = config
    path: list[str] = []
    shown: list[str] = []
    for part in dotted.split("."):
        if not is_section(node):
            raise ConfigError(f"unknown config key --{dotted}: --{'.'.join(shown)} is a value, not a section")
        name = part.replace("-", "_")
        steps = field_path(node, name)
        if steps is None:
            raise ConfigError(_unknown(config, dotted, node))
        for step in steps:
            if is_section(node):
                parent, node = node, getattr(node, step)
        path += steps
        shown.append(name)
    if is_section(node):
        raise ConfigError(_section_given_a_value(parent, path, raw, shown))
    return path, node


def _unknown(config: Section, dotted: str, parent: Section) -> str:
    guesses = _guesses(config, dotted.replace("-", "_"))
    if guesses:
        return f"unknown config key --{dotted}; did you mean {' or '.join('--' + g for g in guesses)}?"
    names = ", ".join(sorted(f.name for f, _ in fields_of(parent)))
    return f"unknown config key --{dotted}; {type(parent).__name__} has: {names}"


def _guesses(config: Section, key: str) -> list[str]:
    """Keys that exist and look like ``key``: the same last name in any section (``--lr`` ->
    ``--trainer.lr``), else the closest spellings (``--trainer.lrr`` -> ``--trainer.lr``)."""
    keys = _leaf_keys(config)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key]
    return same_leaf[:3] or difflib.get_close_matches(key, keys, n=2, cutoff=0.75)


def _leaf_keys(config: Section, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for f, value in fields_of(config):
        if is_section(value):
            keys += _leaf_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _section_given_a_value(parent: Section, path: list[str], raw: str | None, shown: list[str]) -> str:
    """``--model /some/dir``: say what the section is, how its keys are set and, where the parent
    has a ``<name>_path`` field, that the value probably belongs there."""
    name, section = path[-1], getattr(parent, path[-1])
    dotted = ".".join(shown)
    docs = docstrings(type(parent))
    what = sentence(docs.get(name, ""))
    first = fields_of(section)[0]
    example = _example(f"{dotted}.{first[0].name}", first[1], "")
    message = f"--{dotted} is a section{f' ({what})' if what else ''}, not a value: set its keys, e.g. {example}"
    sibling = f"{name}_path"
    if raw is not None and sibling in {f.name for f in dataclasses.fields(parent)}:
        given = ".".join([*shown[:-1], sibling])
        what = sentence(docs.get(sibling, "").split(";")[0]) or "a path"
        message += f"; {what} is given with --{given} {shlex.quote(raw)}"
    return message


def _stray(config: Section, arg: str) -> str:
    """A word where a ``--section.key`` flag belongs (``steps=3``, ``-lr``)."""
    key, sep, value = arg.lstrip("-").partition("=")
    key = key.replace("-", "_")
    guesses = ([key] if key in _leaf_keys(config) else _guesses(config, key)) if key else []
    if guesses:
        shown = " or ".join(f"--{g}" + (f" {shlex.quote(value)}" if sep else "") for g in guesses)
        return f"unexpected argument {arg!r}; did you mean {shown}?"
    return f"unexpected argument {arg!r}: overrides are --section.key value (see --help for the keys)"


# --- config files ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Setting:
    """One key's value as given: a flag's text, or a config file's value (``where`` names the
    file and the key's line, ``run.toml:12``; "" for a flag)."""

    value: object
    """A flag's text (a str), or a file's value as its format read it."""
    dotted: str
    where: str = ""

    def shown(self) -> str:
        """The setting as an error names it: ``--run.steps 0``, or ``run.toml:3: run.steps = 0``."""
        if self.where:
            return f"{self.where}: {self.dotted} = {toml_value(self.value)}"
        return f"--{self.dotted} {shlex.quote(str(self.value))}"


def _file_settings(config: Section, file: ConfigValues) -> list[tuple[list[str], _Setting]]:
    """(attribute path, setting) for every key of a config file's tables, checked against the
    tree as flags are: a key no section has, a section given a value, a value given a table."""
    out: list[tuple[list[str], _Setting]] = []

    def walk(node: Section, values: Mapping[str, object], path: list[str], prefix: str) -> None:
        for key, value in values.items():
            dotted = f"{prefix}{key}"
            where = file.where(dotted)
            steps = field_path(node, str(key).replace("-", "_"))
            if steps is None:
                raise ConfigError(f"{where}: {_unknown_in_file(config, dotted, node, isinstance(value, Mapping))}")
            target: object = node
            for step in steps:
                target = getattr(target, step)
            if is_section(target):
                if not isinstance(value, Mapping):
                    raise ConfigError(
                        f"{where}: {dotted} is a section, not a value: give its keys in a table "
                        f"([{dotted}] in TOML), e.g. {_file_example(target, dotted)}"
                    )
                walk(target, value, [*path, *steps], f"{dotted}.")
            else:
                out.append(([*path, *steps], _Setting(value, dotted, where)))

    walk(config, file.values, [], "")
    return out


def _unknown_in_file(config: Section, dotted: str, parent: Section, table: bool) -> str:
    """A file's key that no section has, with the keys (the sections, for a ``table``) that exist
    and look like it (a key of another section, ``steps`` outside ``[run]``; a close spelling),
    or its section's keys."""
    key = dotted.replace("-", "_")
    keys = _section_keys(config) if table else _leaf_keys(config)
    leaf = key.rsplit(".", 1)[-1]
    guesses = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key][:3]
    guesses = guesses or difflib.get_close_matches(key, keys, n=2, cutoff=0.75)
    if guesses:
        return f"unknown key {dotted}; did you mean {' or '.join(guesses)}?"
    names = ", ".join(sorted(f.name for f, _ in fields_of(parent)))
    return f"unknown key {dotted}; {type(parent).__name__} has: {names}"


def _section_keys(config: Section, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for f, value in fields_of(config):
        if is_section(value):
            keys += [prefix + f.name, *_section_keys(value, f"{prefix}{f.name}.")]
    return keys


def _file_example(section: Section, dotted: str) -> str:
    first, value = fields_of(section)[0]
    return f"{dotted}.{first.name} = {toml_value(value)}"


def _cast_file_value(setting: _Setting, annotation: object, current: object) -> object:
    """A file's value as the field's type: a string is read as the flag's text would be
    (``"none"``, ``"1e-5"`` as YAML leaves it), any other value must be of the type already."""
    try:
        return _typed(setting.value, annotation)
    except _Mismatch:
        found = "a table" if isinstance(setting.value, Mapping) else f"{toml_value(setting.value)}"
        raise ConfigError(
            f"{setting.where}: {setting.dotted} = {found}: expected {_describe(annotation)}, "
            f"e.g. {setting.dotted} = {toml_value(current)}"
        ) from None


def _typed(value: object, annotation: object) -> object:
    if isinstance(value, str):
        return _cast(value, annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _typed(value, arg)
                except _Mismatch:
                    continue
        raise _Mismatch
    if origin is tuple and isinstance(value, (list, tuple)):
        variadic = len(args) == 2 and args[1] is Ellipsis
        if not variadic and len(value) != len(args):
            raise _Mismatch
        return tuple(_typed(v, args[0] if variadic else args[i]) for i, v in enumerate(value))
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _Mismatch


# --- building -------------------------------------------------------------------------------------


def _apply(node: S, overrides: Override) -> S:
    hints = typing.get_type_hints(type(node))
    values: dict[str, object] = {}
    flags: dict[str, str] = {}  # field -> "--section.key value", to name the one a validation refuses
    for name, override in overrides.items():
        current = getattr(node, name)
        if isinstance(override, dict):
            values[name] = _apply(current, override)
        elif override.where:
            values[name] = _cast_file_value(override, hints[name], current)
            flags[name] = override.shown()
        else:
            values[name] = _cast_flag(str(override.value), hints[name], override.dotted, current)
            flags[name] = override.shown()
    try:
        return dataclasses.replace(node, **values)
    except ValueError as exc:  # the section's own validation
        if str(exc).startswith("--"):  # it names the flags itself (a rule across sections)
            raise ConfigError(str(exc)) from None
        raise ConfigError(f"{_culprits(str(exc), flags, node)}: {exc}") from None


def _culprits(message: str, flags: dict[str, str], section: Section) -> str:
    """The overrides a section's validation message is about: those whose field it names (the
    section validates all its fields at once, so the last override is not necessarily the bad
    one). When it names only fields that were not overridden (values from a resumed config.json),
    the section; when it names no field, every override of the section."""

    def names(field: str) -> bool:
        return re.search(rf"(?<!\w){re.escape(field)}(?!\w)", message) is not None

    named = [flag for field, flag in flags.items() if names(field)]
    if named:
        return ", ".join(named)
    if any(names(f.name) for f in dataclasses.fields(section)) or not flags:
        return type(section).__name__
    return ", ".join(flags.values())


class _Mismatch(Exception):
    """A raw value that does not fit the annotation being tried."""


def _cast_flag(raw: str, annotation: object, dotted: str, current: object) -> object:
    try:
        return _cast(raw, annotation)
    except _Mismatch:
        raise ConfigError(
            f"--{dotted} {shlex.quote(raw)}: expected {_describe(annotation)}" + _example(dotted, current, ", e.g. ")
        ) from None


def _cast(raw: str, annotation: object) -> object:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if raw.lower() in ("none", "null") and type(None) in args:
            return None
        for arg in args:  # in the order written: `int | str` takes 3 as an int
            if arg is not type(None):
                try:
                    return _cast(raw, arg)
                except _Mismatch:
                    continue
        raise _Mismatch
    if annotation is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise _Mismatch
    if origin is tuple:
        parts = [p.strip() for p in raw.replace("(", "").replace(")", "").split(",") if p.strip()]
        fixed = not (len(args) == 2 and args[1] is Ellipsis)
        if not parts or (fixed and len(parts) != len(args)):
            raise _Mismatch
        return tuple(_cast(p, args[i] if fixed else args[0]) for i, p in enumerate(parts))
    if annotation is int or annotation is float or annotation is str:
        try:
            return annotation(raw)
        except ValueError:
            raise _Mismatch from None
    raise ConfigError(f"a field of type {annotation} cannot be set from the command line")


def _describe(annotation: object) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) if a is not type(None) else "none" for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"comma-separated values, each {_describe(args[0])}"
        return f"{len(args)} comma-separated values, each {_describe(args[0])}"
    names: dict[object, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, str(annotation))


def _example(dotted: str, current: object, lead: str) -> str:
    """``lead`` + ``--dotted <current value as typed on a command line>``; "" for an empty string."""
    return f"{lead}--{dotted} {typed(current)}" if current != "" else ""
