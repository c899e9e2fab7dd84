"""The Countdown task: given a few numbers and a target, write an expression with + - * / and
parentheses that uses each number exactly once (all of them) and equals the target. Intermediate
values may be fractions; only the final value must equal the target.

Pure and deterministic: problems come from a seeded ``random.Random``, every emitted problem carries
a reference solution checked by :mod:`asyncrl.rl.tasks.arith`, and the reward reads model output
with that same parser, never with ``eval``. `Countdown` is the task as the rest of asyncrl sees it,
written on the public task API (``tasks/base.py``) alone; the functions below are its parts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import msgspec

from asyncrl.rl.config.task import MAX_SOLVE_NUMBERS, CountdownConfig
from asyncrl.rl.tasks.arith import MAX_CHARS, ArithError, BinOp, Expr, Num, evaluate, format_expr, numbers_used, parse
from asyncrl.rl.tasks.base import Message, Prompt, Score, Splits, Task, TaskInputError

CORRECT_REWARD = 1.0
"""An answer that uses each number exactly once and equals the target."""
FORMAT_REWARD = 0.1
"""An answer that parses and evaluates but is wrong (wrong value, or numbers missing, reused or
extra): a small signal that the format was right, well below a correct answer."""

_OPEN, _CLOSE = "<answer>", "</answer>"
ProblemKey = tuple[tuple[int, ...], int]
"""A problem's identity for deduplication (`problem_key`)."""
_Tree = int | tuple  # a leaf number, or (op, left, right); turned into an arith.Expr at the end


class CountdownProblem(msgspec.Struct, frozen=True):
    """One problem. ``solution`` is a reference expression using ``numbers`` exactly once each
    that evaluates to ``target``."""

    numbers: list[int]
    target: int
    solution: str


def problem_key(problem: CountdownProblem) -> ProblemKey:
    """Identity of a problem for deduplication: the numbers as a sorted multiset, and the target."""
    return tuple(sorted(problem.numbers)), problem.target


# --- solver -------------------------------------------------------------------------------------


def solve(numbers: Sequence[int], target: int) -> str | None:
    """An expression that uses every number in ``numbers`` exactly once and equals ``target``, or
    None if there is none. Exhaustive over the classic pairwise combine, so None is a proof.

    Deterministic: the first solution in a fixed order (+, *, -, / over pairs in index order).
    Subtraction is tried only as larger minus smaller: taking absolute values shows this reaches
    every non-negative value the full search reaches, with fewer branches.
    """
    if not 1 <= len(numbers) <= MAX_SOLVE_NUMBERS:
        raise ValueError(f"solve() takes 1..{MAX_SOLVE_NUMBERS} numbers, not {len(numbers)}")
    # Non-negative throughout is what makes larger-minus-smaller complete (see above).
    if any(type(n) is not int or n < 0 for n in (*numbers, target)):
        raise ValueError(f"numbers and target must be non-negative ints, not {list(numbers)!r}, {target!r}")
    tree = _search([(n, 1, n) for n in numbers], target, set())
    return None if tree is None else format_expr(_to_expr(tree))


def _search(items: list[tuple[int, int, _Tree]], target: int, dead: set) -> _Tree | None:
    """Items are (numerator, denominator, tree) with the fraction in lowest terms, denominator > 0:
    plain int arithmetic, several times faster than ``Fraction``, and canonical for the memo."""
    if len(items) == 1:
        p, q, tree = items[0]
        return tree if p == target * q else None
    if len(items) == 2:  # the leaves of the search, where nearly all its time goes
        return _last_step(*items[0], *items[1], target)
    # Whether the target is reachable depends only on the multiset of values left: remember failures.
    key = tuple(sorted((p, q) for p, q, _ in items))
    if key in dead:
        return None
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            a, b = items[i], items[j]
            if a[0] * b[1] < b[0] * a[1]:
                a, b = b, a
            rest = items[:i] + items[i + 1 : j] + items[j + 1 :]
            for item in _combine(*a, *b):
                found = _search(rest + [item], target, dead)
                if found is not None:
                    return found
    dead.add(key)
    return None


def _combine(p1: int, q1: int, t1: _Tree, p2: int, q2: int, t2: _Tree) -> Iterator[tuple[int, int, _Tree]]:
    """Every value one operator makes of ``p1/q1 >= p2/q2 >= 0``, with its tree."""
    yield _reduced(p1 * q2 + p2 * q1, q1 * q2, ("+", t1, t2))
    yield _reduced(p1 * p2, q1 * q2, ("*", t1, t2))
    yield _reduced(p1 * q2 - p2 * q1, q1 * q2, ("-", t1, t2))
    if p2 != 0:
        yield _reduced(p1 * q2, q1 * p2, ("/", t1, t2))
    if p1 != 0 and p1 * q2 != p2 * q1:
        yield _reduced(p2 * q1, q2 * p1, ("/", t2, t1))


def _reduced(p: int, q: int, tree: _Tree) -> tuple[int, int, _Tree]:
    g = math.gcd(p, q)
    return p // g, q // g, tree


def _last_step(p1: int, q1: int, t1: _Tree, p2: int, q2: int, t2: _Tree, target: int) -> _Tree | None:
    """The tree making ``target`` of the last two values, or None. Cross-multiplied: nothing is
    divided or reduced here."""
    a, b = p1 * q2, p2 * q1  # both values over the common denominator q1 * q2
    if a < b:
        a, b, t1, t2 = b, a, t2, t1
    scaled = target * q1 * q2
    if a + b == scaled:
        return ("+", t1, t2)
    if a * b == scaled * q1 * q2:
        return ("*", t1, t2)
    if a - b == scaled:
        return ("-", t1, t2)
    if b != 0 and a == target * b:
        return ("/", t1, t2)
    if a != 0 and b == target * a:
        return ("/", t2, t1)
    return None


def _to_expr(tree: _Tree) -> Expr:
    if isinstance(tree, int):
        return Num(tree)
    op, left, right = tree
    return BinOp(op, _to_expr(left), _to_expr(right))


# --- generator and splits -----------------------------------------------------------------------


def generate(
    seed: int | str, n: int, config: CountdownConfig = CountdownConfig(), *, exclude: Iterable[ProblemKey] = ()
) -> list[CountdownProblem]:
    """``n`` distinct problems (by :func:`problem_key`), none of whose keys is in ``exclude``.

    Deterministic for a seed, and a stream: ``generate(s, k)`` is a prefix of ``generate(s, n)`` for
    k <= n. Each problem is a random expression tree over random numbers, with integer, non-negative
    intermediates so the reference solutions read naturally (models may still answer with
    fractions); its value is the target if in range, and its solution is that tree written out
    (tests/test_countdown.py checks that each parses back to its target from its numbers). Raises
    ValueError if ``config`` cannot yield ``n`` distinct problems in bounded tries.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    rng = random.Random(seed)
    seen = set(exclude)
    problems: list[CountdownProblem] = []
    tries = 0
    while len(problems) < n:
        tries += 1
        if tries > 1000 + 200 * n:
            raise ValueError(
                f"only {len(problems)} of {n} distinct problems after {tries - 1} tries; widen the ranges of {config}"
            )
        problem = _draw(rng, config)
        if problem is not None and problem_key(problem) not in seen:
            seen.add(problem_key(problem))
            problems.append(problem)
    return problems


def train_and_heldout(
    seed: int | str, n_train: int, n_heldout: int, config: CountdownConfig = CountdownConfig()
) -> tuple[list[CountdownProblem], list[CountdownProblem]]:
    """Disjoint train and held-out sets, deterministic for ``seed``.

    They never share a key: the held-out set is drawn first from a stream of its own, and the train
    stream skips its keys. So the held-out set depends only on ``(seed, n_heldout, config)``, not on
    ``n_train``, and solve rates stay comparable between runs of different lengths.
    """
    heldout = generate(f"countdown/{seed}/heldout", n_heldout, config)
    train = generate(f"countdown/{seed}/train", n_train, config, exclude=map(problem_key, heldout))
    return train, heldout


def heldout_split(
    seed: int | str, n_heldout: int, config: CountdownConfig = CountdownConfig()
) -> list[CountdownProblem]:
    """The held-out set of :func:`train_and_heldout` (the same problems, in the same order), without
    drawing the train split: ``train_and_heldout(seed, n_train, n_heldout, config)[1]`` for any
    ``n_train``, since the held-out stream is drawn first and on its own."""
    return generate(f"countdown/{seed}/heldout", n_heldout, config)


def _draw(rng: random.Random, config: CountdownConfig) -> CountdownProblem | None:
    numbers = [rng.randint(1, config.max_number) for _ in range(rng.randint(config.min_count, config.max_count))]
    items: list[tuple[int, _Tree]] = [(x, x) for x in numbers]
    while len(items) > 1:
        a, ta = items.pop(rng.randrange(len(items)))
        b, tb = items.pop(rng.randrange(len(items)))
        if a < b:
            (a, ta), (b, tb) = (b, tb), (a, ta)
        op = rng.choice("+-*/")
        if op == "/" and a % b != 0:
            op = rng.choice("+-*")  # keep intermediates whole: such solutions read naturally
        if op == "-" and a == b:
            op = "+"  # a zero intermediate makes a needlessly odd solution
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
        items.append((value, (op, ta, tb)))
    target, tree = items[0]
    if not config.min_target <= target <= config.max_target:
        return None
    # Not parsed back and evaluated here: the target is the tree's own value, in whole numbers, and
    # tests/test_countdown.py checks the written solution against it (a check per problem was 70%
    # of drawing the default split, in every process that builds it).
    return CountdownProblem(numbers=numbers, target=target, solution=format_expr(_to_expr(tree)))


# --- prompt and reward --------------------------------------------------------------------------


def format_prompt(problem: CountdownProblem) -> str:
    """The instruction a model sees for ``problem``."""
    return (
        f"Using the numbers {list(problem.numbers)}, make {problem.target}. "
        "Use each number exactly once, with + - * / and parentheses. "
        "Write only the expression inside <answer></answer>, for example <answer>(1 + 2) * 3</answer>."
    )


def format_prompt_compact(problem: CountdownProblem) -> str:
    """A terse prompt for small character-level models, e.g. ``"3 7 25 50 -> 178:"``: the numbers,
    the target, and the colon after which the completion (:func:`format_reference`) starts. Every
    character is a token for such a model, so the instruction in :func:`format_prompt` would cost
    more than the whole answer."""
    return f"{' '.join(map(str, problem.numbers))} -> {problem.target}:"


def format_reference(problem: CountdownProblem) -> str:
    """The completion a perfect model writes for ``problem`` (supervised warm-start target)."""
    return f"{_OPEN}{problem.solution}{_CLOSE}"


class RewardBreakdown(msgspec.Struct, frozen=True):
    """How a completion was scored, for metrics. ``error`` says why it is not well formed."""

    reward: float
    """CORRECT_REWARD, FORMAT_REWARD (well formed but not correct) or 0.0."""
    has_answer: bool
    """A complete <answer>...</answer> pair was found."""
    well_formed: bool
    """Its content parsed and evaluated."""
    uses_numbers: bool
    """The numbers written are exactly the problem's, as a multiset."""
    hits_target: bool
    """The value equals the target (and a stated '= N' agrees)."""
    correct: bool
    """uses_numbers and hits_target: the reward is CORRECT_REWARD."""
    error: str = ""


def extract_answer(completion: str) -> str | None:
    """The text of the last ``<answer>`` that is closed, up to its first ``</answer>``; None if no
    tag is closed. So a later complete answer wins over an earlier one, an unclosed trailing tag is
    ignored, and nested tags yield the innermost text. Three ``str`` searches: linear, in C,
    whatever the size of the completion."""
    last_close = completion.rfind(_CLOSE)
    if last_close < 0:
        return None
    start = completion.rfind(_OPEN, 0, last_close)
    if start < 0:
        return None
    start += len(_OPEN)
    return completion[start : completion.find(_CLOSE, start)]


def score(problem: CountdownProblem, completion: str) -> RewardBreakdown:
    """Score ``completion`` against ``problem``. Never raises for any ``str``: all reading of model
    text goes through :func:`arith.parse`, whose only error is ArithError, caught here. A
    completion that is not a ``str``, or a problem that is not a `CountdownProblem`, is a caller's
    bug: `TaskInputError`.

    The answer is an expression, optionally followed by ``= N`` with N a plain number; if given, N
    must equal the target for the answer to count as correct.
    """
    if not isinstance(completion, str):
        raise TaskInputError(f"countdown: a completion must be a str, not {type(completion).__name__}")
    _check_problem(problem)
    answer = extract_answer(completion)
    if answer is None:
        return RewardBreakdown(0.0, False, False, False, False, False, "no <answer>...</answer>")
    try:
        if len(answer) > MAX_CHARS:  # before partition(), which would copy a huge answer again
            raise ArithError(f"answer is {len(answer)} characters long; at most {MAX_CHARS} are allowed")
        lhs, eq, rhs = answer.partition("=")
        expr = parse(lhs)
        value = evaluate(expr)
        stated = parse(rhs) if eq else None
        if stated is not None and not isinstance(stated, Num):
            raise ArithError(f"after '=' must come a single number, not {rhs.strip()!r}")
    except ArithError as e:
        return RewardBreakdown(0.0, True, False, False, False, False, str(e))
    uses = sorted(numbers_used(expr)) == sorted(problem.numbers)
    hits = value == problem.target and (stated is None or stated.value == problem.target)
    correct = uses and hits
    return RewardBreakdown(CORRECT_REWARD if correct else FORMAT_REWARD, True, True, uses, hits, correct)


def reward(problem: CountdownProblem, completion: str) -> float:
    """CORRECT_REWARD, FORMAT_REWARD or 0.0 for ``completion``: see :func:`score`."""
    return score(problem, completion).reward


def _check_problem(problem: object) -> None:
    if not isinstance(problem, CountdownProblem):
        raise TaskInputError(f"countdown: a problem must be a CountdownProblem, not {type(problem).__name__}")


# --- the task -----------------------------------------------------------------------------------


class Countdown(Task[CountdownProblem]):
    """Countdown on the public task API (``tasks/base.py``), nothing more: problems from the seeded
    generator (``config`` says what it draws), the prompt of :func:`format_prompt` with
    :func:`format_prompt_compact` as its compact form, the score of :func:`score` with its parts
    as metrics, and the solver's solution as the demonstration."""

    name = "countdown"
    correct_reward = CORRECT_REWARD
    Config = CountdownConfig

    def __init__(self, config: CountdownConfig | None = None):
        super().__init__(CountdownConfig() if config is None else config)

    def splits(self, seed: int | str, n_train: int, n_heldout: int) -> Splits[CountdownProblem]:
        """`train_and_heldout` of ``config``."""
        return Splits(*train_and_heldout(seed, n_train, n_heldout, self.config))

    def prompt(self, problem: CountdownProblem) -> Prompt:
        """One user turn, :func:`format_prompt`; the compact form is :func:`format_prompt_compact`."""
        _check_problem(problem)
        return Prompt([Message("user", format_prompt(problem))], compact=format_prompt_compact(problem))

    def score(self, problem: CountdownProblem, completion: str) -> Score:
        """:func:`score`: its reward, whether correct, and its parts (0 or 1 each) as metrics."""
        b = score(problem, completion)
        parts = {
            "has_answer": b.has_answer,
            "well_formed": b.well_formed,
            "uses_numbers": b.uses_numbers,
            "hits_target": b.hits_target,
        }
        return Score(b.reward, b.correct, metrics={k: float(v) for k, v in parts.items()})

    def demonstration(self, problem: CountdownProblem) -> str:
        """:func:`format_reference`: the solver's solution in answer tags."""
        _check_problem(problem)
        return format_reference(problem)

    def fingerprint(self) -> dict[str, Any]:
        """The options and a probe problem's compact prompt and reference: exactly what Countdown's
        warm-start cache key held before tasks were public, so cached default models stay valid."""
        return {"countdown": asdict(self.config), "probe": [format_prompt_compact(_PROBE), format_reference(_PROBE)]}


_PROBE = CountdownProblem(numbers=[3, 7, 25], target=46, solution="25 + 7 * 3")


CountdownTask = Countdown
"""The name `Countdown` had before the task API was public (remove once nothing uses it)."""
