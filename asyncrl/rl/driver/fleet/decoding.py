"""`while_decoding`: a sampler's stream waited on for as long as the sampler decodes.

A sampler's next rollout group, or its next part of a held-out evaluation, comes when its
longest completion ends. At long completions that is minutes: 32k tokens of a 7B model, 16k on a
slower GPU or on the HF backend. A deadline on the item alone that such a group fits would leave
a stuck sampler unnoticed for as long, and one that finds a stuck sampler soon kills a sampler
that is only slow, again at each restart, until the run stops. So ``--run.generate_timeout_s``
bounds the time a sampler goes without progress: no item, and no token decoded. While the
driver waits for an item it reads the sampler's `SamplerStats.decoded` (tokens decoded, those of
requests still running included) every ``timeout_s / 4`` (at most `POLL_S`); the sampler is
stalled once that count has not moved, or not been read, for ``timeout_s``. A frozen process, or
an engine stuck in a kernel, is found as soon as before; a long completion is waited out.

What is not decoding is judged as before, by the items: an agent waiting on its tool, a weight
sync (which has its own deadline), a backend that cannot count (`SamplerBackend.tokens_decoded`
is 0 there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError
from asyncrl.rl.driver.fleet.handles import SamplerHandle
from asyncrl.runtime.timeouts import Deadline, expired, move_deadline, timeout

T = TypeVar("T")

POLL_S = 15.0
"""The longest between two readings of a sampler's count while an item is awaited."""

UNWATCHED_S = 1e9
"""The stream's own deadline on each item: none that matters (`while_decoding` is the deadline)."""


async def while_decoding(
    sampler: SamplerHandle, items: AsyncIterator[T], *, timeout_s: float, what: str
) -> AsyncGenerator[T, None]:
    """``items`` (a stream of ``sampler``'s, made with no deadline of its own: `UNWATCHED_S`), each
    awaited for as long as ``sampler`` decodes; once neither an item came nor its count of decoded
    tokens moved for ``timeout_s``, the stream is cancelled on the sampler and `CallTimeoutError`
    raised, naming ``what`` (the endpoint: "rollouts").

    Each item is awaited in the caller's task, under a deadline that a watcher task moves on
    whenever the count moves: an item already there is taken at once, as from the stream itself
    (a pump takes a batch's groups in one go; a task per item would let it see a batch half
    taken, and begin another)."""
    watch = _Watch(sampler, timeout_s, min(timeout_s / 4, POLL_S))
    watcher = asyncio.ensure_future(watch.run())
    iterator = aiter(items)
    try:
        while True:
            deadline = timeout(timeout_s)
            try:
                async with deadline:
                    watch.deadline = deadline
                    try:
                        item = await anext(iterator)
                    finally:
                        watch.deadline = None
            except StopAsyncIteration:
                return
            except (TimeoutError, asyncio.TimeoutError):  # the two differ on 3.10 (runtime/timeouts.py)
                if expired(deadline):  # its cancel, thrown into the stream, ended the call there
                    raise CallTimeoutError(sampler.name, what, timeout_s) from None
                raise  # the stream's own
            yield item
    finally:
        watcher.cancel()
        (watched,) = await asyncio.gather(watcher, return_exceptions=True)
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
        if isinstance(watched, Exception):
            raise watched  # a bug of the watch's own: never a silent fall back to a fixed deadline


class _Watch:
    """Reads ``sampler``'s count every ``poll_s`` while an item is awaited (``deadline`` set),
    and moves that wait's deadline to ``timeout_s`` from now each time the count has moved since
    the reading before."""

    def __init__(self, sampler: SamplerHandle, timeout_s: float, poll_s: float):
        self.sampler, self.timeout_s, self.poll_s = sampler, timeout_s, poll_s
        self.deadline: Deadline | None = None  # the entered `timeout` of the wait under way; None between items
        self.count: int | None = None  # the sampler's decoded tokens at the last reading

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.poll_s)
            if self.deadline is None:
                continue
            reading = await _decoded(self.sampler, self.poll_s)
            if reading is None:
                continue
            moved, self.count = self.count is not None and reading != self.count, reading
            # Still waiting (this wait, or the next one's) and not run out: a deadline that ran
            # out is the stream's end, whatever came since.
            if moved and self.deadline is not None and not expired(self.deadline):
                move_deadline(self.deadline, loop.time() + self.timeout_s)


async def _decoded(sampler: SamplerHandle, timeout_s: float) -> int | None:
    """The sampler's count of decoded tokens; None where it did not answer in ``timeout_s`` or
    could not (its death fails the stream too, and is judged there)."""
    try:
        return (await sampler.with_timeout(timeout_s).stats()).decoded
    except (CallTimeoutError, ActorDiedError, RemoteError):
        return None
