"""One deadline primitive for every ``await`` with a limit: ``async with timeout(s):``.

Not ``asyncio.wait_for``: on Python 3.11 it swallows a cancel that arrives together with the
result it waits for, and the cancelled task runs on (a rollout pump cancelled at the end of a run
kept reading and blocked the shutdown for minutes). ``asyncio.timeout`` (3.11+) has no such window;
on 3.10 the same API comes from the maintained ``async-timeout`` backport. Both raise
``TimeoutError`` (``asyncio.TimeoutError`` is that class from 3.11 on; on 3.10 the backport
raises ``asyncio.TimeoutError``, which callers here catch as such). `Deadline` is the type of one,
which `move_deadline` moves and `expired` asks about, across the two APIs."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import Timeout as Deadline
    from asyncio import timeout
else:  # pragma: no cover - exercised on 3.10 only
    from async_timeout import Timeout as Deadline
    from async_timeout import timeout

__all__ = ["Deadline", "expired", "move_deadline", "timeout"]


def expired(cm: Deadline) -> bool:
    """Whether ``cm`` (a ``timeout(...)``) ran out: a method in asyncio's, a property in the backport's."""
    value = cm.expired
    return bool(value() if callable(value) else value)


def move_deadline(cm: Deadline, when: float) -> None:
    """Move the deadline of ``cm`` (an entered ``timeout(...)`` that has not run out) to ``when``,
    in the loop's time: ``reschedule`` in asyncio's, ``update`` in the 4.x backport's."""
    move = getattr(cm, "reschedule", None) or cm.update
    move(when)
