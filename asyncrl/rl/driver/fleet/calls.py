"""`call_all`: one call made to many actors at once, and what each of them answered.

Every call the driver makes to a set of actors (the samplers of the weight-sync group, the
trainer with them, the ranks of an N-rank trainer) goes through here: each actor is called with
its own deadline, all at once, and every answer is awaited; an actor that fails never cuts the
others short. What failed is handed back in `Answers`, each failure with a cause that names the
call: a member's is judged by `Membership.call_all` (lost, or spared as a peer's victim), a
trainer rank's by `TrainerRanks`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.errors import ActorDiedError, CallTimeoutError, first_line


@dataclass
class Answers:
    """The outcome of one call to ``names`` (in order): each one's answer, or the error its call
    raised (`ActorDiedError`, `CallTimeoutError`, a `RemoteError`, ...)."""

    what: str
    """The call, as a cause names it ("the weight sync of v3")."""
    names: list[str]
    results: list[Any]
    members: list[Any] = field(default_factory=list)
    """The fleet's members called (`Membership.call_all`), in the order of their answers, which
    come last: after the trainer's when it was called with them."""

    def of_members(self) -> list[tuple[Any, Any]]:
        """Each member called, with its answer or error."""
        return list(zip(self.members, self.results[len(self.results) - len(self.members) :]))

    @property
    def ok(self) -> bool:
        return not self.failed()

    def failed(self) -> list[int]:
        """The positions whose call raised."""
        return [i for i, r in enumerate(self.results) if isinstance(r, BaseException)]

    def cause(self, i: int) -> str:
        """Why the call at ``i`` failed, naming the call: a loss's cause in faults.jsonl."""
        return failure_cause(self.what, self.results[i])

    def summary(self) -> str:
        """Every failure in one line, each named (the log line of a failed group-wide call)."""
        return "; ".join(f"{self.names[i]}: {first_line(self.results[i])}" for i in self.failed())


def failure_cause(what: str, error: BaseException) -> str:
    """``error`` of a call made for ``what``, in words: it died, it said nothing within its
    deadline, or it failed (its own error's first line)."""
    if isinstance(error, ActorDiedError):
        return f"died during {what} ({error.reason})"
    if isinstance(error, CallTimeoutError):
        return f"no answer during {what} within {error.timeout_s:g} s"
    return f"failed during {what}: {first_line(error)}"


async def call_all(
    handles: Sequence[Any],
    call: Callable[[Any, int], Awaitable[Any]],
    *,
    timeout_s: float | None,
    what: str,
    died: Callable[[int, ActorDiedError], None] | None = None,
) -> Answers:
    """``call(handle.with_timeout(timeout_s), i)`` for every handle at once; every answer awaited
    (each bounded by its own deadline, ``timeout_s`` or with None the handle's: the actor's call
    fails with `CallTimeoutError` naming it and the method). ``died(i, error)``: told the moment
    the call at ``i`` fails with the actor's death, not when the slowest answer comes (the others
    may wait out their deadline for it)."""
    calls = [
        asyncio.ensure_future(call(h if timeout_s is None else h.with_timeout(timeout_s), i))
        for i, h in enumerate(handles)
    ]
    if died is not None:
        for i, future in enumerate(calls):

            def done(future: asyncio.Future, i: int = i) -> None:
                error = None if future.cancelled() else future.exception()
                if isinstance(error, ActorDiedError):
                    died(i, error)

            future.add_done_callback(done)
    results = await asyncio.gather(*calls, return_exceptions=True)
    return Answers(what, [h.name for h in handles], list(results))
