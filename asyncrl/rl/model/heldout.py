"""A run's held-out problems, solved by any generation: `HeldoutSet`, what the trainer's and the
samplers' held-out evaluations share.

The task never crosses a process boundary: it is built from its spec in the process that solves
(once, on first use, unless the process has it built already), and its splits are deterministic,
so these are the held-out problems the driver checked before spawning anything. The task's calls
run under one budget for every evaluation of the process (`UserCalls` with ``stop_early``), as a
sampler's rollouts do. The problems are named by their index in the held-out split, so the driver
can hand a shard of them to each sampler, and give a lost one's rest to another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.rl.config.run import DataConfig
from asyncrl.rl.model.tally import HeldoutPart, Tally
from asyncrl.rl.tasks.loading import TaskSpec

if TYPE_CHECKING:
    from asyncrl.rl.tasks.base import Task
    from asyncrl.rl.tasks.episodes import Generate
    from asyncrl.rl.tasks.scoring import UserCalls


class HeldoutSet:
    """The held-out problems of ``task`` (``data.n_heldout`` of them, from ``data.data_seed``),
    solved when asked (`solve`). ``built``: the task, where the owner has built it already. Its
    owner calls `close` when it stops."""

    def __init__(self, task: TaskSpec, data: DataConfig, built: Task | None = None):
        self.task_spec, self.data = task, data
        self._task = built
        self._problems: list | None = None
        self._calls: UserCalls | None = None  # its score/step calls: one budget for every evaluation

    @property
    def task(self) -> Task:
        if self._task is None:
            from asyncrl.rl.tasks.loading import load_task

            self._task = load_task(self.task_spec)
        return self._task

    @property
    def problems(self) -> list:
        """The held-out split alone: it does not depend on ``n_train``."""
        if self._problems is None:
            self._problems = list(self.task.splits(self.data.data_seed, 1, self.data.n_heldout).heldout)
        return self._problems

    @property
    def calls(self) -> UserCalls:
        if self._calls is None:
            from asyncrl.rl.tasks.scoring import UserCalls

            self._calls = UserCalls(
                self.task.task_name(),
                self.task_spec.score_timeout_s,
                self.task_spec.max_failure_rate,
                stop_early=True,
            )
        return self._calls

    async def solve(
        self,
        generate: Generate,
        fmt: Any,
        *,
        greedy: Sequence[int],
        sampled: Sequence[int],
        samples: int,
        max_new_tokens: int,
        temperature: float,
        max_context: int,
        rows: int,
        at_once: int = 1,
        versions: Callable[[], list[int]] = list,
        on_part: Callable[[HeldoutPart], None] | None = None,
    ) -> list[HeldoutPart]:
        """The problems ``greedy`` (indices into the held-out split) greedily, then ``sampled``
        with ``samples`` completions each at ``temperature``, by ``generate`` (`evaluate_with`),
        in parts of about ``rows`` sequences (whole batches of ``rows``: the same ``generate``
        calls as one part would make), ``at_once`` parts in flight. Each part, as it ends, goes
        to ``on_part`` tagged with ``versions()``; all of them are returned. Raises what the
        evaluation raises: `TaskFailureError` past the task's failure budget, what ``generate``
        raises."""
        from asyncrl.rl.model.evaluation import evaluate_with

        if any(not 0 <= i < len(self.problems) for i in (*greedy, *sampled)):
            raise ValueError(f"held-out problem indices must be in [0, {len(self.problems)})")
        if sampled and samples < 1:
            raise ValueError(f"samples must be >= 1 to solve sampled problems, not {samples}")
        parts: list[HeldoutPart] = []
        for is_sampled, indices, n in ((False, list(greedy), 1), (True, list(sampled), samples)):
            if not indices:
                continue

            def told(positions: range, tally: Tally, indices: list[int] = indices, is_sampled: bool = is_sampled):
                part = HeldoutPart(is_sampled, [indices[j] for j in positions], tally, versions())
                parts.append(part)
                if on_part is not None:
                    on_part(part)

            await evaluate_with(
                generate,
                fmt,
                [self.problems[i] for i in indices],
                task=self.task,
                greedy=not is_sampled,
                n=n,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                calls=self.calls,
                max_context=max_context,
                chunk=part_problems(rows, n),
                at_once=at_once,
                on_part=told,
            )
        return parts

    def close(self) -> None:
        """End the threads the task's calls run on (started by the first evaluation); the owner
        calls it when it stops. Idempotent; an evaluation after it raises `TaskFailureError`."""
        if self._calls is not None:
            self._calls.close()


def part_problems(rows: int, n: int) -> int:
    """Problems per part of ``n`` completions each: about ``rows`` sequences, and a whole number
    of batches of ``rows``, so the parts make the very batches one part would."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, not {rows}")
    return rows // n if rows % n == 0 and rows >= n else rows
