"""What the parser, ``--help`` and config.json share about a config tree: its keys (through flat
sub-sections), each field's docstring, and a value written as it is typed on a command line.

A config tree is a dataclass whose fields are values or sections (dataclasses). A *flat*
sub-section (`flat_section`) groups fields in code (``config.run.deadlines.sync_timeout_s``)
while its keys stay its parent's everywhere a user sees them (``--run.sync_timeout_s``, in
``--help``, in config.json), so grouping fields never renames a flag nor breaks an old run's
config.json.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shlex
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, TypeGuard, TypeVar

_FLAT = "asyncrl_flat"  # field metadata: see flat_section


class Section(Protocol):
    """A node of a config tree: an instance of a (frozen) dataclass, whose fields are values or
    sections."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


S = TypeVar("S", bound=Section)


def is_section(value: object) -> TypeGuard[Section]:
    """Whether ``value`` is a section (a dataclass instance), not a value."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def flat_section(factory: Callable[[], S]) -> S:
    """A sub-section field whose keys read as its parent's (``--run.n_train``, not
    ``--run.data.n_train``), on the command line, in ``--help`` and in config.json."""
    flat: S = dataclasses.field(default_factory=factory, metadata={_FLAT: True})
    return flat


def is_flat(f: dataclasses.Field) -> bool:
    """A sub-section whose keys are its parent's on the command line and in config.json."""
    return bool(f.metadata.get(_FLAT))


def field_path(config: Section, name: str) -> list[str] | None:
    """The attribute path to key ``name`` of section ``config``, through flat sub-sections
    (``n_train`` of the run section -> ``["data", "n_train"]``); None if it has no such key."""
    for f in dataclasses.fields(config):
        if f.name == name and not is_flat(f):
            return [name]
    for f in dataclasses.fields(config):
        if is_flat(f):
            inner = field_path(getattr(config, f.name), name)
            if inner is not None:
                return [f.name, *inner]
    return None


def fields_of(config: Section, flatten: bool = True) -> list[tuple[dataclasses.Field, object]]:
    """(field, value) of a section; ``flatten``: a flat sub-section's fields in its place."""
    out: list[tuple[dataclasses.Field, object]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if flatten and is_flat(f):
            out += fields_of(value)
        else:
            out.append((f, value))
    return out


def config_to_dict(config: Section) -> dict[str, Any]:
    """The plain tree written into config.json: a flat section's keys sit in its parent's dict,
    as on the command line."""
    out: dict[str, Any] = {}
    for f, value in fields_of(config, flatten=False):
        if is_section(value):
            if is_flat(f):
                out.update(config_to_dict(value))
            else:
                out[f.name] = config_to_dict(value)
        else:
            out[f.name] = value
    return out


def typed(value: object) -> str:
    """``value`` as it is typed after its flag, shell-quoted: ``true``, ``none``, ``0.9,0.99``,
    ``''``; the parser reads each back to the same value."""
    if isinstance(value, bool):
        shown = "true" if value else "false"
    elif isinstance(value, tuple):
        shown = ",".join(str(v) for v in value)
    elif value is None:
        shown = "none"
    else:
        shown = str(value)
    return shlex.quote(shown)


def toml_value(value: object) -> str:
    """``value`` as a TOML value: ``true``, ``1e-05``, ``"async"``, ``[0.9, 0.99]``; None (which
    TOML cannot write) as ``"none"``, which a config file reads back as None where a key may be
    None, as a flag does."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if value != value else ("inf" if value > 0 else "-inf"))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if value is None:
        return '"none"'
    return json.dumps(str(value)).replace("\x7f", "\\u007f")  # a JSON string is a TOML basic string


def sentence(doc: str) -> str:
    """A field's docstring as a clause: first sentence, no final period, lower-case start."""
    text = doc.split(". ")[0].strip().rstrip(".")
    return text[:1].lower() + text[1:]


def plain(doc: str) -> str:
    """A docstring as a terminal shows it: reST markup (````x````, ``:func:`x```) as plain text."""
    return re.sub(r":\w+:`([^`]*)`", r"\1", doc).replace("``", "")


@functools.cache
def docstrings(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal right after a field), whitespace collapsed, read from
    the class source and its bases' (a field a subclass inherits keeps its base's docstring; cached:
    inspect parses the class's whole module for it, and --help asks once per field)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if base is not object:
            docs.update(docstrings(base))
    return docs | _own_docstrings(cls)


@functools.cache
def _own_docstrings(cls: type) -> dict[str, str]:
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    first = tree.body[0] if tree.body else None
    docs: dict[str, str] = {}
    body = first.body if isinstance(first, ast.ClassDef) else []
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs
