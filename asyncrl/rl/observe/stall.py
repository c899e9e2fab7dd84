"""`StallWatch`: a run that makes no step for much longer than its recent steps took says so.

Every wait of the driver has a deadline, but the one for a batch (``--run.queue_timeout_s``, 30
minutes by default) is long enough to hide a run that stopped moving: issue 30's run made no step
for many minutes while every process looked healthy (docs/fault_tolerance.md). So the driver times its steps, and a step
that runs past ``max(stall_factor x the median of the recent steps, stall_floor_s)`` is a stall:
one line says what the step waits for and from whom, `asyncrl status` shows it (``stalled`` in
the progress), and ``/healthz`` answers 503. It is said again each time the wait doubles, and
cleared, in one line, when the step ends.

What is not judged, and why:

* The first step of a run segment: there are no recent steps to compare with, and it carries
  the samplers' first batches and warm-up; its deadlines bound it.
* The driver's work between steps (evaluations, checkpoints, saving the best policy): each is a
  call to the trainer with its own deadline, and its length says nothing about the steps.
* A step while a lost sampler's restart is awaited (``settled_at`` answers None): the loss was
  said in the log, and the wait is bounded by ``--run.restart_timeout_s``. The clock starts over
  when the group is settled again (the sampler rejoined, or is gone for good).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable

from asyncrl.runtime.timeouts import timeout

RECENT_STEPS = 20
"""How many of the latest steps the median is taken over."""


class StallWatch:
    """Times the steps and judges the one under way (see the module docstring). For one event
    loop: `run` is a task of the driver; the other methods are called from the driver's steps."""

    def __init__(
        self,
        factor: float,
        floor_s: float,
        *,
        describe: Callable[[float, float], Awaitable[str]],
        settled_at: Callable[[], float | None] = lambda: 0.0,
        log=print,
        clock=time.monotonic,
    ):
        """``describe(waited_s, limit_s)``: the line of a stall; ``settled_at()``: when (on
        ``clock``) the samplers' group last became settled, None while a restart is awaited."""
        self.factor, self.floor_s = factor, floor_s
        self.describe, self.settled_at, self.log, self.clock = describe, settled_at, log, clock
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.reason = ""  # while stalled: what the step waits for (shown by status and /healthz)
        self._since: float | None = None  # when the step under way began
        self._report_at = 0.0  # the wait, in seconds, at which the stall is said (again)
        self._changed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def limit_s(self) -> float | None:
        """How long a step may take before it is a stall; None before the first step."""
        if not self.recent:
            return None
        return max(self.factor * statistics.median(self.recent), self.floor_s)

    def typical_s(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0

    def step_began(self) -> None:
        self._since = self.clock()
        self._report_at = 0.0
        self._changed.set()

    def step_ended(self, seconds: float) -> None:
        """The step took ``seconds``; a stall it was in ends, said in one line."""
        if self.reason:
            waited = self.clock() - self._since if self._since is not None else seconds
            self.log(f"steps resume: the stalled step ended after {waited:.0f} s")
            self.reason = ""
        self.recent.append(seconds)
        self._since = None
        self._changed.set()

    def waited_s(self) -> float:
        """Seconds since the step under way began (0 between steps)."""
        return self.clock() - self._since if self._since is not None else 0.0

    def judged_s(self, now: float | None = None) -> float | None:
        """Seconds of the step's wait that count, at ``now`` (default: the clock's now): since it
        began or since the group was last settled, the later; None while a restart is awaited (or
        between steps)."""
        settled = self.settled_at()
        if self._since is None or settled is None:
            return None
        return (self.clock() if now is None else now) - max(self._since, settled)

    async def run(self) -> None:
        """Judge each step as it runs, until cancelled (by the driver, when the steps end)."""
        if not self.enabled:
            return
        while True:
            self._changed.clear()
            due = self._due_in()
            if due is None or due > 0:
                try:
                    async with timeout(due):  # None: until a step begins or ends
                        await self._changed.wait()
                    continue
                except (asyncio.TimeoutError, TimeoutError):
                    pass
            await self._judge()

    def _due_in(self) -> float | None:
        limit = self.limit_s()
        if self._since is None or limit is None:
            return None
        judged = self.judged_s()
        if judged is None:
            return limit  # a restart is awaited: look again later (it is bounded by restart_timeout_s)
        return max(self._report_at, limit) - judged

    async def _judge(self) -> None:
        # One reading of the clock: the wait told is the one judged, from which the next report's
        # wait is doubled (two readings made the told wait a little longer than the judged one).
        now, since = self.clock(), self._since
        judged, limit = self.judged_s(now), self.limit_s()
        if judged is None or since is None or limit is None or judged < max(self._report_at, limit):
            return
        reason = await self.describe(now - since, limit)
        if self._since != since:
            return  # the step ended (or another began) while it was described: no stall to tell
        self.reason = reason
        self.log(f"stalled: {reason}")
        self._report_at = 2 * judged
