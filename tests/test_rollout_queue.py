"""RolloutGroup validation and the RolloutQueue: staleness filter, backpressure, deadlines, close."""

from __future__ import annotations

import asyncio
import math
import time

import msgspec
import pytest

from asyncrl.rl.driver.queue import FutureGroupError, QueueClosedError, QueueTimeoutError, RolloutQueue
from asyncrl.rl.rollout import InvalidGroupError, RolloutGroup, VersionSpan, validate_group

LONG_S = 10.0  # a deadline no passing test gets near: waits here end by events, not by time


def group(prompt_id: int, version: int, n: int = 2) -> RolloutGroup:
    return RolloutGroup(
        prompt_id=prompt_id,
        prompt_ids=[1, 2, 3],
        completion_ids=[[4, 5]] * n,
        behaviour_logprobs=[[-0.5, -1.0]] * n,
        rewards=[float(i) for i in range(n)],
        version=version,
    )


async def settle(rounds: int = 5) -> None:
    """Let every ready task run a few steps (no wall-clock waiting)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


# --- RolloutGroup ------------------------------------------------------------------------------


def test_group_roundtrips_msgpack_as_array():
    g = RolloutGroup(7, [1], [[2, 3]], [[-0.1, -0.2]], [1.0], 4, sampler="s0", generate_s=0.5)
    data = msgspec.msgpack.encode(g)
    # array_like: fields by position (msgspec writes trailing defaults too: omit_defaults does not
    # apply to array-like structs), and a shorter array from an older sender takes the defaults.
    assert msgspec.msgpack.decode(data) == [
        7,
        [1],
        [[2, 3]],
        [[-0.1, -0.2]],
        [1.0],
        4,
        "s0",
        0.5,
        0.0,
        "",
        [],
        [],
        {},
        [],
        0,
        [],
        [],
        [],
        -1,
    ]
    assert msgspec.msgpack.decode(data, type=RolloutGroup) == g
    short = msgspec.msgpack.encode([7, [1], [[2, 3]], [[-0.1, -0.2]], [1.0], 4])
    assert msgspec.msgpack.decode(short, type=RolloutGroup) == msgspec.structs.replace(g, sampler="", generate_s=0.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode([7, [1], [[2, 3]], [[-0.1, -0.2]], ["x"], 4]), type=RolloutGroup)


def _with(**changes) -> RolloutGroup:
    return msgspec.structs.replace(group(1, 0, n=2), **changes)


@pytest.mark.parametrize(
    "bad, words",
    [
        (_with(completion_ids=[], behaviour_logprobs=[], rewards=[]), "no completions"),
        (_with(prompt_ids=[]), "prompt_ids is empty"),
        (_with(version=-1), "version -1"),
        (_with(behaviour_logprobs=[[-0.5, -1.0]]), "1 behaviour_logprobs lists for 2 completions"),
        (_with(rewards=[1.0]), "1 rewards for 2 completions"),
        (_with(behaviour_logprobs=[[-0.5, -1.0], [-0.5]]), "completion 1 has 2 token ids but 1 behaviour log-probs"),
        (_with(rewards=[0.0, math.nan]), "reward 1 is nan"),
        (_with(rewards=[math.inf, 0.0]), "reward 0 is inf"),
        (_with(action_mask=[[1, 1]]), "1 action masks for 2 completions"),
        (_with(action_mask=[[1, 0], [1]]), "completion 1 has 2 token ids but an action mask of 1"),
        (_with(action_mask=[[1, 0], [2, 1]]), "values other than 0 and 1"),
        (_with(correct=[True]), "1 correct flags for 2 completions"),
        (_with(version_spans=[[VersionSpan(0, 0)]]), "1 version_spans lists for 2 completions"),
        (_with(version_spans=[[VersionSpan(1, 0)], []]), "first version span starts at 1"),
        (_with(version=1, version_spans=[[VersionSpan(0, 0)], []]), "tokens of version 0, older than the group's 1"),
        (_with(version_spans=[[VersionSpan(0, 1), VersionSpan(1, 0)], []]), "out of order"),
        (_with(version_spans=[[VersionSpan(0, 0), VersionSpan(2, 1)], []]), "out of order"),
        (_with(delivered_version=0, version_spans=[[VersionSpan(0, 0), VersionSpan(1, 1)], []]), "delivered under"),
    ],
)
def test_validate_group_refuses_each_bad_shape(bad, words):
    with pytest.raises(InvalidGroupError, match=words) as info:
        validate_group(bad)
    assert isinstance(info.value, ValueError) and info.value.prompt_id == 1


async def test_token_versions_expand_the_spans():
    g = _with(version_spans=[[VersionSpan(0, 0), VersionSpan(1, 2)], []])
    validate_group(g)
    assert g.token_versions(0) == [0, 2] and g.token_versions(1) == [0, 0] and g.newest_version == 2
    assert group(1, 3).token_versions(0) == [3, 3] and group(1, 3).newest_version == 3


async def test_put_refuses_an_invalid_group():
    q = RolloutQueue(capacity=2, max_staleness=1)
    with pytest.raises(InvalidGroupError):
        await q.put(_with(rewards=[math.nan, 0.0]), timeout_s=LONG_S)
    assert len(q) == 0 and q.stats().puts == 0


# --- staleness ---------------------------------------------------------------------------------


async def test_stale_groups_are_dropped_counted_and_never_delivered():
    q = RolloutQueue(capacity=8, max_staleness=1)
    for pid, version in enumerate([0, 1, 2, 0, 2, 1]):
        assert await q.put(group(pid, version), timeout_s=LONG_S)
    batch = await q.get_batch(3, current_version=2, timeout_s=LONG_S)
    # versions 0 (prompts 0 and 3) have staleness 2 > 1: dropped; the rest in FIFO order.
    assert [g.prompt_id for g in batch] == [1, 2, 4]
    s = q.stats()
    assert (s.dropped_stale, s.puts, s.gets, s.batches, s.depth) == (2, 6, 3, 1, 1)
    assert s.staleness_hist == {1: 1, 0: 2}


async def test_a_group_that_spanned_versions_is_as_stale_as_its_newest_token():
    """A long completion begun at version 0 and finished under version 3 sat finished for no
    version at all: it is fresh at version 3, however old its first tokens are."""
    q = RolloutQueue(capacity=4, max_staleness=1)
    long = _with(version_spans=[[VersionSpan(0, 0), VersionSpan(1, 3)], [VersionSpan(0, 0)]])
    assert await q.put(long, timeout_s=LONG_S) and await q.put(group(2, 0), timeout_s=LONG_S)
    [taken] = await q.get_batch(1, current_version=3, timeout_s=LONG_S)
    assert taken is long and q.stats().dropped_stale == 1 and q.stats().staleness_hist == {0: 1}
    late = _with(prompt_id=3, delivered_version=3)  # done early in a batch that ran on until version 3
    assert late.finished_version == 3 and await q.put(late, timeout_s=LONG_S)
    assert [g.prompt_id for g in await q.get_batch(1, current_version=4, timeout_s=LONG_S)] == [3]
    with pytest.raises(FutureGroupError):  # a token of a version the trainer has not made: a bug upstream
        await q.put(_with(version=3, version_spans=[[VersionSpan(0, 3), VersionSpan(1, 5)], []]), timeout_s=LONG_S)
        await q.get_batch(1, current_version=4, timeout_s=LONG_S)


async def test_get_batch_waits_for_enough_fresh_groups():
    q = RolloutQueue(capacity=4, max_staleness=1)
    await q.put(group(0, 0), timeout_s=LONG_S)  # staleness 2 at version 2: will be dropped
    await q.put(group(1, 2), timeout_s=LONG_S)
    getter = asyncio.create_task(q.get_batch(2, current_version=2, timeout_s=LONG_S))
    await settle()
    assert not getter.done() and q.stats().dropped_stale == 1
    await q.put(group(2, 1), timeout_s=LONG_S)
    assert [g.prompt_id for g in await getter] == [1, 2]
    assert q.stats().staleness_hist == {0: 1, 1: 1}


async def test_put_drops_a_group_that_can_never_be_fresh_again():
    q = RolloutQueue(capacity=4, max_staleness=1)
    await q.put(group(0, 5), timeout_s=LONG_S)
    await q.get_batch(1, current_version=5, timeout_s=LONG_S)
    assert await q.put(group(1, 3), timeout_s=LONG_S) is False  # 5 - 3 > 1, and versions only grow
    assert await q.put(group(2, 4), timeout_s=LONG_S) is True
    assert (len(q), q.stats().dropped_stale, q.stats().puts) == (1, 1, 2)


async def test_current_version_must_not_go_backwards():
    q = RolloutQueue(capacity=2, max_staleness=1)
    await q.put(group(0, 3), timeout_s=LONG_S)
    await q.get_batch(1, current_version=3, timeout_s=LONG_S)
    with pytest.raises(ValueError, match="backwards"):
        await q.get_batch(1, current_version=2, timeout_s=LONG_S)


async def test_max_staleness_zero_is_the_synchronous_baseline():
    q = RolloutQueue(capacity=4, max_staleness=0)
    for pid, version in enumerate([2, 3, 3, 2]):
        await q.put(group(pid, version), timeout_s=LONG_S)
    batch = await q.get_batch(2, current_version=3, timeout_s=LONG_S)
    assert [(g.prompt_id, g.version) for g in batch] == [(1, 3), (2, 3)]
    assert q.stats().dropped_stale == 2 and q.stats().staleness_hist == {0: 2}
    # Sync loop: generate under v, train on exactly those, bump to v+1; a late v-group is refused.
    assert await q.put(group(9, 3), timeout_s=LONG_S) is True
    assert await q.put(group(10, 2), timeout_s=LONG_S) is False
    with pytest.raises(QueueTimeoutError):
        await q.get_batch(1, current_version=4, timeout_s=0.01)  # the v3 group is now stale too
    assert q.stats().dropped_stale == 4 and len(q) == 0


async def test_a_group_from_the_future_raises_and_is_handed_over():
    q = RolloutQueue(capacity=4, max_staleness=2)
    await q.put(group(0, 1), timeout_s=LONG_S)
    await q.put(group(1, 7), timeout_s=LONG_S)
    with pytest.raises(FutureGroupError, match="version 7, newer than the current version 1") as info:
        await q.get_batch(1, current_version=1, timeout_s=LONG_S)
    assert info.value.group.prompt_id == 1 and len(q) == 1
    assert [g.prompt_id for g in await q.get_batch(1, current_version=1, timeout_s=LONG_S)] == [0]


# --- backpressure and deadlines ----------------------------------------------------------------


async def test_put_on_a_full_queue_blocks_until_a_get_frees_a_slot():
    q = RolloutQueue(capacity=2, max_staleness=0)
    await q.put(group(0, 0), timeout_s=LONG_S)
    await q.put(group(1, 0), timeout_s=LONG_S)
    putter = asyncio.create_task(q.put(group(2, 0), timeout_s=LONG_S))
    await settle()
    assert not putter.done() and len(q) == 2
    assert [g.prompt_id for g in await q.get_batch(1, current_version=0, timeout_s=LONG_S)] == [0]
    assert await putter is True
    assert len(q) == 2 and q.stats().puts == 3 and q.stats().blocked_put_s > 0


async def test_depth_never_exceeds_capacity_with_many_producers():
    q = RolloutQueue(capacity=3, max_staleness=0)
    producers = [asyncio.create_task(q.put(group(i, 0), timeout_s=LONG_S)) for i in range(10)]
    got = []
    while len(got) < 10:
        await settle()
        assert len(q) <= 3
        got += await q.get_batch(1, current_version=0, timeout_s=LONG_S)
    await asyncio.gather(*producers)
    assert sorted(g.prompt_id for g in got) == list(range(10))  # nothing accepted was lost


async def test_put_deadline_raises_typed_error_in_bound():
    q = RolloutQueue(capacity=1, max_staleness=0)
    await q.put(group(0, 0), timeout_s=LONG_S)
    start = time.monotonic()
    with pytest.raises(
        QueueTimeoutError, match=r"put\(prompt 1\): no free slot within 0.05 s \(capacity 1, depth 1\)"
    ) as info:
        await q.put(group(1, 0), timeout_s=0.05)
    assert 0.04 <= time.monotonic() - start < 1.0
    assert isinstance(info.value, TimeoutError)
    assert (len(q), q.stats().puts, q.stats().put_timeouts) == (1, 1, 1)


async def test_get_deadline_raises_in_bound_and_takes_nothing():
    q = RolloutQueue(capacity=4, max_staleness=0)
    await q.put(group(0, 0), timeout_s=LONG_S)
    start = time.monotonic()
    with pytest.raises(QueueTimeoutError, match="get_batch: 2 groups with staleness <= 0 at version 0"):
        await q.get_batch(2, current_version=0, timeout_s=0.05)
    assert 0.04 <= time.monotonic() - start < 1.0
    assert len(q) == 1 and q.stats().get_timeouts == 1 and q.stats().gets == 0


async def test_cancelled_get_takes_nothing_and_leaves_no_waiter():
    q = RolloutQueue(capacity=4, max_staleness=0)
    await q.put(group(0, 0), timeout_s=LONG_S)
    getter = asyncio.create_task(q.get_batch(2, current_version=0, timeout_s=LONG_S))
    await settle()
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    assert len(q) == 1 and len(q._not_empty) == 0


async def test_close_wakes_every_waiter_with_a_typed_error():
    full = RolloutQueue(capacity=1, max_staleness=0)
    await full.put(group(0, 0), timeout_s=LONG_S)
    empty = RolloutQueue(capacity=2, max_staleness=0)
    waiters = [
        asyncio.create_task(full.put(group(1, 0), timeout_s=LONG_S)),
        asyncio.create_task(full.put(group(2, 0), timeout_s=LONG_S)),
        asyncio.create_task(empty.get_batch(2, current_version=0, timeout_s=LONG_S)),
    ]
    await settle()
    assert not any(w.done() for w in waiters)
    start = time.monotonic()
    full.close()
    empty.close()
    empty.close()  # idempotent
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 1.0)
    assert time.monotonic() - start < 0.5
    assert all(isinstance(r, QueueClosedError) for r in results), results
    with pytest.raises(QueueClosedError):
        await full.put(group(3, 0), timeout_s=LONG_S)
    with pytest.raises(QueueClosedError):
        await full.get_batch(1, current_version=0, timeout_s=LONG_S)
    assert full.closed and len(full) == 1  # what was accepted stays visible in depth


async def test_bad_arguments_are_refused():
    q = RolloutQueue(capacity=2, max_staleness=0)
    with pytest.raises(ValueError, match="n_groups"):
        await q.get_batch(3, current_version=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        await q.put(group(0, 0), timeout_s=-1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        await q.get_batch(1, current_version=0, timeout_s=math.nan)
    for capacity, max_staleness in [(0, 0), (1, -1)]:
        with pytest.raises(ValueError):
            RolloutQueue(capacity=capacity, max_staleness=max_staleness)
