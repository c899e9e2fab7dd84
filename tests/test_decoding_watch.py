"""`while_decoding` (driver/fleet/decoding.py): a sampler's stream is waited on for as long as the
sampler decodes, and given up once neither an item came nor its count of decoded tokens moved for
the deadline. In one process: the stream is an async generator, the sampler a stand-in for its
handle whose `stats()` answers with a count (the count a real sampler gives is tested on the
backends, tests/test_sampler.py and tests/test_vllm_actor.py; a frozen sampler process found by
it, tests/test_fault_tolerance.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest

from asyncrl.errors import CallTimeoutError
from asyncrl.rl.driver.fleet.decoding import while_decoding


class Sampler:
    """Stands in for a sampler's handle. ``decoding``: each `stats()` finds more tokens decoded
    than the last (progress between any two readings, however the loop is scheduled); else the
    count stands still. ``silent``: `stats()` never answers within its deadline."""

    name = "sampler0"

    def __init__(self, decoding: bool = False, silent: bool = False):
        self.decoding, self.silent = decoding, silent
        self.decoded, self.readings = 0, 0
        self._timeout_s = 0.0

    def with_timeout(self, timeout_s: float) -> Sampler:
        self._timeout_s = timeout_s
        return self

    async def stats(self) -> SimpleNamespace:
        self.readings += 1
        if self.silent:
            await asyncio.sleep(self._timeout_s)
            raise CallTimeoutError(self.name, "stats", self._timeout_s)
        self.decoded += self.decoding
        return SimpleNamespace(decoded=self.decoded)


class Stream:
    """A stream of ``items``, each after ``gap_s``; ``closed`` once its generator has ended,
    whichever way (a stream cancelled on the sampler ends so)."""

    def __init__(self, items: int, gap_s: float):
        self.items, self.gap_s, self.closed = items, gap_s, False

    async def __call__(self):
        try:
            for i in range(self.items):
                await asyncio.sleep(self.gap_s)
                yield i
            await asyncio.sleep(3600)  # then nothing more: as a sampler that stops
        finally:
            self.closed = True


async def _take(sampler: Sampler, stream: Stream, n: int, timeout_s: float) -> list[int]:
    got = []
    watched = while_decoding(sampler, stream(), timeout_s=timeout_s, what="rollouts")  # type: ignore[arg-type]
    async with contextlib.aclosing(watched):  # as the pump: the stream closed when it stops reading
        async for item in watched:
            got.append(item)
            if len(got) == n:
                break
    return got


async def test_items_slower_than_the_deadline_are_waited_for_while_tokens_are_decoded():
    """Two items 1 s apart, a 0.3 s deadline: the sampler decodes all the while, so both come."""
    sampler, stream = Sampler(decoding=True), Stream(items=2, gap_s=1.0)
    assert await _take(sampler, stream, 2, timeout_s=0.3) == [0, 1]
    assert sampler.readings >= 4 and stream.closed  # it read the count while it waited; the stream ended with it


async def test_a_sampler_that_decodes_nothing_is_given_up_within_its_deadline():
    """No item and a count that stands still: `CallTimeoutError` naming the sampler and the stream,
    once the deadline has passed and before two more readings could, and the stream is closed (the
    call cancelled on the sampler)."""
    sampler, stream = Sampler(), Stream(items=0, gap_s=0.0)
    start = time.monotonic()
    with pytest.raises(CallTimeoutError, match=r"'sampler0': rollouts\(\) got no reply within 0.4 s") as info:
        await _take(sampler, stream, 1, timeout_s=0.4)
    took = time.monotonic() - start
    assert 0.4 <= took < 0.4 + 2 * 0.1 + 1.0, took  # the deadline, two polls (timeout / 4), a loaded machine
    assert info.value.timeout_s == 0.4 and stream.closed


async def test_a_sampler_that_does_not_answer_is_given_up_too():
    """Its count cannot be read (a frozen process): no reading is progress."""
    sampler, stream = Sampler(silent=True), Stream(items=0, gap_s=0.0)
    with pytest.raises(CallTimeoutError):
        await _take(sampler, stream, 1, timeout_s=0.4)
    assert sampler.readings >= 2 and stream.closed


async def test_each_item_is_progress_where_no_count_moves():
    """A backend that cannot count (its `tokens_decoded` is 0): items that come within the
    deadline of each other keep the stream alive, however long it runs in all."""
    sampler, stream = Sampler(), Stream(items=4, gap_s=0.2)
    assert await _take(sampler, stream, 4, timeout_s=1.0) == [0, 1, 2, 3]


@pytest.mark.parametrize("error", [RuntimeError, TimeoutError])
async def test_the_end_of_the_stream_and_its_own_errors_come_through(error):
    """A timeout of the sampler's own (its wait for good weights) is not the watch's."""

    async def two():
        yield "a"
        yield "b"

    async def failing():
        yield "a"
        raise error("the sampler's own error")

    sampler = Sampler()
    assert [x async for x in while_decoding(sampler, two(), timeout_s=1.0, what="rollouts")] == ["a", "b"]  # type: ignore[arg-type]
    with pytest.raises(error, match="the sampler's own error") as info:
        async for _ in while_decoding(sampler, failing(), timeout_s=1.0, what="rollouts"):  # type: ignore[arg-type]
            pass
    assert not isinstance(info.value, CallTimeoutError)
