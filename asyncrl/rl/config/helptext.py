"""A script's ``--help``: every key of its config tree, laid out as ``asyncrl launch --help`` lays
out the launcher's flags, so that the whole command line reads one way.

The layout (argparse's, with ``asyncrl.cli_parser``'s formatter): a group per section, titled with its
key (``run:``), its docstring below the title, then one entry per key: two spaces, the flag and
what follows it, and the field's docstring on the next lines, indented by six and wrapped to the
terminal's width less two (argparse's). For a key, what follows the flag is its default written as
it would be typed (``--run.mode async``, ``--trainer.loss.tis_cap none``); for a launcher flag,
its metavar (``--nnodes N``). Keys are spelt with underscores, as their fields are; the parser
takes dashes too (``--run.max-staleness``), as the launcher does.
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
from collections.abc import Iterable

from asyncrl.rl.config.tree import Section, docstrings, is_flat, is_section, plain, typed

ENTRY_INDENT = 2
"""Where a flag starts (argparse's section indent)."""
HELP_INDENT = 6
"""Where a flag's description starts, on the lines below the flag."""
GRAMMAR = (
    "Each key is set as --section.key VALUE or --section.key=VALUE and shown with its default; a key's words "
    "are joined by _ (- is read the same)."
)
"""The description of the first group: how any key below is given."""


def help_text(config: Section, options: Iterable[tuple[str, str]] = ()) -> str:
    """Every overridable key of ``config`` with its default and docstring, a group per section.
    ``options``: (flag as shown, description) of the flags the script takes besides its keys
    (``("--resume RUN_DIR", "...")``), listed first."""
    width = shutil.get_terminal_size().columns - 2  # as argparse.HelpFormatter
    first = [_entry(flag, text, width) for flag, text in options]
    return "\n\n".join(_groups(config, "", GRAMMAR, width, first))


def options_text(options: Iterable[tuple[str, str]], title: str = "options") -> str:
    """A group of flags alone (a command's own, not a config's keys), in the same layout."""
    width = shutil.get_terminal_size().columns - 2
    return _group(title, "", [_entry(flag, text, width) for flag, text in options], width)


def _groups(section: Section, key: str, doc: str, width: int, first: Iterable[str] = ()) -> list[str]:
    """The group of ``section`` (at ``key``; "" for the root, titled "options") followed by the
    groups of its sub-sections, each after its parent's."""
    entries: list[str] = list(first)
    below: list[str] = []
    for f, value, owner in _fields(section):
        name = f"{key}.{f.name}" if key else f.name
        field_doc = plain(docstrings(owner).get(f.name, ""))
        if is_section(value):
            below += _groups(value, name, field_doc or _class_doc(type(value)), width)
        else:
            entries.append(_entry(f"--{name} {typed(value)}", field_doc, width))
    return [_group(key or "options", doc, entries, width), *below]


def _fields(section: Section) -> list[tuple[dataclasses.Field, object, type]]:
    """(field, value, the class that declares it) of a section's keys and sub-sections, a flat
    sub-section's in its place: the declaring class's source holds the field's docstring (a base
    class's, for a field a subclass inherits: `grpo_config_type` adds a section to GRPOConfig)."""
    out: list[tuple[dataclasses.Field, object, type]] = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out += _fields(value) if is_flat(f) else [(f, value, _declaring(type(section), f.name))]
    return out


def _declaring(cls: type, name: str) -> type:
    return next((c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {})), cls)


def _class_doc(cls: type) -> str:
    """A class's docstring, first paragraph (none for a dataclass's generated ``Name(...)``)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split("\n\n")[0].split())


def _group(title: str, description: str, entries: list[str], width: int) -> str:
    lines = [f"{title}:"]
    if description:
        lines += [" " * ENTRY_INDENT + line for line in textwrap.wrap(description, max(width - ENTRY_INDENT, 11))]
        lines.append("")
    return "\n".join(lines + entries)


def _entry(flag: str, description: str, width: int) -> str:
    lines = [" " * ENTRY_INDENT + flag]
    lines += [" " * HELP_INDENT + line for line in textwrap.wrap(description, max(width - HELP_INDENT, 11))]
    return "\n".join(lines)
