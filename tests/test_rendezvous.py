"""The TCPStore rendezvous: joining, store-side collectives, and every way of not meeting, each
reported with the ranks involved and within its timeout. Members run on threads of this process
(each with its own real TCPStore client); the cross-process cases are in test_weight_sync.py."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest

from asyncrl.comm.errors import RendezvousError, RendezvousTimeoutError
from asyncrl.comm.rendezvous import StoreGroup, join_all, reserve_listener

HOST = "127.0.0.1"


def run_members(n, fn, *, timeout_s=10.0, world_size=None, generation_of=lambda r: 0):
    """Run ``fn(group)`` on ``n`` members concurrently; return {rank: result or exception}."""
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    results = {}
    groups = []

    def member(rank):
        try:
            group = StoreGroup.create(
                HOST,
                port,
                rank,
                world_size or n,
                timeout_s,
                generation=generation_of(rank),
                listener=listener if rank == 0 else None,
            )
            groups.append(group)
            results[rank] = fn(group)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a member hung"
    # Close only now: rank 0's store server goes with its group, and a member that has passed the
    # last barrier may not have read the server's answer yet (CI saw "lost the store" that way).
    for group in groups:
        group.close()
    return results


class Point(msgspec.Struct):
    x: int
    label: str


def test_store_collectives_deliver_typed_objects_to_every_member():
    def body(group):
        group.barrier()
        got = group.broadcast_obj(Point(3, "from 2") if group.rank == 2 else None, src=2, type=Point)
        everyone = group.all_gather_obj({"rank": group.rank}, type=dict[str, int])
        group.barrier()
        return got, everyone, group.member_hosts, group.label

    results = run_members(3, body)
    for rank in range(3):
        got, everyone, hosts, label = results[rank]
        assert got == Point(3, "from 2")
        assert everyone == [{"rank": r} for r in range(3)]
        assert hosts == [HOST] * 3 and label == "weights/g0"


def test_typed_decode_refuses_a_wrong_object():
    results = run_members(2, lambda g: g.broadcast_obj("not a point", src=0, type=Point))
    for rank in range(2):
        assert isinstance(results[rank], msgspec.ValidationError)


def test_missing_member_is_named_at_join_and_at_barrier():
    start = time.monotonic()
    results = run_members(2, lambda g: None, world_size=4, timeout_s=1.0)
    assert time.monotonic() - start < 6
    for rank in range(2):
        assert isinstance(results[rank], RendezvousTimeoutError)
        assert results[rank].missing == [2, 3], results[rank]

    results = run_members(3, lambda g: g.barrier(timeout_s=1.0) if g.rank != 1 else "skipped")
    assert results[1] == "skipped"
    for rank in (0, 2):
        assert isinstance(results[rank], RendezvousTimeoutError) and results[rank].missing == [1]


def test_no_store_host_is_reported_as_rank_0_missing():
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    listener.close()  # nobody listens there now
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as info:
        StoreGroup.create(HOST, port, 1, 2, timeout_s=1.0)
    assert info.value.missing == [0] and time.monotonic() - start < 8


def test_a_port_in_use_fails_at_once():
    holder = reserve_listener(HOST)
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousError, match="port in use"):
            StoreGroup.create(HOST, holder.getsockname()[1], 0, 2, timeout_s=30)
        assert time.monotonic() - start < 1
    finally:
        holder.close()


def test_members_of_another_generation_never_meet():
    # rank 0 hosts generation 1; rank 1 is a stale member of generation 0 at the same address
    results = run_members(2, lambda g: None, timeout_s=1.0, generation_of=lambda r: 1 if r == 0 else 0)
    assert isinstance(results[0], RendezvousTimeoutError) and results[0].missing == [1]
    assert isinstance(results[1], RendezvousTimeoutError) and results[1].missing == [0]


def test_bad_arguments():
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="not in a world"):
            StoreGroup.create(HOST, 1, rank, world)
    with pytest.raises(ValueError, match="timeout_s"):
        StoreGroup.create(HOST, 1, 0, 1, timeout_s=0)
    with pytest.raises(ValueError, match="group name"):
        StoreGroup.create(HOST, 1, 0, 1, name="a/b")


def test_a_group_of_one_works_and_close_is_idempotent():
    group = StoreGroup.create(HOST, 0, 0, 1, timeout_s=5)
    assert group.port > 0
    group.barrier()
    assert group.all_gather_obj(7) == [7]
    group.close()
    group.close()
    with pytest.raises(RendezvousError, match="closed"):
        group.barrier()


async def test_join_all_names_each_failed_member_and_cancels_the_slow_ones():
    async def ok():
        return "ok"

    async def fails():
        raise ValueError("no such device")

    async def hangs():
        await asyncio.sleep(60)

    assert await join_all([ok(), ok()], timeout_s=1) == ["ok", "ok"]
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        await join_all([ok(), fails(), hangs()], timeout_s=0.5)
    assert time.monotonic() - start < 2
    text = str(info.value)
    assert (
        "2 of 3 members" in text and "member 1: no such device" in text and "member 2: no answer within 0.5 s" in text
    )


def test_one_verdict_names_the_missing_member_whatever_each_members_deadline():
    """Members start their clocks at different moments (a loaded machine adds seconds). Rank 0,
    the store's host, gives up first here and drops its store the moment it has failed; rank 1,
    whose own deadline is far away, must still learn from it who was missing (not that the store
    vanished), at once; and rank 2, arriving after the verdict, is told at once that it is late."""
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    outcome: dict[int, tuple[str, list[int], float]] = {}
    start = time.monotonic()

    def member(rank: int, timeout_s: float) -> None:
        try:
            StoreGroup.create(HOST, port, rank, 3, timeout_s, listener=listener if rank == 0 else None)
            outcome[rank] = ("joined", [], time.monotonic() - start)
        except RendezvousError as exc:
            outcome[rank] = (type(exc).__name__, getattr(exc, "missing", []), time.monotonic() - start)
            del exc  # with its traceback goes rank 0's store: its server stops here

    host = threading.Thread(target=member, args=(0, 1.0))
    other = threading.Thread(target=member, args=(1, 30.0))
    host.start()
    other.start()
    host.join(15)
    other.join(15)
    assert not host.is_alive() and not other.is_alive()
    for rank in (0, 1):
        kind, missing, took = outcome[rank]
        assert kind == "RendezvousTimeoutError" and missing == [2], outcome
        assert took < 10, outcome  # rank 1 learnt it from rank 0's verdict, not its own 30 s


def test_a_member_that_arrives_after_the_verdict_is_told_at_once():
    results = {}
    holders = []  # keeps the failed members' stores (and rank 0's server) up for the late one
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]

    def member(rank: int, timeout_s: float) -> None:
        try:
            StoreGroup.create(HOST, port, rank, 3, timeout_s, listener=listener if rank == 0 else None)
        except RendezvousError as exc:
            holders.append(exc)
            results[rank] = exc

    early = [threading.Thread(target=member, args=(r, 1.0)) for r in (0, 1)]
    for t in early:
        t.start()
    for t in early:
        t.join(15)
    assert all(isinstance(results[r], RendezvousTimeoutError) and results[r].missing == [2] for r in (0, 1)), results
    start = time.monotonic()
    member(2, 30.0)
    assert isinstance(results[2], RendezvousTimeoutError) and results[2].missing == [2], results[2]
    assert time.monotonic() - start < 5


def test_a_barrier_verdict_is_the_same_on_every_member():
    # rank 1's deadline passes long before rank 0's: rank 0 hears the verdict from rank 1's
    def body(group):
        if group.rank == 2:
            return "skipped"
        start = time.monotonic()
        try:
            group.barrier(timeout_s=1.0 if group.rank == 1 else 30.0)
        except RendezvousTimeoutError as exc:
            return exc.missing, time.monotonic() - start
        return "passed"

    results = run_members(3, body, timeout_s=10.0)
    for rank in (0, 1):
        missing, took = results[rank]
        assert missing == [2] and took < 8, results
