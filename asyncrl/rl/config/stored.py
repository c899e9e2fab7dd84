"""The run's ``config.json``: written once a run is known to start (`write_run_config`) and read back
into the config tree for a resume (`load_run_config`), each the other's inverse: a flat section's
keys sit in its parent's dict (`config_to_dict`), and reading puts them back where the tree has
them. What does not fit the tree is a `ConfigError` (exit status 2) naming the key."""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.tree import S, Section, config_to_dict, field_path, is_flat, is_section

CONFIG_JSON = "config.json"


def write_run_config(config: Section, run_dir: str) -> None:
    """``config`` as ``RUN_DIR/config.json`` (what `load_run_config` reads back)."""
    with open(os.path.join(run_dir, CONFIG_JSON), "w") as f:
        json.dump(config_to_dict(config), f, indent=2, default=str)


def config_from_dict(default: S, values: Mapping[str, object], where: str = "config") -> S:
    """The config tree ``default`` with the values of ``values`` (as `config_to_dict` wrote them
    into config.json: a flat section's keys in its parent's dict). A key the tree does not have
    is a `ConfigError` naming it."""
    grouped: dict[str, Any] = {}
    for key, value in values.items():
        path = field_path(default, key)
        if path is None:
            raise ConfigError(f"{where}: unknown key {key!r} (the run was written by another version?)")
        node = grouped
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return _rebuilt(default, grouped, where)


def _rebuilt(default: S, grouped: Mapping[str, object], where: str) -> S:
    changes: dict[str, object] = {}
    fields = {f.name: f for f in dataclasses.fields(default)}
    try:
        hints = typing.get_type_hints(type(default))
    except Exception:  # a user's section whose annotations do not resolve here: typed by its defaults
        hints = {}
    for key, value in grouped.items():
        current = getattr(default, key)
        if is_section(current) and isinstance(value, Mapping):
            changes[key] = (
                _rebuilt(current, value, where)
                if is_flat(fields[key])
                else config_from_dict(current, value, f"{where}.{key}")
            )
        else:
            changes[key] = _typed(value, hints.get(key, Any if current is None else type(current)), f"{where}: {key}")
    try:
        return dataclasses.replace(default, **changes)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _typed(value: object, hint: object, where: str) -> object:
    """``value`` as JSON gave it, as the field's type (a list as a tuple, an int as a float); a
    value of another type is a `ConfigError` naming the key, as the command line's would be."""
    try:
        return msgspec.convert(value, hint, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc} (found {value!r})") from None
    except TypeError:  # a type msgspec does not take (a callable, say): as it is; the config checks it
        return value


def load_run_config(default: S, run_dir: str) -> S:
    path = os.path.join(run_dir, CONFIG_JSON)
    try:
        with open(path) as f:
            values = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--resume {run_dir}: no config.json there (not a run directory?)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    return config_from_dict(default, values)
