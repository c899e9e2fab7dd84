"""The documented tool-call format of multi-turn environments, and a calculator tool.

A model calls tool NAME by writing ``<NAME>ARGS</NAME>`` in its turn, e.g. ``<calc>3 * (4 + 5)</calc>``;
an environment ends the model's turn at the closing tag (``Environment.stop = tool_stops(names)``),
finds the call with `parse_tool_call`, and replies ``<result>VALUE</result>`` (`tool_result`).
The model's text is untrusted: nothing here evaluates it but `calculator`, through the bounded
parser of ``arith.py`` (never ``eval``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from asyncrl.rl.tasks.arith import ArithError, evaluate, parse

CALC = "calc"
"""The calculator's tool name: ``<calc>EXPRESSION</calc>``."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,31}")


class ToolCall(NamedTuple):
    """One tool call: the tool's ``name`` and the text between its tags, as written."""

    name: str
    args: str


def tool_stops(names: Sequence[str]) -> list[str]:
    """The closing tags that end a model turn on a call of one of ``names`` (an environment's ``stop``)."""
    return [f"</{_checked(n)}>" for n in names]


def parse_tool_call(text: str, names: Sequence[str]) -> ToolCall | None:
    """The last complete ``<NAME>ARGS</NAME>`` in ``text`` with NAME one of ``names`` (the call
    that ended the turn, when the turn stopped at a closing tag), or None. ARGS is the text after
    the last opening tag before that closing tag. Work is O(len(text) * len(names)), whatever the text."""
    if not isinstance(text, str):
        return None
    best: tuple[int, ToolCall] | None = None
    for name in names:
        opening, closing = f"<{_checked(name)}>", f"</{name}>"
        end = text.rfind(closing)
        if end < 0 or (best is not None and end < best[0]):
            continue
        start = text.rfind(opening, 0, end)
        if start >= 0:
            best = (end, ToolCall(name, text[start + len(opening) : end]))
    return None if best is None else best[1]


def calculator(expression: str) -> str:
    """The exact value of an arithmetic expression (``+ - * /``, parentheses, whole numbers; see
    ``arith.py``) as text: ``"12"``, ``"7/3"`` for a fraction; ``"error: ..."`` for anything else."""
    try:
        value = evaluate(parse(expression))
    except ArithError as exc:
        return f"error: {exc}"
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def tool_result(value: str) -> str:
    """The environment's reply to a tool call: ``<result>VALUE</result>``."""
    return f"<result>{value}</result>"


def _checked(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a tool name is a letter or '_' then up to 31 letters, digits, '_' or '-', not {name!r}")
    return name
