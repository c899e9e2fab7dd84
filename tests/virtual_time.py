"""An event loop on a virtual clock, for the unit tests whose subject is timing (pacing, a window's
timer, starts that end in a given order): `run_virtual(coro)`.

Its clock moves only when the loop has nothing left to run but timers: then it jumps to the next
one. ``asyncio.sleep(30)`` returns at once and timeouts expire in their order, so a test waits for
no wall time and a loaded machine's late timers cannot reorder what it checks. Sockets and pipes
still work (the loop polls them before each jump); a wait on another thread does not (the clock
would jump past its timeout), so only code that runs on the loop alone belongs here.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that, asked to wait ``timeout`` seconds with nothing ready, moves the clock by
    that much instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only I/O can wake the loop
            return super().select(None)
        self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on a new `VirtualTimeLoop`, then close the loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
