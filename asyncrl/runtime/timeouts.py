"""One deadline primitive for every ``await`` with a limit: ``async with timeout(s):``.

Not ``asyncio.wait_for``: on Python 3.11 it swallows a cancel that arrives together with the
result it waits for, and the cancelled task runs on (a rollout pump cancelled at the end of a run
kept reading and blocked the shutdown for minutes). ``asyncio.timeout`` (3.11+) has no such window;
on 3.10 the same API comes from the maintained ``async-timeout`` backport. Both raise
``TimeoutError`` (``asyncio.TimeoutError`` is that class from 3.11 on; on 3.10 the backport
raises ``asyncio.TimeoutError``, which callers here catch as such)."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pragma: no cover - exercised on 3.10 only
    from async_timeout import timeout

__all__ = ["timeout"]
