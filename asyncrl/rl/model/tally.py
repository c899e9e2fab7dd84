"""What a held-out evaluation's episodes add up to, in parts that cross processes.

A `Tally` holds sums and counts (never means), so the parts of one evaluation add up exactly
wherever they were solved: the trainer's chunks, or each sampler's shard. A `HeldoutPart` says
which held-out problems a tally is of, in which pass (greedy, or ``samples`` completions each),
and under which weight versions it was generated. `heldout_answer` turns an evaluation's parts
into what the run records: the solve rates, the task's metrics of the greedy episodes, the failed
calls and an agent's failed episodes. Torch-free: the driver reads it.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class Tally(msgspec.Struct, omit_defaults=True):
    """Sums over a set of evaluated episodes. Add two with ``+``."""

    episodes: int = 0
    correct: int = 0
    """Episodes the task found correct."""
    metrics: dict[str, float] = {}
    """Each of the task's metrics summed over the episodes (an episode without it adds 0)."""
    errors: dict[str, int] = {}
    """Failed user calls (score, step) by error kind."""
    failures: dict[str, int] = {}
    """An agent's failed episodes by what they were (`scoring.failure_kinds`: one line per kind,
    the first one's message; two tallies' lines of one kind are one line, the first's)."""

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.episodes + other.episodes,
            self.correct + other.correct,
            _summed(self.metrics, other.metrics),
            _summed(self.errors, other.errors),
            _kinds_summed(self.failures, other.failures),
        )

    @property
    def solve_rate(self) -> float:
        """The share of the episodes found correct (0.0 of none)."""
        return self.correct / self.episodes if self.episodes else 0.0

    def means(self) -> dict[str, float]:
        """Each metric's mean over every episode, by name."""
        return {k: v / self.episodes for k, v in sorted(self.metrics.items())} if self.episodes else {}


class HeldoutAsk(msgspec.Struct, frozen=True, kw_only=True):
    """Which held-out problems an evaluation solves, and how: ``greedy`` greedily, ``sampled``
    with ``samples`` completions each (indices into the split; None: every problem, and none
    sampled with ``samples`` 0), each completion up to ``max_new_tokens`` (0: the prompt format's
    hint), ``rows`` sequences a part (the trainer's generate batch)."""

    greedy: list[int] | None = None
    sampled: list[int] | None = None
    samples: int = 4
    max_new_tokens: int = 0
    rows: int = 64


class HeldoutPart(msgspec.Struct, omit_defaults=True):
    """Some held-out problems of one pass, solved: a sampler's stream item, a trainer's answer."""

    sampled: bool
    """False: the greedy pass (one completion a problem); True: the sampled one."""
    problems: list[int]
    """Their indices in the held-out split."""
    tally: Tally
    versions: list[int] = []
    """The weight versions their generation ran under (one, when nothing synced meanwhile)."""


def total(parts: Iterable[HeldoutPart], sampled: bool) -> Tally:
    """The tally of one pass's parts, added in the order of their first problem."""
    found = Tally()
    for part in sorted((p for p in parts if p.sampled == sampled), key=lambda p: p.problems[:1]):
        found = found + part.tally
    return found


def heldout_answer(parts: list[HeldoutPart], samples: int) -> dict[str, float | dict[str, int]]:
    """``greedy`` and (with ``samples``) ``sampled`` solve rates; the task's metrics of the greedy
    episodes as ``task/<name>``; failed calls of both passes as ``task_errors/<kind>``; an agent's
    failed episodes as ``failures`` (``greedy: raised TYPE: first line`` or ``sampled: ...`` -> how
    many; absent when none failed): the trainer's `evaluate` answer, from any parts."""
    greedy = total(parts, sampled=False)
    out: dict[str, float | dict[str, int]] = {"greedy": greedy.solve_rate}
    out |= {f"task/{k}": v for k, v in greedy.means().items()}
    errors, failures = dict(greedy.errors), {f"greedy: {k}": v for k, v in greedy.failures.items()}
    if samples:
        sampled = total(parts, sampled=True)
        out["sampled"] = sampled.solve_rate
        errors = _summed(errors, sampled.errors)
        failures |= {f"sampled: {k}": v for k, v in sampled.failures.items()}
    out |= {f"task_errors/{k}": float(v) for k, v in sorted(errors.items())}
    return out | ({"failures": failures} if failures else {})


def _summed(a: dict, b: dict) -> dict:
    if not b:
        return dict(a)
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def _kinds_summed(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """`failure_kinds` lines of two tallies, those of one kind (error kind and the head of the
    reason, as `failure_kinds` tells them) counted under ``a``'s line."""
    out = dict(a)
    lines = {_kind(line): line for line in a}
    for line, count in b.items():
        mine = lines.setdefault(_kind(line), line)
        out[mine] = out.get(mine, 0) + count
    return out


def _kind(line: str) -> tuple[str, str]:
    error, _, reason = line.partition(" ")
    return error, reason.split(": ", 1)[0]
