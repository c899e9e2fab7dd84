"""Staged syncs (``comm/staged.py``, issue 46 item 3): a receiver that joins each sync on the
sender's notice, on a thread, into a copy of its own, while its weights stay as they were until
`apply`. Members are threads over a real store and gloo (`run_gloo_members`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncrl.comm.errors import WeightSyncError
from asyncrl.comm.staged import StagedReceiver
from asyncrl.comm.sync_notice import NoticeWatch
from asyncrl.comm.weights import WeightReceiver, WeightSender
from sync_actors import digest, run_gloo_members


def master_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(40, 9, generator=g), "big": torch.randn(3000, generator=g), "steps": torch.arange(5)}


def held_state(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.zeros(v.shape, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in master.items()
    }


def wire(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.bfloat16() if v.is_floating_point() else v.clone() for k, v in master.items()}


def update(master: dict[str, torch.Tensor], step: int) -> None:
    with torch.no_grad():
        master["w"].view(-1)[step % 360] += 1.0
        master["big"][::7] += 0.25
        master["steps"] += 1


def stager(receiver: WeightReceiver, group, targets, first: int) -> StagedReceiver:
    return StagedReceiver(receiver, targets, NoticeWatch(group, receiver.setup_calls), first=first)


def test_the_sender_never_waits_for_the_reader_whose_weights_change_only_at_apply_then_as_deltas():
    """Rank 1 stages; rank 2 receives as before (the sender serves both in one group). Rank 1's
    own thread calls nothing until the sender's sync returned: the sync went through without it,
    its weights still held the previous version, and `apply` brought the new one whole."""
    master = master_state()
    staged_held, plain_held = held_state(master), held_state(master)
    sent = [threading.Event() for _ in range(6)]
    applied = [threading.Event() for _ in range(6)]
    seen: dict[int, tuple[str, str, str]] = {}  # version: (sent, staged before apply, staged after)
    stats = {}

    def member(rank, group, comm):
        if rank == 0:
            sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16, delta=True)
            assert sender.notices is not None  # rank 1 asked for them at set-up
            for version in range(6):
                if version:
                    update(master, version)
                stats[version] = sender.send(version)
                seen[version] = (digest(wire(master)), "", "")
                sent[version].set()
                assert applied[version].wait(20)  # the next sync begins once this one was applied
            return
        receiver = WeightReceiver.create(comm, group, timeout_s=20, notices=rank == 1)
        if rank == 2:
            for version in range(6):
                receiver.receive(version, plain_held)
            return
        receiver.receive(0, staged_held)  # the first sync as vLLM's loader takes it, in the call
        assert sent[0].wait(20)
        applied[0].set()
        staging = stager(receiver, group, staged_held, first=1)
        try:
            for version in range(1, 6):
                assert sent[version].wait(20), f"sync v{version} waited for its staged receiver's reader"
                before = digest(staged_held)
                got = staging.apply(version, 20)
                assert got.version == version and got.seconds > 0 and got.copy_s > 0
                seen[version] = (seen[version][0], before, digest(staged_held))
                stats[(1, version)] = got
                applied[version].set()
        finally:
            staging.stop()

    run_gloo_members(3, member, timeout_s=90)
    for version in range(1, 6):
        wanted, before, after = seen[version]
        assert before == seen[version - 1][0], f"v{version} was written into the weights before apply"
        assert after == wanted, f"v{version} applied differs from what was sent"
    assert digest(plain_held) == seen[5][0]
    assert not stats[1].delta and all(stats[v].delta for v in (2, 3, 4, 5))  # the staging copy is the base
    assert all(stats[(1, v)].delta == stats[v].delta for v in range(1, 6))


def test_a_failed_staged_sync_raises_at_apply_and_leaves_the_weights_as_they_were():
    master = master_state()
    held = held_state(master)
    done = [threading.Event(), threading.Event()]
    applied = threading.Event()
    outcome: dict[str, object] = {}

    def member(rank, group, comm):
        if rank == 0:
            sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16)
            sender.send(0)
            sender.send(5)
            done[0].set()
            assert applied.wait(20)
            with pytest.raises(WeightSyncError, match="not newer"):
                sender.send(3)  # refused by the sender itself, after its notice went out
            done[1].set()
            return
        receiver = WeightReceiver.create(comm, group, timeout_s=20, notices=True)
        receiver.receive(0, held)
        staging = stager(receiver, group, held, first=1)
        try:
            assert done[0].wait(20)
            staging.apply(5, 20)
            outcome["v5"] = digest(held)
            applied.set()
            assert done[1].wait(20)
            with pytest.raises(WeightSyncError, match="refused weight sync v3|not newer"):
                staging.apply(3, 20)
            outcome["after"] = digest(held)
            with pytest.raises(WeightSyncError, match="sync v9 was never announced within 0.2 s"):
                staging.apply(9, 0.2)
        finally:
            staging.stop()

    run_gloo_members(2, member, timeout_s=60)
    assert outcome["after"] == outcome["v5"] == digest(wire(master))


def test_a_staged_sync_overwritten_before_apply_fails_and_the_newer_one_applies():
    master = master_state()
    held = held_state(master)
    both_sent = threading.Event()
    result: dict[str, str] = {}

    def member(rank, group, comm):
        if rank == 0:
            sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16)
            for version in range(3):
                update(master, version)
                sender.send(version)
            result["sent"] = digest(wire(master))
            both_sent.set()
            return
        receiver = WeightReceiver.create(comm, group, timeout_s=20, notices=True)
        receiver.receive(0, held)
        staging = stager(receiver, group, held, first=1)
        try:
            assert both_sent.wait(20)
            with pytest.raises(WeightSyncError, match="v1 was overwritten by v2 unapplied"):
                staging.apply(1, 20)
            staging.apply(2, 20)
            result["held"] = digest(held)
        finally:
            staging.stop()

    run_gloo_members(2, member, timeout_s=60)
    assert result["held"] == result["sent"]


def test_stop_wakes_a_stager_waiting_for_a_notice_at_once():
    ended: dict[str, object] = {}

    def member(rank, group, comm):
        master = master_state()
        if rank == 0:
            WeightSender.create(comm, group, master, bucket_bytes=4096)
            group.barrier(20)  # the stager below is waiting for a notice
            group.barrier(20)
            return
        receiver = WeightReceiver.create(comm, group, timeout_s=20, notices=True)
        staging = stager(receiver, group, master, first=0)
        group.barrier(20)
        start = time.monotonic()
        staging.stop()
        ended["stop_s"] = time.monotonic() - start
        ended["alive"] = staging._thread.is_alive()
        with pytest.raises(WeightSyncError, match="sync v0 cannot be applied: staging was stopped"):
            staging.apply(0, 10)
        group.barrier(20)

    run_gloo_members(2, member, timeout_s=60)
    assert ended["alive"] is False and ended["stop_s"] < 1.0
