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
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from asyncrl.errors import ActorDiedError, CallTimeoutError, first_line

T = TypeVar("T")
C = TypeVar("C", bound="Callee")


class Callee(Protocol):
    """What `call_all` calls: an actor's handle (or the trainer's ranks, as one)."""

    @property
    def name(self) -> str: ...

    def with_timeout(self: C, timeout_s: float) -> C: ...


@dataclass
class Answers(Generic[T]):
    """The outcome of one call to ``names`` (in order): each one's answer, or the error its call
    raised (`ActorDiedError`, `CallTimeoutError`, a `RemoteError`, ...)."""

    what: str
    """The call, as a cause names it ("the weight sync of v3")."""
    names: list[str]
    results: list[T | BaseException]

    @property
    def ok(self) -> bool:
        return not self.failed()

    def failed(self) -> list[int]:
        """The positions whose call raised."""
        return [i for i, r in enumerate(self.results) if isinstance(r, BaseException)]

    def values(self) -> list[T]:
        """Every answer, when none failed (`ok`); a `ValueError` naming the failures otherwise."""
        values = [r for r in self.results if not isinstance(r, BaseException)]
        if len(values) != len(self.results):
            raise ValueError(f"{self.what}: {self.summary()}")
        return values

    def cause(self, i: int) -> str:
        """Why the call at ``i`` failed, naming the call: a loss's cause in faults.jsonl."""
        error = self.results[i]
        return failure_cause(self.what, error) if isinstance(error, BaseException) else ""

    def summary(self) -> str:
        """Every failure in one line, each named (the log line of a failed group-wide call)."""
        failed = [(name, r) for name, r in zip(self.names, self.results) if isinstance(r, BaseException)]
        return "; ".join(f"{name}: {first_line(error)}" for name, error in failed)


def failure_cause(what: str, error: BaseException) -> str:
    """``error`` of a call made for ``what``, in words: it died, it said nothing within its
    deadline, or it failed (its own error's first line)."""
    if isinstance(error, ActorDiedError):
        return f"died during {what} ({error.reason})"
    if isinstance(error, CallTimeoutError):
        return f"no answer during {what} within {error.timeout_s:g} s"
    return f"failed during {what}: {first_line(error)}"


async def call_all(
    handles: Sequence[C],
    call: Callable[[C, int], Awaitable[T]],
    *,
    timeout_s: float | None,
    what: str,
    died: Callable[[int, ActorDiedError], None] | None = None,
) -> Answers[T]:
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

            def done(future: asyncio.Future[T], i: int = i) -> None:
                error = None if future.cancelled() else future.exception()
                if isinstance(error, ActorDiedError):
                    died(i, error)

            future.add_done_callback(done)
    results: list[T | BaseException] = list(await asyncio.gather(*calls, return_exceptions=True))
    return Answers(what, [h.name for h in handles], results)
