"""Config trees of frozen dataclasses, overridable from the command line as ``--section.key value``.

Each section is a small frozen dataclass with a default and a docstring per field (validated in
its own ``__post_init__``); a run's config is a tree of them. `parse_overrides` turns
``["--trainer.lr", "1e-5", "--run.mode=sync"]`` into a new tree, casting each value to the field's
annotated type; an unknown key or a value of the wrong type is a `ConfigError` naming it, with the
keys that do exist. `config_to_dict` gives the plain tree that is written into the run directory.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from asyncrl.errors import AsyncrlError


class ConfigError(AsyncrlError, ValueError):
    """A command-line override names no field, or its value does not fit the field's type."""


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def parse_overrides(config: Any, argv: list[str]) -> Any:
    """Apply ``--a.b.c value`` / ``--a.b.c=value`` pairs to the dataclass tree ``config``. Each
    section is rebuilt once with all of its overrides, so fields that are validated together
    (say, a hidden size and a head count) can change together."""
    tree: dict[str, Any] = {}
    for dotted, raw in _pairs(argv):
        node = tree
        *sections, leaf = dotted.split(".")
        for name in sections:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--{dotted}: {name} is set as a value and as a section")
        node[leaf] = (raw, dotted)
    return _apply(config, tree)


def help_text(config: Any, prefix: str = "") -> str:
    """Every overridable key with its default and docstring, one per line."""
    lines = []
    for f, value in _fields(config):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            lines.append(help_text(value, key + "."))
        else:
            doc = _docstrings(type(config)).get(f.name, "")
            lines.append(f"  --{key} {value!r}" + (f"\n      {doc}" if doc else ""))
    return "\n".join(lines)


def _pairs(argv: list[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"expected --section.key value, got {arg!r}")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(argv):
            key, raw = arg[2:], argv[i + 1]
            i += 2
        else:
            raise ConfigError(f"{arg} needs a value")
        pairs.append((key, raw))
    return pairs


def _fields(config: Any) -> list[tuple[dataclasses.Field, Any]]:
    return [(f, getattr(config, f.name)) for f in dataclasses.fields(config)]


def _apply(node: Any, overrides: dict[str, Any]) -> Any:
    names = {f.name: f for f in dataclasses.fields(node)}
    hints = typing.get_type_hints(type(node))
    values, last = {}, ""
    for key, override in overrides.items():
        field = names.get(key.replace("-", "_"))
        if field is None:
            shown = override[1] if isinstance(override, tuple) else key
            raise ConfigError(f"unknown config key --{shown}; {type(node).__name__} has: {', '.join(sorted(names))}")
        current = getattr(node, field.name)
        if isinstance(override, dict):
            if not dataclasses.is_dataclass(current):
                raise ConfigError(f"{field.name} is a value, not a section")
            values[field.name] = _apply(current, override)
        else:
            raw, dotted = override
            if dataclasses.is_dataclass(current):
                raise ConfigError(f"--{dotted} is a section; set one of its keys")
            values[field.name] = _cast(raw, hints[field.name], dotted)
            last = f"--{dotted} {raw}"
    try:
        return dataclasses.replace(node, **values)
    except ValueError as exc:  # the section's own validation
        raise ConfigError(f"{type(node).__name__} ({last or 'overrides'}): {exc}") from exc


def _cast(raw: str, annotation: Any, dotted: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if raw.lower() in ("none", "null") and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                return _cast(raw, arg, dotted)
    if annotation is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{dotted}: expected true or false, got {raw!r}")
    if origin is tuple:
        parts = [p for p in raw.replace("(", "").replace(")", "").split(",") if p.strip()]
        return tuple(_cast(p.strip(), args[min(i, len(args) - 1)], dotted) for i, p in enumerate(parts))
    if annotation in (int, float, str):
        try:
            return annotation(raw)
        except ValueError:
            raise ConfigError(f"--{dotted}: expected {annotation.__name__}, got {raw!r}") from None
    raise ConfigError(f"--{dotted}: cannot set a field of type {annotation} from the command line")


def _docstrings(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal right after a field) read from the class source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body if tree.body else []
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs
