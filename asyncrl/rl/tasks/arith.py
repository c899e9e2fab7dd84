"""Exact arithmetic on untrusted text: the parser and evaluator that the Countdown reward runs on
model output. No ``eval``, ``exec``, ``compile`` or ``ast`` anywhere: the text is read by the small
recursive-descent parser below and nothing else.

Accepted, and nothing more::

    expr   := term (('+' | '-') term)*        left-associative
    term   := factor (('*' | '/') factor)*    left-associative, binds tighter than + -
    factor := NUMBER | '(' expr ')'
    NUMBER := '0' | [1-9][0-9]*               ASCII digits only, at most MAX_DIGITS of them

ASCII spaces, tabs, CR and LF may stand between tokens. Arithmetic is exact (``fractions.Fraction``),
so ``(1 / 3) * 3`` is exactly 1; dividing by zero is an error.

Refused, each with an :class:`ArithError` that says what and where (0-based character offsets):

- unary ``-`` and ``+`` (``-3``, ``4 - -1``): a Countdown answer only combines the given non-negative
  numbers, and a sign would let a model write a number it was not given;
- ``**`` (a power could take unbounded time) and every other operator, ``^``, ``%``, ``=`` included;
- decimals, exponents, underscores and numbers with leading zeros (``07``);
- non-ASCII digits: ``str.isdigit()`` and ``int()`` accept e.g. Arabic-Indic ``٣``; we do not;
- empty text, and anything past the bounds below.

The bounds exist so that no input can cost more than microseconds, whatever a model writes:
``MAX_CHARS`` is checked before any character is read, so a 1 MB string is refused in O(1);
``MAX_DEPTH`` bounds the parser's recursion (three Python frames per level, far below the
interpreter's limit); ``MAX_NUMBERS`` and ``MAX_DIGITS`` bound every intermediate value: no numerator
or denominator can have more than ``MAX_NUMBERS * (MAX_DIGITS + 1)`` digits, and a parsed tree is at
most ``MAX_NUMBERS - 1`` operators deep.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

MAX_CHARS = 256
"""Longest expression text, whitespace included."""
MAX_DEPTH = 32
"""Deepest nesting of parentheses."""
MAX_NUMBERS = 32
"""Most numbers (operands) in one expression."""
MAX_DIGITS = 9
"""Most digits in one number, so every number is below 10**9."""

_SPACE = frozenset(" \t\r\n")
_OPERATORS = "+-*/"
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


class ArithError(ValueError):
    """The text is not an expression this module accepts, or its value is undefined (division by
    zero). The message says what was refused and, where there is one, at which character."""


@dataclass(frozen=True, slots=True)
class Num:
    """A non-negative integer literal."""

    value: int

    def __post_init__(self) -> None:
        if type(self.value) is not int or self.value < 0:
            raise ArithError(f"a number must be a non-negative int, not {self.value!r}")


@dataclass(frozen=True, slots=True)
class BinOp:
    """``left op right`` with ``op`` one of ``+ - * /``."""

    op: str
    left: Expr
    right: Expr

    def __post_init__(self) -> None:
        if self.op not in ("+", "-", "*", "/"):
            raise ArithError(f"operator must be one of + - * /, not {self.op!r}")


Expr = Num | BinOp


def parse(text: str) -> Expr:
    """Parse ``text`` into an expression tree; raise :class:`ArithError` for anything refused (see
    the module docstring). Work is O(len(text)) and ``len(text) <= MAX_CHARS``."""
    if not isinstance(text, str):
        raise ArithError(f"expression must be a str, not {type(text).__name__}")
    if len(text) > MAX_CHARS:
        raise ArithError(f"expression is {len(text)} characters long; at most {MAX_CHARS} are allowed")
    tokens = _tokenize(text)
    if not tokens:
        raise ArithError("expression is empty")
    return _Parser(tokens).parse()


def evaluate(expr: Expr) -> Fraction:
    """The exact value of ``expr``. Raises :class:`ArithError` on division by zero. Iterative, so
    any tree depth is safe; the size of the numbers is bounded by how ``parse`` built the tree."""
    values: list[Fraction] = []
    stack: list[tuple[Expr, bool]] = [(expr, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, Num):
            values.append(Fraction(node.value))
        elif not children_done:
            stack.append((node, True))
            stack.append((node.right, False))
            stack.append((node.left, False))
        else:
            right = values.pop()
            left = values.pop()
            values.append(_apply(node, left, right))
    return values[0]


def numbers_used(expr: Expr) -> list[int]:
    """Every number literal of ``expr``, left to right, repeats included (a multiset, in order)."""
    found: list[int] = []
    stack: list[Expr] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, Num):
            found.append(node.value)
        else:
            stack.append(node.right)
            stack.append(node.left)
    return found


def format_expr(expr: Expr) -> str:
    """``expr`` as text with only the parentheses it needs; ``parse(format_expr(e))`` has the same
    value and numbers as ``e``. Recursive: meant for trees from ``parse`` or the solver, whose depth
    is bounded (at most ``MAX_NUMBERS - 1``)."""
    if isinstance(expr, Num):
        return str(expr.value)
    prec = _PRECEDENCE[expr.op]
    left = format_expr(expr.left)
    if isinstance(expr.left, BinOp) and _PRECEDENCE[expr.left.op] < prec:
        left = f"({left})"
    right = format_expr(expr.right)
    # Equal precedence on the right needs parentheses only after - and /: a - (b + c) != a - b + c,
    # while a + (b - c) == a + b - c and, exactly, a * (b / c) == a * b / c.
    if isinstance(expr.right, BinOp):
        right_prec = _PRECEDENCE[expr.right.op]
        if right_prec < prec or (right_prec == prec and expr.op in "-/"):
            right = f"({right})"
    return f"{left} {expr.op} {right}"


def _apply(node: BinOp, left: Fraction, right: Fraction) -> Fraction:
    if node.op == "+":
        return left + right
    if node.op == "-":
        return left - right
    if node.op == "*":
        return left * right
    if right == 0:
        raise ArithError(f"division by zero: {format_expr(node.right)} is 0")
    return left / right


class _Token(NamedTuple):
    kind: str  # "n" for a number, else the character itself: + - * / ( )
    value: int
    pos: int


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    count = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _SPACE:
            i += 1
        elif "0" <= c <= "9":  # not str.isdigit(): that accepts non-ASCII digits
            j = i
            while j < n and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_DIGITS:
                raise ArithError(f"number at {i} has {j - i} digits; at most {MAX_DIGITS} are allowed")
            if c == "0" and j - i > 1:
                raise ArithError(f"number {text[i:j]!r} at {i} has a leading zero")
            count += 1
            if count > MAX_NUMBERS:
                raise ArithError(f"more than {MAX_NUMBERS} numbers (the one at {i} is too many)")
            tokens.append(_Token("n", int(text[i:j]), i))
            i = j
        elif c == "*" and text.startswith("**", i):
            raise ArithError(f"'**' (power) at {i} is not supported")
        elif c in _OPERATORS or c in "()":
            tokens.append(_Token(c, 0, i))
            i += 1
        elif c == ".":
            raise ArithError(f"decimal point at {i}: only whole numbers are allowed")
        else:
            raise ArithError(f"unexpected character {c!r} at {i}; only digits 0-9, + - * / ( ) and spaces are allowed")
    return tokens


class _Parser:
    """Recursive descent over a token list. Recursion happens only at '(' and is cut at MAX_DEPTH,
    so the Python stack never grows past about 3 * MAX_DEPTH frames."""

    def __init__(self, tokens: list[_Token]):
        self._tokens = tokens
        self._i = 0
        self._depth = 0

    def parse(self) -> Expr:
        node = self._expr()
        if self._i < len(self._tokens):
            tok = self._tokens[self._i]
            if tok.kind == ")":
                raise ArithError(f"')' at {tok.pos} has no matching '('")
            raise ArithError(f"expected an operator at {tok.pos}, got {_describe(tok)}")
        return node

    def _peek(self) -> _Token | None:
        return self._tokens[self._i] if self._i < len(self._tokens) else None

    def _expr(self) -> Expr:
        node = self._term()
        while (tok := self._peek()) is not None and tok.kind in "+-":
            self._i += 1
            node = BinOp(tok.kind, node, self._term())
        return node

    def _term(self) -> Expr:
        node = self._factor()
        while (tok := self._peek()) is not None and tok.kind in "*/":
            self._i += 1
            node = BinOp(tok.kind, node, self._factor())
        return node

    def _factor(self) -> Expr:
        tok = self._peek()
        if tok is None:
            raise ArithError("expression ends where a number or '(' was expected")
        if tok.kind == "n":
            self._i += 1
            return Num(tok.value)
        if tok.kind == "(":
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise ArithError(f"parentheses nested deeper than {MAX_DEPTH} at {tok.pos}")
            self._i += 1
            node = self._expr()
            close = self._peek()
            if close is None or close.kind != ")":
                raise ArithError(f"'(' at {tok.pos} is never closed")
            self._i += 1
            self._depth -= 1
            return node
        if tok.kind in "+-":
            raise ArithError(f"unary {tok.kind!r} at {tok.pos} is not supported: numbers are written without a sign")
        raise ArithError(f"expected a number or '(' at {tok.pos}, got {_describe(tok)}")


def _describe(tok: _Token) -> str:
    return f"number {tok.value}" if tok.kind == "n" else repr(tok.kind)
