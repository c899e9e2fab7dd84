"""Config files: ``--config FILE`` reads one (TOML through the standard library, YAML where PyYAML
is installed, or a run directory's config.json), ``--print_config`` writes one.

A file holds the same tree as the flags: a table per section (``[run]``, ``[trainer.loss]``, the
task's own ``[countdown]``), a key per field, and a flat sub-section's keys in its parent's table,
as in config.json. A value is of the field's type, or a string read as the flag's text would be
(``"none"`` for a key that may be None, which TOML cannot write otherwise). Reading only parses
the file and notes the line of each key (TOML and YAML; JSON's parser tells none): the keys are
checked against the tree by the flags' parser, `parse_overrides(config, argv, files)`, so a
file's mistakes are the flags' one-line `ConfigError`s, naming the file, the key and its line
(``run.toml:7: unknown key trainer.lrr; did you mean trainer.lr?``).

`config_file_text` writes every key of a config, defaults included, each under its docstring's
first sentence: read back, it gives the same tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.tree import Section, docstrings, is_flat, is_section, plain, toml_value

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library (a dependency on 3.10 only)
    import tomli as tomllib

FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
"""A config file's format, told by its suffix."""
RUN_CONFIG = "config.json"
"""What ``--config RUN_DIR`` reads: the run's own config.json."""


@dataclass(frozen=True)
class ConfigFile:
    """A config file's tables as its format read them, and the line of each key where known."""

    path: str
    """As given after ``--config``."""
    values: dict[str, Any]
    lines: dict[str, int]
    """Dotted key as written (``trainer.loss.kl_coef``) -> its line, 1-based."""

    def where(self, dotted: str) -> str:
        """``run.toml:12``: the file and the line of ``dotted`` (else of the nearest table it is
        in, else none)."""
        while dotted:
            if dotted in self.lines:
                return f"{self.path}:{self.lines[dotted]}"
            dotted = dotted.rpartition(".")[0]
        return self.path


def read_config_file(path: str) -> ConfigFile:
    """The file at ``path`` (a directory: its config.json), parsed by its suffix's format. A
    missing or unreadable file, a syntax error (with its line and column), or a format this
    Python cannot read is a one-line `ConfigError`."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, RUN_CONFIG)):
            raise ConfigError(f"--config {path}: a directory without {RUN_CONFIG} (not a run directory?)")
        path = os.path.join(path, RUN_CONFIG)
    kind = FORMATS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise ConfigError(f"--config {path}: its suffix tells its format: .toml, .yaml (.yml) or .json")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config {path}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})"
        ) from None
    values, lines = {"TOML": _toml, "YAML": _yaml, "JSON": _json}[kind](path, text)
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: holds a {type(values).__name__}, not a table of sections and keys")
    return ConfigFile(path, values, lines)


def _toml(path: str, text: str) -> tuple[Any, dict[str, int]]:
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        at = re.search(r"\s*\(at line (\d+), column (\d+)\)$", message)
        if at:
            raise ConfigError(f"{path}:{at[1]}:{at[2]}: not valid TOML: {message[: at.start()]}") from None
        raise ConfigError(f"{path}: not valid TOML: {message}") from None
    return values, _toml_lines(text)


_TABLE = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(?:#.*)?$")
_KEY = re.compile(r"^\s*((?:[\w-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[\w-]+|\"[^\"]*\"|'[^']*'))*)\s*=")


def _toml_lines(text: str) -> dict[str, int]:
    """The line of each table header and key (for errors only: tomllib tells none; a line inside a
    multi-line string that looks like a key could be taken for one, which only moves a line number)."""
    lines: dict[str, int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), 1):
        header = _TABLE.match(line)
        if header:
            table = _dotted(header[1])
            lines.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            lines.setdefault(f"{table}.{_dotted(key[1])}" if table else _dotted(key[1]), number)
    return lines


def _dotted(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))


def _yaml(path: str, text: str) -> tuple[Any, dict[str, int]]:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            f"--config {path}: YAML needs PyYAML, which is not installed: pip install pyyaml "
            "(or write the file as TOML)"
        ) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    lines: dict[str, int] = {}
    _yaml_lines(root, "", lines)
    return ({} if values is None else values), lines


def _yaml_lines(node: Any, prefix: str, lines: dict[str, int]) -> None:
    import yaml

    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            dotted = f"{prefix}{key.value}"
            lines.setdefault(dotted, key.start_mark.line + 1)
            _yaml_lines(value, f"{dotted}.", lines)


def _json(path: str, text: str) -> tuple[Any, dict[str, int]]:
    try:
        return json.loads(text), {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None


# --- writing --------------------------------------------------------------------------------------

WIDTH = 100
"""Where a written file's comments wrap."""


def config_file_text(config: Section, header: str = "") -> str:
    """Every key of ``config`` as a TOML file, defaults included, under ``header`` (comment lines)
    and each key under its docstring's first sentence; `read_config_file` and `parse_overrides`
    read it back to ``config``."""
    out = [_comment(line) for line in header.splitlines()]
    _section(config, "", "", out)
    return "\n".join(out).strip("\n") + "\n"


def _section(section: Section, key: str, doc: str, out: list[str]) -> None:
    """A section's table: its own keys (a flat sub-section's among them), then its sub-sections'
    tables (TOML puts every key of a table before the next header)."""
    below: list[tuple[str, Section, str]] = []
    if key:
        out += ["", *([_comment(doc)] if doc else []), f"[{key}]"]
    for name, value, field_doc in _keys(section):
        if is_section(value):
            below.append((f"{key}.{name}" if key else name, value, field_doc))
        else:
            out += [*([_comment(field_doc)] if field_doc else []), f"{name} = {toml_value(value)}"]
    for name, value, field_doc in below:
        _section(value, name, field_doc, out)


def _keys(section: Section) -> Iterator[tuple[str, object, str]]:
    """(name, value, docstring) of a section's keys and sub-sections, a flat sub-section's keys in
    its place (its class holds their docstrings)."""
    docs = docstrings(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if is_flat(f):
            yield from _keys(value)
        else:
            yield f.name, value, docs.get(f.name, "")


def _comment(doc: str) -> str:
    """A docstring's first sentence as comment lines."""
    text = plain(doc).strip()
    first = re.split(r"(?<=\.)\s+(?=[A-Z])", text, maxsplit=1)[0]
    return "\n".join(textwrap.wrap(first, WIDTH - 2, initial_indent="# ", subsequent_indent="# ")) or "#"
