"""`asyncrl.comm.tiered`: a group whose members share GPUs, joined in tiers (between GPUs, within one).

On the CPU both tiers are gloo and the "GPUs" are names, so what is checked here is the tiering: who
leads, which ranks each broadcast reaches through which tier, the votes over the whole group, and a
failure in one tier closing every tier. The real tiers (NCCL and CUDA IPC) run in test_gpu_comm.py.
Members run on threads of this process, each with its own store client, as in test_comm_join.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncrl.comm.communicator import ReduceOp
from asyncrl.comm.errors import CollectiveError
from asyncrl.comm.gloo import GlooCommunicator
from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
from asyncrl.comm.tiered import TieredCommunicator

HOST = "127.0.0.1"
PLACES = ["gpu-a", "gpu-b", "gpu-b", "gpu-c", "gpu-c", "gpu-c"]
"""Rank 0 alone (the trainer), a GPU of two engines, one of three."""


def gloo_tier(group, device, timeout_s):
    return GlooCommunicator.create(group, timeout_s)


def on_every_rank(places: list[str], body, timeout_s: float = 30.0) -> list:
    """Form the group, make each rank's tiered communicator, run ``body(rank, comm)`` on each rank's
    thread at once; return each rank's result (or raise the first rank's exception)."""
    world = len(places)
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    results: list = [None] * world

    def member(rank: int) -> None:
        comm = None
        try:
            group = StoreGroup.create(HOST, port, rank, world, timeout_s, listener=listener if rank == 0 else None)
            comm = TieredCommunicator.create(
                group, places, torch.device("cpu"), timeout_s, across=gloo_tier, within=gloo_tier
            )
            results[rank] = body(rank, comm)
        except BaseException as exc:  # noqa: BLE001  (raised below, in the test thread)
            results[rank] = exc
        finally:
            if comm is not None:
                comm.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 15)
    assert not any(t.is_alive() for t in threads), "a member hung"
    return results


def test_each_broadcast_reaches_every_rank_whoever_sends_it():
    sources = [0, 2, 3, 5]  # alone on its GPU, a mate, a leader with mates, a mate of a leader's

    def body(rank: int, comm: TieredCommunicator):
        got = []
        for src in sources:
            sent = torch.arange(1000, dtype=torch.float32) * (src + 1)
            tensor = sent.clone() if rank == src else torch.zeros(1000)
            comm.broadcast(tensor, src, timeout_s=20).wait(20)
            got.append(bool(torch.equal(tensor, sent)))
        return comm.tiers, got

    results = on_every_rank(PLACES, body)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert [tiers for tiers, _ in results] == [
        ("across",),
        ("across", "within"),
        ("within",),
        ("across", "within"),
        ("within",),
        ("within",),
    ]
    assert all(all(got) for _, got in results), results


def test_all_reduce_counts_every_rank_once():
    def body(rank: int, comm: TieredCommunicator):
        votes = torch.tensor([rank + 1, 1], dtype=torch.int64)
        comm.all_reduce(votes, ReduceOp.SUM, timeout_s=20).wait(20)
        most = torch.tensor([rank], dtype=torch.int64)
        comm.all_reduce(most, ReduceOp.MAX, timeout_s=20).wait(20)
        return votes.tolist(), most.item()

    results = on_every_rank(PLACES, body)
    assert results == [([21, 6], 5)] * 6, results


def test_one_gpu_holds_everyone_the_within_tier_alone():
    def body(rank: int, comm: TieredCommunicator):
        tensor = torch.full((7,), 3.5) if rank == 1 else torch.zeros(7)
        comm.broadcast(tensor, 1, timeout_s=20).wait(20)
        return comm.tiers, tensor.tolist()

    assert on_every_rank(["g"] * 3, body) == [(("within",), [3.5] * 7)] * 3


def test_a_member_that_never_comes_fails_every_tier_in_bounded_time():
    """Rank 4 (a mate on gpu-c) skips the broadcast: its GPU's leader cannot pass the bytes on, so
    the leader fails within the deadline and closes every tier of its own."""

    def body(rank: int, comm: TieredCommunicator):
        if rank == 4:
            return "skipped", comm.closed
        start = time.monotonic()
        tensor = torch.ones(100) if rank == 0 else torch.zeros(100)
        try:
            comm.broadcast(tensor, 0, timeout_s=2.0).wait(2.0)
            outcome = "completed"
        except CollectiveError:
            outcome = "failed"
        return outcome, comm.closed, time.monotonic() - start

    results = on_every_rank(PLACES, body)
    assert results[4] == ("skipped", False)
    leader_c = results[3]
    assert leader_c[0] == "failed" and leader_c[1] and leader_c[2] < 10, leader_c
    # Rank 5 may or may not have its bytes: gloo's tree reached it without rank 4 (CUDA IPC's verdict
    # fails every member of the tier). Either way it answered, in bounded time.
    assert results[5][0] in ("completed", "failed") and results[5][2] < 10, results[5]
    # The ranks of other GPUs got their bytes before gpu-c's failure: their broadcast completed.
    assert [results[r][0] for r in (0, 1, 2)] == ["completed"] * 3, results


def test_places_must_name_every_rank():
    group = type("G", (), {"world_size": 3, "rank": 0})()
    with pytest.raises(ValueError, match="3 places for a group of 3|2 places for a group of 3"):
        TieredCommunicator.create(group, ["a", "b"], torch.device("cpu"), 1.0, across=gloo_tier, within=gloo_tier)
