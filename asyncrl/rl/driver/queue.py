"""The driver's bounded rollout queue with its staleness filter (`RolloutQueue`).

Groups leave in the order they arrived, which is the order they were finished: a group waits
behind no group that is still being generated, however long that one runs. Staleness, for the
filter, is counted from when a group was finished (`RolloutGroup.finished_version`: the version
its sampler held when it sent the group, at least its newest token's): how long a group sat
finished, not how long it took to make. A completion that spans several weight updates
(each token's version is in `RolloutGroup.version_spans`) is therefore never dropped for being
long; its oldest tokens are as old as its generation was long, and the trainer's off-policy
correction weighs each token by the policy that sampled it. What bounds how old a token can get
is admission: the `Pacer` begins only the groups that the steps to come will take
(docs/grpo.md, "Long generations").
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.rl.observe.lengths import LengthTally
from asyncrl.rl.rollout import RolloutGroup, validate_group


class QueueTimeoutError(AsyncrlError, TimeoutError):
    """A ``put`` or ``get_batch`` passed its deadline; the message says what it waited for."""


class QueueClosedError(AsyncrlError):
    """The rollout queue was closed before, or while, the operation waited."""


class FutureGroupError(AsyncrlError, ValueError):
    """A group claims a weight version newer than the trainer's: a versioning bug upstream. The
    group was taken out of the queue and is attached as ``group`` (so it is not silently lost)."""

    def __init__(self, group: RolloutGroup, current_version: int):
        super().__init__(
            f"rollout group for prompt {group.prompt_id} from sampler {group.sampler or '?'!r} has "
            f"version {group.finished_version}, newer than the current version {current_version}"
        )
        self.group = group
        self.current_version = current_version


class RolloutQueueStats(msgspec.Struct, frozen=True):
    """A snapshot of the queue's counters (``RolloutQueue.stats()``). ``puts``: groups accepted;
    ``gets``: groups delivered, in ``batches``; ``dropped_stale``: groups discarded (queued or on
    arrival) for staleness > ``max_staleness``; ``staleness_hist``: delivered groups by staleness
    (versions since they were finished); ``blocked_put_s``: seconds producers waited for a slot,
    summed over producers (finished waits)."""

    capacity: int
    max_staleness: int
    depth: int
    puts: int
    gets: int
    batches: int
    dropped_stale: int
    staleness_hist: dict[int, int]
    blocked_put_s: float
    put_timeouts: int
    get_timeouts: int
    offered_lengths: dict[str, int] = {}
    """Completions of every valid group offered to ``put``, by length bucket (observe/lengths.py)."""
    trained_lengths: dict[str, int] = {}
    """Completions delivered in batches, by length bucket."""
    dropped_lengths: dict[str, int] = {}
    """Completions of the groups dropped as stale, by length bucket: nothing should be dropped
    for being long."""


class _Wakeup:
    """A broadcast wake-up: every task waiting when ``notify_all()`` runs wakes once and re-checks
    its own condition (a condition variable without a lock: asyncio runs one task at a time).
    Notifying is synchronous, so ``RolloutQueue.close()`` needs no ``await``; waiting never cancels
    anything on timeout, so no notification can be lost to a timeout race."""

    def __init__(self) -> None:
        self._futures: set[asyncio.Future] = set()

    async def wait(self, timeout_s: float, *others: _Wakeup) -> bool:
        """True if notified (this one, or any of ``others``), False if ``timeout_s`` passed first."""
        future = asyncio.get_running_loop().create_future()
        wakeups = (self, *others)
        for w in wakeups:
            w._futures.add(future)
        try:
            done, _ = await asyncio.wait((future,), timeout=timeout_s)
        finally:
            for w in wakeups:
                w._futures.discard(future)
        return bool(done)

    def notify_all(self) -> None:
        for future in self._futures:
            if not future.done():
                future.set_result(None)
        self._futures.clear()

    def __len__(self) -> int:
        return len(self._futures)


class RolloutQueue:
    """Bounded FIFO of validated ``RolloutGroup``s, with a staleness filter on the way out. For
    the tasks of one event loop (not thread-safe, like every asyncio primitive).

    Invariants:

    * ``len(self) <= capacity`` always: the only append is in ``put``, directly after a
      ``len < capacity`` check with no ``await`` in between (asyncio cannot interleave there).
    * A batch never holds a group staler than ``max_staleness`` (counted from its finish):
      ``get_batch`` purges every stale group against the ``current_version`` it was given, and
      pops the batch right after that purge, again with no ``await`` in between.
    * Batches are taken in arrival order: no group waits behind one that arrived after it.
    * Nothing accepted is lost: a group leaves only in a delivered batch, as a counted stale drop
      (``dropped_stale``), or attached to a ``FutureGroupError``. A ``get_batch`` that times out
      or is cancelled has taken nothing (it pops all ``n_groups`` at once or none), and a put that
      times out was never accepted. ``close()`` leaves queued groups in place (``depth``).
    * ``current_version`` never decreases across ``get_batch`` calls (a ``ValueError`` otherwise).
      Hence a group older than ``current_version - max_staleness`` can never become fresh again,
      so ``put`` drops such a group on arrival (counted) instead of letting it take a slot.
    """

    def __init__(self, capacity: int, max_staleness: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, not {max_staleness}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._items: deque[RolloutGroup] = deque()
        self._not_full = _Wakeup()
        self._not_empty = _Wakeup()
        self._closed = False
        self._version: int | None = None  # the latest current_version given to get_batch
        self._puts = self._gets = self._batches = self._dropped_stale = 0
        self._put_timeouts = self._get_timeouts = 0
        self._blocked_put_s = 0.0
        self._hist: dict[int, int] = {}
        self._offered, self._trained, self._dropped = LengthTally(), LengthTally(), LengthTally()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def shrank(self) -> _Wakeup:
        """Notified whenever groups leave the queue (a batch taken, stale groups dropped)."""
        return self._not_full

    def stats(self) -> RolloutQueueStats:
        return RolloutQueueStats(
            self.capacity,
            self.max_staleness,
            len(self._items),
            self._puts,
            self._gets,
            self._batches,
            self._dropped_stale,
            dict(self._hist),
            self._blocked_put_s,
            self._put_timeouts,
            self._get_timeouts,
            offered_lengths=self._offered.hist(),
            trained_lengths=self._trained.hist(),
            dropped_lengths=self._dropped.hist(),
        )

    def close(self) -> None:
        """Idempotent. Every waiting and later ``put``/``get_batch`` raises ``QueueClosedError``."""
        self._closed = True
        self._not_full.notify_all()
        self._not_empty.notify_all()

    async def put(self, group: RolloutGroup, timeout_s: float) -> bool:
        """Validate and enqueue ``group``, waiting up to ``timeout_s`` while the queue is full.

        Returns True if accepted, False if dropped on arrival as already too stale (counted in
        ``dropped_stale``). Raises ``InvalidGroupError``, ``QueueTimeoutError``, ``QueueClosedError``.
        """
        _check_timeout(timeout_s)
        validate_group(group)  # refuse at the door, so nothing malformed ever reaches the trainer
        self._offered.add(group)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        blocked_since: float | None = None
        try:
            while True:
                self._raise_if_closed("put")
                if self._version is not None and self._version - group.finished_version > self.max_staleness:
                    self._dropped_stale += 1
                    self._dropped.add(group)
                    return False
                if len(self._items) < self.capacity:
                    self._items.append(group)
                    self._puts += 1
                    self._not_empty.notify_all()
                    return True
                if blocked_since is None:
                    blocked_since = loop.time()
                remaining = deadline - loop.time()
                if remaining <= 0 or not await self._not_full.wait(remaining):
                    self._put_timeouts += 1
                    raise QueueTimeoutError(
                        f"rollout queue put(prompt {group.prompt_id}): no free slot within {timeout_s:g} s "
                        f"(capacity {self.capacity}, depth {len(self._items)})"
                    )
        finally:
            if blocked_since is not None:
                self._blocked_put_s += loop.time() - blocked_since

    async def get_batch(self, n_groups: int, current_version: int, timeout_s: float) -> list[RolloutGroup]:
        """Exactly ``n_groups`` groups, in arrival order, each with
        ``0 <= current_version - group.finished_version <= max_staleness``.

        Stale groups met on the way are dropped and counted; waits (up to ``timeout_s`` in all)
        for enough fresh groups. Raises ``QueueTimeoutError`` (having taken nothing),
        ``QueueClosedError``, or ``FutureGroupError`` for a group newer than ``current_version``.
        """
        if not 1 <= n_groups <= self.capacity:
            # More than capacity could never be satisfied without taking groups out early.
            raise ValueError(f"n_groups must be in [1, capacity={self.capacity}], not {n_groups}")
        _check_timeout(timeout_s)
        if self._version is not None and current_version < self._version:
            raise ValueError(f"current_version went backwards: {current_version} after {self._version}")
        self._version = current_version
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            self._raise_if_closed("get_batch")
            self._purge(current_version)
            if len(self._items) >= n_groups:
                batch = [self._items.popleft() for _ in range(n_groups)]
                for g in batch:
                    self._trained.add(g)
                    s = current_version - g.finished_version
                    self._hist[s] = self._hist.get(s, 0) + 1
                self._gets += n_groups
                self._batches += 1
                self._not_full.notify_all()
                return batch
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self._not_empty.wait(remaining):
                self._get_timeouts += 1
                raise QueueTimeoutError(
                    f"rollout queue get_batch: {n_groups} groups with staleness <= {self.max_staleness} "
                    f"at version {current_version} not available within {timeout_s:g} s "
                    f"(have {len(self._items)}, dropped {self._dropped_stale} stale so far)"
                )

    def _purge(self, current_version: int) -> None:
        """Drop (and count) every stale group; take out and raise on a group from the future."""
        kept: deque[RolloutGroup] = deque()
        future: RolloutGroup | None = None
        for g in self._items:
            if g.finished_version > current_version and future is None:
                future = g
            elif current_version - g.finished_version > self.max_staleness:
                self._dropped_stale += 1
                self._dropped.add(g)
            else:
                kept.append(g)
        if len(kept) != len(self._items):
            self._items = kept
            self._not_full.notify_all()
        if future is not None:
            raise FutureGroupError(future, current_version)

    def _raise_if_closed(self, op: str) -> None:
        if self._closed:
            raise QueueClosedError(f"rollout queue is closed ({op})")


def _check_timeout(timeout_s: float) -> None:
    if not (timeout_s >= 0 and math.isfinite(timeout_s)):  # NaN fails both comparisons
        raise ValueError(f"timeout_s must be finite and >= 0, not {timeout_s!r}")
