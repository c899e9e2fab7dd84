"""A multi-turn tool-use environment: arithmetic the model may hand to a calculator.

    asyncrl launch examples/grpo.py --task.name examples/calculator.py:Calculator --run.steps 200

(200 steps rather than the default 500, an episode being up to three turns; the greedy held-out
rate rises most of the way within the first 100. docs/grpo.md, "Tasks: examples before/after", has
the run's time and solve rates.)

A teacher or a reward model scores these episodes as any task's (docs/algorithms.md): add
``--teacher.model_path T --trainer.loss.distill_coef 1`` (the teacher's reverse KL on the tokens
the model wrote; the calculator's replies are its context and carry no loss) or
``--reward_model.model_path RM`` (its score added to the exact-answer reward, weighted).

A problem is one sum, difference or product of multi-digit numbers (``47 * 38 = ?``), more than a
small model computes in its head. In its first turn the model may call the calculator,
``<calc>47 * 38</calc>``: the turn ends at ``</calc>`` (the environment's stop string) and the
environment replies ``<result>1786</result>``; the model then answers ``<answer>1786</answer>``. Or
it answers at once, and is usually wrong. Reward 1 for the exact answer, else 0; the metrics (``task/<name>`` in
metrics.jsonl) say how often episodes used the tool (``tool_used``), and used it correctly
(``tool_used_correctly``: a call whose result is the answer); the runner adds ``turns``.

The calculator is asyncrl's bounded arithmetic parser (``rl/tasks/arith.py`` through
``rl/tasks/tools.py``): the model's text is parsed, never ``eval``-ed.

The warm start (the embedded model) trains on demonstrations that use the tool for some problems
only: always the same ones, picked by a hash of the problem, more often for a product than for a
difference or a sum (`TOOL_RATE`). The model cannot tell from a problem which ones those are, so it
learns a per-operator chance of calling the tool and answers the rest itself, mostly wrongly:
GRPO has both the solve rate and the share of episodes that use the tool to raise. (Greedily, the
warm-started model calls it for products only: 0.32 of the held-out problems solved.)
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

from asyncrl.rl.tasks.base import Environment, Episode, Reply
from asyncrl.rl.tasks.tools import CALC, calculator, parse_tool_call, tool_result, tool_stops

TOOL_RATE = {"+": 0.25, "-": 0.4, "*": 0.7}
"""Share of each operator's demonstrations that call the calculator (the rest answer directly)."""
N_PROBLEMS = 12000
"""Problems in all (held-out ones included): 4000 of each operator."""
_WIDTH = {"+": 4, "-": 3, "*": 4}  # digits of each operator's answers: see make_problems
_ANSWER = re.compile(r"<answer>\s*(\d{1,12})\s*</answer>")


class Arithmetic(NamedTuple):
    """``a op b``; its `answer` is a whole number >= 0."""

    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"


def make_problems(seed: int | str = 0, n: int = N_PROBLEMS) -> list[Arithmetic]:
    """``n`` distinct problems, the operators in turn: sums of two three-digit numbers, differences
    of three-digit numbers and products of two two-digit numbers, each with an answer of fixed width
    (4, 3 and 4 digits), so that copying a result into the answer is copying from a fixed distance
    back: a tiny model learns that at once, and a copy from a varying distance only slowly.
    Deterministic for ``seed`` (a str seed hashes the same in every process)."""
    rng = random.Random(f"calculator/{seed}")
    seen: set[Arithmetic] = set()
    out: list[Arithmetic] = []
    for _ in range(20 * n):  # a bound, not a loop that could spin: about 2 n draws are needed
        if len(out) == n:
            break
        op = "+-*"[len(out) % 3]
        a, b = (
            (rng.randint(11, 99), rng.randint(11, 99)) if op == "*" else (rng.randint(100, 999), rng.randint(100, 999))
        )
        if op == "-" and a < b:
            a, b = b, a
        problem = Arithmetic(a, op, b)
        if len(str(problem.answer)) == _WIDTH[op] and problem not in seen:
            seen.add(problem)
            out.append(problem)
    if len(out) < n:  # the products run out first: 6610 of them have four digits
        raise ValueError(f"only {len(out)} distinct problems found; ask for fewer than {n}")
    return out


def answer_value(text: str) -> int | None:
    """The number in the last ``<answer>N</answer>`` of ``text`` (plain digits), or None."""
    found = _ANSWER.findall(text)
    return int(found[-1]) if found else None


class Calculator(Environment[Arithmetic]):
    """The environment: `prompt` asks the sum, `step` runs a calculator call or scores the answer."""

    name = "calculator"
    max_turns = 3  # a call, perhaps a second one, an answer
    stop = tool_stops([CALC])  # ["</calc>"]: a turn that calls the tool ends with its closing tag

    def problems(self) -> list[Arithmetic]:
        if not hasattr(self, "_problems"):  # built once per process: splits() and fingerprint() both ask
            self._problems = make_problems()
        return self._problems

    def prompt(self, problem: Arithmetic) -> str:
        return f"{problem.expression} = ?"

    def step(self, episode: Episode, completion: str) -> Reply:
        problem, state = episode.problem, episode.state
        # Counted on the first call of an episode only, and present in every reply (0 or 1): the
        # replies' metrics are summed per episode, so each episode's sum is 0 or 1, truncated or not.
        metrics = {"tool_used": 0.0, "tool_used_correctly": 0.0}
        call = parse_tool_call(completion, [CALC]) if completion.endswith(f"</{CALC}>") else None
        if call is not None:
            value = calculator(call.args)
            if not state.get("used"):
                state["used"] = metrics["tool_used"] = 1.0
            if value == str(problem.answer) and not state.get("used_correctly"):
                state["used_correctly"] = metrics["tool_used_correctly"] = 1.0
            return Reply(tool_result(value), metrics=metrics)
        correct = answer_value(completion) == problem.answer
        return Reply(done=True, reward=1.0 if correct else 0.0, correct=correct, metrics=metrics)

    def fingerprint(self) -> dict:
        """The default (name, a few prompts and demonstrations) and the generator's settings: the
        warm start is cached under it, and a change to the tool rates alone would not show in those."""
        return {**super().fingerprint(), "tool_rate": TOOL_RATE, "problems": N_PROBLEMS, "width": _WIDTH}

    def demonstration(self, problem: Arithmetic) -> list[str]:
        """A solver's trace: ``[call, result, answer]`` for the problems picked to use the tool,
        else ``[answer]``; which ones is fixed per problem (a seeded draw), `TOOL_RATE` of each operator."""
        answer = f"<answer>{problem.answer}</answer>"
        if random.Random(f"tool/{problem.expression}").random() >= TOOL_RATE[problem.op]:
            return [answer]
        call = f"<{CALC}>{problem.expression}</{CALC}>"
        return [call, tool_result(calculator(problem.expression)), answer]
