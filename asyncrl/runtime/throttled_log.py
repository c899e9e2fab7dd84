"""`ThrottledLog`: a warning that a peer can cause at any rate (a refused request, an undecodable
frame), logged in full the first time and then summed up, one line per window at most.

Why: each refusal used to print its own line, so a peer sending junk in a loop (a fuzzer, a port
scanner, a client of another version) flooded the console and the run's log.txt, burying every
other line, while the actor went on serving. The count stays exact (``total``); only the lines
are bounded: after the first, at most one summary per ``every_s``, whatever the rate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

SUMMARY_EVERY_S = 5.0


class ThrottledLog:
    """Warnings of one kind, from one place. The first is logged as ``"{prefix} {one}: {detail}"``;
    those that follow within ``every_s`` are counted, and when the window ends one line says
    ``"{prefix} {n} more {many} in the last {seconds} s (last: {detail}); {total} in all"`` and a
    new window opens. A window in which nothing came closes silently: the next warning is logged
    in full again. On an event loop a timer ends the window, so the summary comes even when the
    flood stops; without one (a thread), the next warning after the window ends it."""

    def __init__(
        self,
        logger: logging.Logger,
        prefix: str,
        one: str,
        many: str,
        *,
        every_s: float = SUMMARY_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total = 0
        """Every warning noted, logged or summed up."""
        self._log, self._prefix, self._one, self._many = logger, prefix, one, many
        self._every_s, self._clock = every_s, clock
        self._pending = 0
        self._last = ""
        self._window_start = 0.0
        self._window_end: float | None = None  # None: no window open, the next one is logged in full
        self._timer: asyncio.TimerHandle | None = None

    def note(self, detail: str) -> None:
        now = self._clock()
        if self._window_end is not None and now >= self._window_end:
            self._end_window(now)  # no timer ended it (no event loop)
        self.total += 1
        if self._window_end is None:
            self._log.warning("%s %s: %s", self._prefix, self._one, detail)
            self._open(now)
            return
        self._pending += 1
        self._last = detail

    def close(self) -> None:
        """Cancel the timer; what was counted but not yet summed up is logged now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._summarize(self._clock())
        self._window_end = None

    def _open(self, now: float) -> None:
        self._window_start, self._window_end = now, now + self._every_s
        if self._timer is not None:  # a note came first and ended the window: one timer at a time
            self._timer.cancel()
            self._timer = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(self._every_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._end_window(self._clock())

    def _end_window(self, now: float) -> None:
        if self._summarize(now):
            self._open(now)  # the summary was a line of this window: quiet for another one
        else:
            self._window_end = None

    def _summarize(self, now: float) -> bool:
        if not self._pending:
            return False
        self._log.warning(
            "%s %d more %s in the last %g s (last: %s); %d in all",
            self._prefix,
            self._pending,
            self._many,
            round(now - self._window_start, 1),
            self._last,
            self.total,
        )
        self._pending, self._last = 0, ""
        return True
