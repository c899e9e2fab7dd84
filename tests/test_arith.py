"""The safe arithmetic parser: values against hand computation, every refusal with its message, the
bounds at and just past their limits, and trees deeper than Python's recursion limit."""

from __future__ import annotations

import random
import time
from fractions import Fraction

import pytest

from asyncrl.rl.tasks.arith import (
    MAX_CHARS,
    MAX_DEPTH,
    MAX_DIGITS,
    MAX_NUMBERS,
    ArithError,
    BinOp,
    Num,
    evaluate,
    format_expr,
    numbers_used,
    parse,
)


def value(text: str) -> Fraction:
    return evaluate(parse(text))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0),
        ("42", 42),
        ("1 + 2 * 3", 7),  # * before +
        ("(1 + 2) * 3", 9),
        ("2 * 3 + 4 * 5", 26),
        ("10 - 4 - 3", 3),  # - is left-associative: (10 - 4) - 3
        ("10 - (4 - 3)", 9),
        ("100 / 10 / 5", 2),  # / is left-associative: (100 / 10) / 5
        ("100 / (10 / 5)", 50),
        ("2 * 3 / 4", Fraction(3, 2)),
        ("7 / 2", Fraction(7, 2)),
        ("(1 / 3) * 3", 1),  # exact, not 0.9999...
        ("1 / 3 * 3", 1),
        ("1 / 3 + 1 / 6", Fraction(1, 2)),
        ("8 / (3 - 8 / 3)", 24),
        ("3 - 7", -4),  # negative intermediates and results are fine; only a unary sign is refused
        ("((((5))))", 5),
        (" \t12\n+\r3 ", 15),
        ("999999999 * 999999999", 999999999**2),
    ],
)
def test_values(text, expected):
    assert value(text) == expected
    assert isinstance(value(text), Fraction)


def test_tree_shape_and_numbers_used():
    assert parse("1 - 2 - 3") == BinOp("-", BinOp("-", Num(1), Num(2)), Num(3))
    assert parse("1 + 2 * 3") == BinOp("+", Num(1), BinOp("*", Num(2), Num(3)))
    assert numbers_used(parse("3 * (7 + 3) - 25")) == [3, 7, 3, 25]  # in order, repeats kept
    assert numbers_used(parse("0")) == [0]


@pytest.mark.parametrize(
    "tree, text",
    [
        (BinOp("-", Num(1), BinOp("-", Num(2), Num(3))), "1 - (2 - 3)"),
        (BinOp("+", Num(1), BinOp("-", Num(2), Num(3))), "1 + 2 - 3"),
        (BinOp("/", Num(8), BinOp("*", Num(2), Num(2))), "8 / (2 * 2)"),
        (BinOp("*", Num(8), BinOp("/", Num(2), Num(3))), "8 * 2 / 3"),
        (BinOp("*", BinOp("+", Num(1), Num(2)), Num(3)), "(1 + 2) * 3"),
        (BinOp("-", BinOp("-", Num(9), Num(2)), Num(3)), "9 - 2 - 3"),
    ],
)
def test_format_expr_uses_only_needed_parentheses(tree, text):
    assert format_expr(tree) == text
    assert value(text) == evaluate(tree)


def test_format_expr_round_trips_random_trees():
    rng = random.Random(5)
    for _ in range(300):
        items = [Num(rng.randint(0, 20)) for _ in range(rng.randint(1, 6))]
        while len(items) > 1:
            left, right = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
            items.append(BinOp(rng.choice("+-*/"), left, right))
        tree = items[0]
        again = parse(format_expr(tree))
        assert numbers_used(again) == numbers_used(tree)
        try:
            expected = evaluate(tree)
        except ArithError:
            with pytest.raises(ArithError, match="division by zero"):
                evaluate(again)
        else:
            assert evaluate(again) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty"),
        ("  \n ", "empty"),
        ("-3", "unary '-' at 0"),
        ("4 - -1", "unary '-' at 4"),
        ("+3", "unary '\\+' at 0"),
        ("2 ** 3", "'\\*\\*' \\(power\\) at 2"),
        ("9**9**9", "power"),
        ("2 ^ 3", "unexpected character '\\^' at 2"),
        ("7 % 2", "unexpected character '%'"),
        ("1.5 + 1", "decimal point at 1"),
        ("07 + 1", "'07' at 0 has a leading zero"),
        ("1e3", "unexpected character 'e'"),
        ("1_000", "unexpected character '_'"),
        ("1 + 1 = 2", "unexpected character '='"),
        ("\u0663 + 1", "unexpected character"),  # Arabic-Indic three: int() would accept it
        ("\uff13", "unexpected character"),  # fullwidth three
        ("1\u00a0+ 1", "unexpected character"),  # no-break space is not ASCII whitespace
        ("1 / 0", "division by zero: 0 is 0"),
        ("5 / (2 - 2)", "division by zero: 2 - 2 is 0"),
        ("(1 + 2", "'\\(' at 0 is never closed"),
        ("1 + 2)", "'\\)' at 5 has no matching"),
        ("()", "expected a number or '\\(' at 1, got '\\)'"),
        ("1 2", "expected an operator at 2, got number 2"),
        ("(1)(2)", "expected an operator at 3"),
        ("1 +", "ends where a number"),
        ("2 * * 3", "expected a number or '\\(' at 4"),
        ("1" * (MAX_DIGITS + 1), f"has {MAX_DIGITS + 1} digits"),
        ("1" * (MAX_CHARS + 1), f"{MAX_CHARS + 1} characters long"),
        ("1+" * MAX_NUMBERS + "1", f"more than {MAX_NUMBERS} numbers"),
        ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH}"),
        ("(" * 100, "nested deeper"),
    ],
)
def test_refusals(text, message):
    with pytest.raises(ArithError, match=message):
        value(text)


def test_arith_error_is_a_value_error_and_non_str_is_refused():
    assert issubclass(ArithError, ValueError)
    for bad in (None, b"1+1", 3):
        with pytest.raises(ArithError, match="must be a str"):
            parse(bad)


def test_bounds_are_inclusive():
    assert value("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) == 1
    assert value("+".join(["1"] * MAX_NUMBERS)) == MAX_NUMBERS
    assert value("9" * MAX_DIGITS) == 10**MAX_DIGITS - 1
    text = "1" + " " * (MAX_CHARS - 1)
    assert len(text) == MAX_CHARS and value(text) == 1


def test_nodes_validate_themselves():
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(ArithError):
            Num(bad)
    with pytest.raises(ArithError, match="operator"):
        BinOp("**", Num(1), Num(2))


def test_evaluate_and_numbers_used_never_recurse():
    deep = Num(1)
    for _ in range(20_000):  # far past sys.getrecursionlimit()
        deep = BinOp("+", deep, Num(1))
    assert evaluate(deep) == 20_001
    assert len(numbers_used(deep)) == 20_001


def test_worst_case_values_stay_cheap():
    # The biggest products and the most tangled fractions that fit in MAX_CHARS.
    fit = (MAX_CHARS + 1) // (MAX_DIGITS + 1)  # nine-digit numbers, one operator each
    big = "*".join(["999999999"] * fit)
    tangled = "/".join(["999999937", "999999929"] * (fit // 2))
    added = "+".join(f"1/{999999999 - i}" for i in range(min(MAX_NUMBERS // 2, (MAX_CHARS + 1) // 12)))
    assert max(len(big), len(tangled), len(added)) <= MAX_CHARS
    start = time.process_time()  # this process's CPU seconds: what the work costs, whatever else runs
    for text in (big, tangled, added):
        for _ in range(20):
            value(text)
    assert time.process_time() - start < 0.5
    assert value(big) == 999999999**fit
