"""`Pacer`: samplers begin only the groups that can still be trained, so none is made to be dropped.

In async mode a group is trained at most ``max_staleness`` versions after the weights it was begun
under. Unpaced, a sampler faster than the trainer fills the queue, waits on a full queue with a
finished batch in hand, and much of what it made expires there (nearly half of all groups in the
default CPU run before this: docs/grpo.md, "Pacing"). The driver knows everything needed to avoid
that: the version every sampler holds, which step takes the next batch, and how many groups are
queued or being made. So a sampler's pump asks for credit before each batch of prompts, and gets it only for groups
whose turn comes while they are still fresh. (Credit-based flow control, as in prime-rl's
orchestrator, which bounds in-flight rollouts by an off-policy limit; the accounting is ours.)

The arithmetic, with ``n`` groups per step and ``S = max_staleness``: a group begun now carries
the version ``v`` of the last sync (or a newer one, if a sync lands before it begins: fresher,
never staler), and can be trained by the steps up to ``v + S + 1`` (a step ``k`` trains at
version ``k - 1``). The steps whose batch is not yet taken, from ``next_step`` on, take ``n``
groups each in queue order, so the groups already queued or being made go first, and a new one
is on time if ``queued + in_flight + 1 <= n * (v + S + 2 - next_step)``.

Invariants:

* ``in_flight`` counts the groups granted to pumps and neither in the queue yet nor given back:
  a pump returns what it did not deliver in a ``finally`` (a lost sampler's grant included).
* With one sampler and no losses, every group is trained, none dropped (the test of this module
  runs that), also when it runs several paced streams at once (``--sampler.streams``): its pump
  queues their groups in grant order (fleet/pumps.py). Several samplers can deliver out of grant
  order, so a few may still expire.
* While the driver waits for a batch, a pump gets credit: ``version`` is the one the whole group
  holds (the pool tells it after every sync and rebuild, an empty group's included), so the room
  is at least what the next batch lacks, and `grant` gives that much when a whole batch does not
  fit. A pacer left one version behind once held a rejoined sampler idle with 14 of 16 groups
  queued until the run's queue deadline (issue 30).
"""

from __future__ import annotations

import asyncio

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.driver.queue import RolloutQueue, _Wakeup


class PacingTimeoutError(AsyncrlError, TimeoutError):
    """A pump waited past its deadline for credit: the driver stopped taking batches."""


class PacingStats(msgspec.Struct, kw_only=True, frozen=True):
    """The pacer now (`Pacer.stats`), for progress.json and ``asyncrl status``; the field names
    are the keys there."""

    paced_in_flight: int
    """Groups granted credit and not yet queued."""
    paced_streams: int
    """Paced batches in flight, all samplers together."""
    paced_wait_s: float
    """The pumps' wait for credit so far, summed (to the millisecond)."""

    def to_dict(self) -> dict[str, float]:
        return msgspec.to_builtins(self)


class Pacer:
    """Credit for sampler batches (see the module docstring). For one event loop."""

    def __init__(self, queue: RolloutQueue, groups_per_step: int, max_staleness: int, *, version: int, next_step: int):
        self.queue, self.n, self.max_staleness = queue, groups_per_step, max_staleness
        self.version = version  # every sampler in the group holds at least this one
        self.next_step = next_step  # the first step whose batch is not taken yet
        self.in_flight = 0
        self.streams = 0  # grants with credit not yet used or given back: the paced batches in flight
        self._peak_streams = self._peak_in_flight = 0  # since the last `take_peaks`
        self.waited_s = 0.0  # pumps' time waiting for credit, summed (a paced sampler idles)
        self._changed = _Wakeup()

    def room(self) -> int:
        """Groups that may be begun now and still be trained."""
        steps_left = self.version + self.max_staleness + 2 - self.next_step
        return self.n * steps_left - len(self.queue) - self.in_flight

    def short(self) -> int:
        """Groups the next batch lacks even once every group being made has arrived."""
        return self.n - len(self.queue) - self.in_flight

    def grant(self, want: int, least: int | None = None) -> int:
        """The credit a pump asking for ``want`` groups, and content with ``least`` (default:
        all of them), gets now (0: none yet): up to ``want`` where the room holds ``least``.
        Less than ``least`` only when the next batch cannot fill otherwise: nobody makes its
        missing groups, so no batch would be taken and the room would never grow (a lost
        sampler's half-made batch, groups left out as uniform or dropped on arrival leave the
        queue short of a whole number of batches)."""
        room = self.room()
        if room >= (want if least is None else least):
            return min(want, room)
        return max(0, min(room, self.short()))

    async def acquire(self, most: int, timeout_s: float, who: str, least: int | None = None) -> int:
        """Wait until ``min(most, n)`` groups may begin, or ``least`` of them where given (or
        fewer, when that is all the next batch lacks: `grant`), take that credit and return it.
        Raises `PacingTimeoutError` (naming ``who``) after ``timeout_s``."""
        want = max(1, min(most, self.n))
        least = None if least is None else max(1, min(least, want))
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + timeout_s
        try:
            while not (granted := self.grant(want, least)):
                remaining = deadline - loop.time()
                # The queue shrinks without a call here when get_batch drops stale groups.
                if remaining <= 0 or not await self._changed.wait(remaining, self.queue.shrank):
                    raise PacingTimeoutError(
                        f"{who}: no credit for {want} groups within {timeout_s:g} s (version {self.version}, next "
                        f"step {self.next_step}, {len(self.queue)} queued, {self.in_flight} being made)"
                    )
            self.in_flight += granted
            self.streams += 1
            self._peak_streams = max(self._peak_streams, self.streams)
            self._peak_in_flight = max(self._peak_in_flight, self.in_flight)
            return granted
        finally:
            self.waited_s += loop.time() - start

    def delivered(self, last: bool = False) -> None:
        """One granted group left the pump (queued, or dropped on arrival: counted by the queue).
        ``last``: its grant's final group; the grant's batch is no longer in flight, though its
        stream may not have closed yet (its pump may begin the next batch meanwhile)."""
        self.in_flight -= 1
        if last:
            self.streams -= 1
        self._changed.notify_all()

    def give_back(self, groups: int) -> None:
        """A grant ended with ``groups`` of its credit unused (its stream ended early, its sampler
        was lost); with 0 it ended already, at its last delivery. Called once per `acquire`."""
        if groups:
            self.streams -= 1
            self.in_flight -= groups
            self._changed.notify_all()

    def batch_taken(self, version: int) -> None:
        """The step that trains at ``version`` took its batch: the next one is ``version + 2``."""
        self.next_step = version + 2
        self._changed.notify_all()

    def synced(self, version: int) -> None:
        """Every sampler in the group now holds ``version``."""
        self.version = max(self.version, version)
        self._changed.notify_all()

    @property
    def changed(self) -> _Wakeup:
        """Notified whenever credit may have freed: a group delivered, a grant ended, a batch
        taken, a sync. A pump waiting for room in its own window waits on it."""
        return self._changed

    def take_peaks(self) -> tuple[int, int]:
        """The most streams and the most groups in flight at once since the last call (a step's)."""
        peaks = self._peak_streams, self._peak_in_flight
        self._peak_streams, self._peak_in_flight = self.streams, self.in_flight
        return peaks

    def stats(self) -> PacingStats:
        return PacingStats(
            paced_in_flight=self.in_flight, paced_streams=self.streams, paced_wait_s=round(self.waited_s, 3)
        )


def rollout_flow(run: RunConfig, *, version: int, next_step: int) -> tuple[RolloutQueue, Pacer | None]:
    """The rollout queue of a run (``--run.queue_capacity``, else two steps' groups) and, in async
    mode, its `Pacer` (``version``: the weights' now; ``next_step``: the first step to take a batch).
    In sync mode a step's groups are made with its weights: a staleness bound of 0, nothing paced."""
    asynchronous = run.mode == "async"
    staleness = run.staleness_bound() if asynchronous else 0
    queue = RolloutQueue(run.queue_capacity or 2 * run.groups_per_step, staleness)
    if not asynchronous:
        return queue, None
    return queue, Pacer(queue, run.groups_per_step, staleness, version=version, next_step=next_step)
