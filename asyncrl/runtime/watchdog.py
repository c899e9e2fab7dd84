"""The silence watchdog: one task that acts on whatever has not been heard from for too long.

The supervisor watches its actors' heartbeats with it (a silent actor is frozen: killed) and the
cluster its node agents' (a silent node is lost). Each beat is a time stamp its owner keeps
(``ActorRecord.last_heartbeat``, ``Node.last_seen``); the watchdog only reads them.

Invariant: silence is counted only while our own loop runs. A tick that comes more than half a
timeout late means this loop was blocked (a long synchronous step, a stop of the whole process):
the beats are queued unread, not missing, so silence is counted afresh from that tick, and nothing
is judged silent on the strength of our own stall.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")

log = logging.getLogger("asyncrl.watchdog")


class SilenceWatchdog(Generic[T]):
    """Every ``interval_s``, ``on_silent(item, silent_s)`` for each ``(item, last_heard)`` of
    ``watched()`` that has been silent for more than ``timeout_s`` (``last_heard`` on the
    ``time.monotonic`` clock). ``watched`` lists only what may still be judged (a running actor
    not already being killed, a node not already lost), so ``on_silent`` is not called again for
    what it has acted on. Both run on the event loop and must not block."""

    def __init__(
        self,
        what: str,
        interval_s: float,
        timeout_s: float,
        watched: Callable[[], Iterable[tuple[T, float]]],
        on_silent: Callable[[T, float], None],
    ) -> None:
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"{what}: need 0 < interval_s < timeout_s, not {interval_s!r} and {timeout_s!r}")
        self.what = what
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._watched = watched
        self._on_silent = on_silent
        self._task: asyncio.Task | None = None

    def start(self) -> SilenceWatchdog[T]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return self

    def close(self) -> None:
        """Stop watching. Idempotent."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        last_tick = counted_from = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            if now - last_tick > self.timeout_s / 2:
                counted_from = now  # our own loop was blocked: start afresh (see the invariant)
            last_tick = now
            for item, last_heard in list(self._watched()):
                silent = now - max(last_heard, counted_from)
                if silent > self.timeout_s:
                    try:
                        self._on_silent(item, silent)
                    except Exception:  # one bad verdict must not blind the watchdog to the rest
                        log.exception("%s: acting on a silent %r failed", self.what, item)
