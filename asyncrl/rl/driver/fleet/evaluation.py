"""The held-out evaluation on the samplers: each sampler in the weight-sync group solves a shard of
the held-out problems on its own engine (`SamplerActor.evaluate_heldout`), beside its rollouts,
and streams its parts as they end.

Invariants:

* One version throughout. The loop awaits the evaluation and makes no weight sync meanwhile (a
  sync happens only inside a step, and a scale-up joins at a sync), so every sampler in the group
  holds the version the trainer held when the evaluation began, provided the step synced it
  (grpo.py syncs an evaluated step whatever ``--run.sync_every``). Each part says the versions it
  was generated under; one that is not ``version`` alone is not counted, and its sampler is lost
  (killed and restarted: its weights are not the run's), with a line that says so.
* Nothing counted twice, nothing left out: a part's problems are taken off what is left when it
  arrives, and a part naming problems not left is refused. A sampler that fails (dies, goes
  silent past the item deadline, streams a wrong part) is lost as any other (`Membership.call_all`)
  and what it had not yet delivered is shared among the others in the next round; what no sampler
  can take is left for the caller (the trainer, ``driver/heldout.py``). Each round loses at least
  one sampler or solves everything, so the rounds end.
* The task's own code failing past its budget (`TaskFailureError`) is the task's fault, not the
  sampler's: it stops the run (`TaskFailedError`), as it does in a rollout stream.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing
from typing import TypeGuard

from asyncrl.errors import AsyncrlError, RemoteError
from asyncrl.rl.driver.faults import TaskFailedError
from asyncrl.rl.driver.fleet.decoding import UNWATCHED_S, while_decoding
from asyncrl.rl.driver.fleet.membership import Member, Membership, MemberState
from asyncrl.rl.model.tally import HeldoutPart
from asyncrl.rl.tasks.scoring import TaskFailureError


class EvaluationPartError(AsyncrlError):
    """A sampler streamed a held-out part that cannot be counted: generated under another weight
    version than the one evaluated, or of problems it was not given (or given to another)."""


class Unsolved:
    """The held-out problems not solved yet, per pass (greedy, sampled), by index in the split."""

    def __init__(self, problems: int, samples: int):
        self.left = {False: set(range(problems)), True: set(range(problems)) if samples else set()}

    def __bool__(self) -> bool:
        return any(self.left.values())

    def take(self, part: HeldoutPart) -> bool:
        """Count ``part`` solved; False (nothing taken) if any of its problems is not left."""
        left = self.left[part.sampled]
        if not part.problems or not left.issuperset(part.problems) or len(set(part.problems)) != len(part.problems):
            return False
        left.difference_update(part.problems)
        return True

    def shards(self, k: int) -> list[tuple[list[int], list[int]]]:
        """What is left, in ``k`` shards as even as can be: each a slice of each pass's problems."""
        greedy, sampled = sorted(self.left[False]), sorted(self.left[True])
        return [(_slice(greedy, i, k), _slice(sampled, i, k)) for i in range(k)]


async def solve_on_samplers(
    membership: Membership,
    unsolved: Unsolved,
    *,
    samples: int,
    version: int,
    rows: int,
    item_timeout_s: float,
    on_part: Callable[[HeldoutPart], None],
    log: Callable[[str], None],
) -> list[HeldoutPart]:
    """Have the samplers in the group solve what ``unsolved`` holds, in rounds (see the module
    docstring); each part, as it comes, is taken off ``unsolved`` and told to ``on_part``. Returns
    the parts; what no sampler could solve is left in ``unsolved``. ``item_timeout_s``: the
    longest a sampler may go with no part and no token decoded before it counts as lost
    (`while_decoding`)."""
    parts: list[HeldoutPart] = []
    what = f"the held-out evaluation of v{version}"
    while unsolved:
        members = membership.with_state(MemberState.JOINED)
        if not members:
            break
        shards = dict(zip(members, unsolved.shards(len(members))))

        async def shard(handle, m: Member, shards: dict = shards) -> None:
            greedy, sampled = shards[m]
            if not greedy and not sampled:
                return
            stream = handle.with_timeout(UNWATCHED_S).evaluate_heldout(greedy, sampled, samples, 0, rows)
            watched = while_decoding(handle, stream, timeout_s=item_timeout_s, what="evaluate_heldout")
            async with aclosing(watched):
                async for part in watched:
                    mine = set(sampled if part.sampled else greedy)
                    if part.versions != [version]:
                        raise EvaluationPartError(
                            f"{m.name} evaluated held-out problems under weight version(s) "
                            f"{', '.join(f'v{v}' for v in part.versions) or 'unknown'}, not v{version}: "
                            f"its part is not counted, and its weights are not the run's"
                        )
                    if not mine.issuperset(part.problems) or not unsolved.take(part):
                        raise EvaluationPartError(f"{m.name} sent a held-out part of problems it was not given")
                    parts.append(part)
                    on_part(part)
            short = unsolved.left[False].intersection(greedy) | unsolved.left[True].intersection(sampled)
            if short:
                raise EvaluationPartError(f"{m.name} ended its held-out stream with {len(short)} problem(s) unsolved")

        answers = await membership.call_all(members, shard, timeout_s=item_timeout_s, what=what, spare=_task_failed)
        failed = [(m, e) for m, e in answers.of_members() if isinstance(e, BaseException)]
        for m, error in failed:
            if _task_failed(error):
                raise TaskFailedError(f"{what} on {m.name}: {error.remote_message}") from error
        if failed and unsolved:
            heirs = "the samplers still in the group" if membership.with_state(MemberState.JOINED) else "the trainer"
            names = ", ".join(m.name for m, _ in failed)
            log(f"{what}: what {names} left unsolved goes to {heirs}")
    return parts


def _task_failed(error: BaseException) -> TypeGuard[RemoteError]:
    return isinstance(error, RemoteError) and isinstance(error, TaskFailureError)


def _slice(items: list[int], i: int, k: int) -> list[int]:
    return items[len(items) * i // k : len(items) * (i + 1) // k]
