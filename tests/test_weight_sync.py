"""Weight sync over gloo between real actor processes: bit-exact syncs, one communicator per
membership, typed failures in bounded time, and a rebuild after a member was SIGKILLed.

Each test starts its actors at once (`asyncio.gather`): a start is mostly torch's import, and on
the loaded 2-core machine three receivers started together were up in 4-5 s, one after another in 11 s."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncrl import RemoteError, Supervisor
from asyncrl.comm.address import SyncAddress
from asyncrl.comm.member import form_group
from asyncrl.comm.rendezvous import RendezvousError, join_all
from sync_actors import Receiver, Sender

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

HOST = "127.0.0.1"


async def sync(sender, receivers, version):
    results = await asyncio.gather(
        sender.step_and_send(version), *(r.receive(version) for r in receivers), return_exceptions=True
    )
    return results


@pytest.mark.parametrize("n_receivers", [1, 2, 3])
async def test_ten_syncs_are_bit_exact_on_one_communicator(n_receivers):
    async with Supervisor() as sup:
        sender, *receivers = await asyncio.gather(
            sup.spawn(Sender, 1, name="sender"),
            *(sup.spawn(Receiver, 100 + i, kwargs={"whole": i == 1}, name=f"recv{i}") for i in range(n_receivers)),
        )
        await form_group([sender, *receivers], HOST, timeout_s=30)
        buckets = await asyncio.gather(sender.setup(), *(r.setup() for r in receivers))
        # the 280 kB and 70 kB tensors are larger than a 64 KiB bucket: they go whole, unstaged; the
        # rest is bucketed
        assert len(set(buckets)) == 1 and buckets[0] == (1, 2)
        for version in range(10):
            sent, *got = await sync(sender, receivers, version)
            assert got == [sent] * n_receivers, f"v{version}: receivers differ from the sender"
        for member in [sender, *receivers]:
            assert (await member.sync_created()) == {"gloo": 1}


async def test_refusals_fail_every_member_and_the_group_keeps_working():
    async with Supervisor() as sup:
        sender, *receivers = await asyncio.gather(
            sup.spawn(Sender, 2, name="sender"), *(sup.spawn(Receiver, 7, name=f"recv{i}") for i in range(2))
        )
        await form_group([sender, *receivers], HOST, timeout_s=30)
        await asyncio.gather(sender.setup(), *(r.setup() for r in receivers))
        sent, *got = await sync(sender, receivers, 5)
        assert got == [sent, sent]

        # Wrong version order: one receiver is asked for an older version than it holds.
        start = time.monotonic()
        results = await asyncio.gather(
            sender.step_and_send(6), receivers[0].receive(6), receivers[1].receive(4), return_exceptions=True
        )
        assert all(isinstance(r, RemoteError) and r.remote_type == "WeightSyncError" for r in results), results
        assert "not newer than the last synced v5" in str(results[2])
        assert "disagree on the version" in str(results[0]) or "refused" in str(results[0])
        assert time.monotonic() - start < 10

        # The refusal happened before any byte moved: the same communicator syncs on.
        sent, *got = await sync(sender, receivers, 7)
        assert got == [sent, sent]
        assert (await sender.sync_created()) == {"gloo": 1}


async def test_layout_mismatch_fails_set_up_on_every_member():
    async with Supervisor() as sup:
        sender, good, bad = await asyncio.gather(
            sup.spawn(Sender, 1, name="sender"),
            sup.spawn(Receiver, 3, name="good"),
            sup.spawn(Receiver, 3, kwargs={"shape_of_w": (7, 33)}, name="bad"),
        )
        await form_group([sender, good, bad], HOST, timeout_s=30)
        results = await asyncio.gather(sender.setup(), good.setup(), bad.setup(), return_exceptions=True)
        for r in results:
            assert isinstance(r, RemoteError) and r.remote_type == "LayoutMismatchError", r
            assert "rank 2" in str(r) and "w.bf16" in str(r) and "[33, 7]" in str(r)


async def test_missing_member_is_named_within_the_timeout():
    async with Supervisor() as sup:
        sender, receiver = await asyncio.gather(sup.spawn(Sender, name="sender"), sup.spawn(Receiver, name="recv"))
        port = await sender.sync_listen(HOST)
        start = time.monotonic()
        # world size 3, but rank 2 is never started
        results = await asyncio.gather(
            sender.sync_join(SyncAddress(host=HOST, port=port, world_size=3, timeout_s=2.0), 0),
            receiver.sync_join(SyncAddress(host=HOST, port=port, world_size=3, timeout_s=2.0), 1),
            return_exceptions=True,
        )
        assert time.monotonic() - start < 15
        for r in results:
            assert isinstance(r, RemoteError) and r.remote_type == "RendezvousTimeoutError", r
            assert "rank(s) [2] did not arrive" in str(r)

        # Members that disagree on the world size: the driver's join_all names each one.
        port = await sender.sync_listen(HOST)
        with pytest.raises(RendezvousError) as info:
            await join_all(
                [
                    sender.sync_join(SyncAddress(host=HOST, port=port, world_size=2, timeout_s=2.0), 0),
                    receiver.sync_join(SyncAddress(host=HOST, port=port, world_size=3, timeout_s=2.0), 1),
                ],
                timeout_s=10,
            )
        assert "member 0" in str(info.value) and "joined with world size 3" in str(info.value)
        # rank 0 fails first and its store goes with it, so rank 1 stops waiting at once (or, on a
        # loaded machine, its own 2 s deadline comes first and names the rank it waited for)
        text = str(info.value)
        assert "member 1" in text
        assert "lost the store while waiting for joining" in text or "rank(s) [2] did not arrive" in text


async def test_sigkill_mid_sync_fails_survivors_in_bounded_time_then_rebuild():
    async with Supervisor() as sup:
        sender, steady, victim = await asyncio.gather(
            sup.spawn(Sender, 4, name="sender"),
            sup.spawn(Receiver, 5, name="steady"),
            sup.spawn(Receiver, 6, kwargs={"slow_s": 0.02}, name="victim"),
        )  # the victim takes ~1 s per sync
        await form_group([sender, steady, victim], HOST, timeout_s=30)
        await asyncio.gather(sender.setup(timeout_s=15), steady.setup(timeout_s=15), victim.setup(timeout_s=15))
        sent, *got = await sync(sender, [steady, victim], 0)
        assert got == [sent, sent]

        pending = asyncio.ensure_future(sync(sender, [steady, victim], 1))
        await asyncio.sleep(0.4)
        start = time.monotonic()
        os.kill(victim.info().pid, signal.SIGKILL)
        sent, got_steady, got_victim = await pending
        took = time.monotonic() - start
        assert took < 10, f"survivors took {took:.1f} s to fail"
        for r in (sent, got_steady):
            assert isinstance(r, RemoteError) and r.remote_type in ("CollectiveError", "CollectiveTimeoutError"), r
            assert "communicator aborted" in str(r)

        # Rebuild: survivors plus a replacement, next generation; each survivor creates exactly
        # one more communicator, and syncs are bit-exact again.
        replacement = await sup.spawn(Receiver, 8, name="replacement")
        await form_group([sender, steady, replacement], HOST, generation=1, timeout_s=30)
        await asyncio.gather(sender.setup(), steady.setup(), replacement.setup())
        for version in (2, 3):
            sent, *got = await sync(sender, [steady, replacement], version)
            assert got == [sent, sent]
        assert (await sender.sync_created()) == {"gloo": 2}
        assert (await steady.sync_created()) == {"gloo": 2}
        assert (await replacement.sync_created()) == {"gloo": 1}


async def test_sigkill_mid_delta_sync_fails_survivors_then_the_rebuilt_group_starts_with_a_full_sync():
    """Delta syncs (issue 50) keep the protocol: a member killed mid-delta fails it on every
    member in bounded time; the rebuilt group's first sync is full (nobody holds a base for it
    any more), the next ones are deltas again, and every sync is bit-exact."""
    async with Supervisor() as sup:
        sender, steady, victim = await asyncio.gather(
            sup.spawn(Sender, 4, name="sender"),
            sup.spawn(Receiver, 5, name="steady"),
            sup.spawn(Receiver, 6, kwargs={"slow_s": 0.02}, name="victim"),
        )  # the victim hands whole tensors to a slow consumer: ~1 s a sync, from the copy it keeps
        await form_group([sender, steady, victim], HOST, timeout_s=30)
        await asyncio.gather(sender.setup(delta=True), steady.setup(), victim.setup())
        for version in (0, 1):
            sent, *got = await asyncio.gather(
                sender.step_and_send(version, small=True), steady.receive(version), victim.receive(version)
            )
            assert got == [sent, sent]
        assert await sender.deltas() == 1  # v0 had no base: full; v1 a delta

        pending = asyncio.ensure_future(
            asyncio.gather(
                sender.step_and_send(2, small=True), steady.receive(2), victim.receive(2), return_exceptions=True
            )
        )
        await asyncio.sleep(0.4)
        start = time.monotonic()
        os.kill(victim.info().pid, signal.SIGKILL)
        sent, got_steady, _ = await pending
        assert time.monotonic() - start < 10
        for r in (sent, got_steady):
            assert isinstance(r, RemoteError) and r.remote_type in ("CollectiveError", "CollectiveTimeoutError"), r

        replacement = await sup.spawn(Receiver, 8, kwargs={"whole": True}, name="replacement")
        await form_group([sender, steady, replacement], HOST, generation=1, timeout_s=30)
        await asyncio.gather(sender.setup(delta=True), steady.setup(), replacement.setup())
        for version in (3, 4, 5):
            sent, *got = await asyncio.gather(
                sender.step_and_send(version, small=True), steady.receive(version), replacement.receive(version)
            )
            assert got == [sent, sent], f"v{version}"
        assert await sender.deltas() == 3  # v3 full (a new group: no base), v4 and v5 deltas


async def test_frozen_member_fails_the_sync_within_its_deadline():
    async with Supervisor() as sup:
        sender, frozen = await asyncio.gather(
            sup.spawn(Sender, 4, name="sender"), sup.spawn(Receiver, 5, name="frozen")
        )
        await form_group([sender, frozen], HOST, timeout_s=30)
        await asyncio.gather(sender.setup(timeout_s=3), frozen.setup(timeout_s=3))
        pid = frozen.info().pid
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RemoteError) as info:
                await sender.step_and_send(1)
            took = time.monotonic() - start
            assert info.value.remote_type == "CollectiveTimeoutError", info.value
            assert 2.5 < took < 10, took
        finally:
            os.kill(pid, signal.SIGCONT)


def test_wire_dtype_casts_fp32_master_weights_for_bf16_receivers_while_packing():
    """In-process (two threads, real store and gloo): the trainer keeps fp32, samplers hold bf16."""
    import threading

    import torch

    from asyncrl.comm.gloo import GlooCommunicator
    from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
    from asyncrl.comm.weights import WeightReceiver, WeightSender

    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    # "w" is larger than a bucket and cast, so it cannot go directly: it is chunked over buckets
    master = {"w": torch.randn(300, 7), "b": torch.randn(5), "steps": torch.arange(4)}
    replica = {
        "w": torch.zeros(300, 7, dtype=torch.bfloat16),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "steps": torch.zeros(4, dtype=torch.int64),
    }
    errors, layouts = [], []

    def member(rank):
        try:
            group = StoreGroup.create(HOST, port, rank, 2, 10, listener=listener if rank == 0 else None)
            comm = GlooCommunicator.create(group, 10)
            if rank == 0:
                sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16)
                layouts.append(sender.layout)
                sender.send(1)
            else:
                WeightReceiver.create(comm, group, expect=replica).receive(1, replica)
            comm.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert (
        layouts[0].direct == [] and sum(seg.tensor == 0 for b in layouts[0].buckets for seg in b) == 2
    )  # 4200 wire bytes
    assert torch.equal(replica["w"], master["w"].bfloat16()) and torch.equal(replica["b"], master["b"].bfloat16())
    assert torch.equal(replica["steps"], master["steps"])


def test_a_batched_consumer_takes_each_bucket_s_whole_tensors_at_once():
    """In-process (two threads, real store and gloo): ``batched=True`` hands the consumer one list
    a bucket (what vLLM's ``load_weights`` takes), each tensor whole and once, a tensor larger than
    a bucket after its last chunk, an empty one too; a consumer that raises fails the sync on both
    sides, and the next one goes through."""
    import threading

    import torch

    from asyncrl.comm.errors import WeightSyncError
    from asyncrl.comm.gloo import GlooCommunicator
    from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
    from asyncrl.comm.weights import WeightReceiver, WeightSender

    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    master = {
        "a": torch.randn(10, 7),
        "big": torch.randn(3000),
        "b": torch.randn(5),
        "none": torch.randn(0),
        "c": torch.randn(20, 3),
    }
    calls: list[list[tuple[str, torch.Tensor]]] = []
    outcomes: dict[int, list] = {0: [], 1: []}
    buckets = []

    def load(items):
        calls.append([(name, t.clone()) for name, t in items])
        if len(outcomes[1]) == 0 and len(calls) == 2:
            raise RuntimeError("the loader broke")

    def member(rank):
        group = StoreGroup.create(HOST, port, rank, 2, 10, listener=listener if rank == 0 else None)
        comm = GlooCommunicator.create(group, 10)
        try:
            if rank == 0:
                sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16)
                buckets.append(len(sender.layout.buckets))
            else:
                receiver = WeightReceiver.create(comm, group)
            for version in (1, 2):
                try:
                    outcomes[rank].append(
                        sender.send(version) if rank == 0 else receiver.receive(version, load, batched=True)
                    )
                except WeightSyncError as exc:
                    outcomes[rank].append(exc)
        finally:
            comm.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(isinstance(o[0], WeightSyncError) for o in outcomes.values()), outcomes  # v1: the loader broke
    assert "the loader broke" in str(outcomes[1][0]) and "rank 1" in str(outcomes[0][0])
    assert not any(isinstance(o[1], Exception) for o in outcomes.values()), outcomes  # v2 went through
    first_sync = 2  # v1's consumer was called up to its failure and not after it
    second = calls[first_sync:]
    assert 1 < len(second) <= buckets[0] + 1  # one call a bucket (and one for the empty tensor)
    names = [name for batch in second for name, _ in batch]
    assert sorted(names) == sorted(master)
    for batch in second:
        for name, t in batch:
            assert torch.equal(t, master[name].bfloat16()), name


def test_sync_stats_split_each_side_into_phases_that_add_up():
    """In-process (two threads, real store and gloo), with a receiver whose consumer is slow: each
    side's phases are present and non-negative, the votes and the move make up its total, copies
    and transfers fit in it (host time on CPU), and the slow consumer shows as the receiver's copy
    time and, on the sender, as the commit vote waiting for it."""
    import threading

    import torch

    from asyncrl.comm.gloo import GlooCommunicator
    from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
    from asyncrl.comm.weights import SyncStats, WeightReceiver, WeightSender

    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    master = {"w": torch.randn(300, 7), "b": torch.randn(5), "big": torch.randn(4000)}
    stats: dict[int, list[SyncStats]] = {0: [], 1: []}
    errors = []

    def slow(name, tensor):
        time.sleep(0.05)

    def member(rank):
        try:
            group = StoreGroup.create(HOST, port, rank, 2, 10, listener=listener if rank == 0 else None)
            comm = GlooCommunicator.create(group, 10)
            if rank == 0:
                sender = WeightSender.create(comm, group, master, bucket_bytes=4096, wire_dtype=torch.bfloat16)
                stats[0] += [sender.send(v) for v in range(2)]
            else:
                receiver = WeightReceiver.create(comm, group)
                stats[1] += [receiver.receive(v, slow) for v in range(2)]
            comm.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for rank in (0, 1):
        for s in stats[rank]:
            phases = [s.vote_s, s.move_s, s.commit_s, s.copy_s, s.transfer_s]
            assert all(p >= 0 for p in phases), s
            assert s.vote_s + s.move_s + s.commit_s <= s.seconds + 1e-6, s
            assert s.vote_s + s.move_s + s.commit_s >= 0.9 * s.seconds, s
            assert s.copy_s + s.transfer_s <= s.move_s + s.commit_s + 1e-6, s
            assert s.bytes == 2 * (300 * 7 + 5 + 4000) and s.buckets >= 2, s
    for got in stats[1]:  # three tensors, each 50 ms in the consumer
        assert got.copy_s >= 0.15 and got.copy_s <= got.seconds, got
    for sent in stats[0]:  # the sender waits for the consumer in the commit vote
        assert sent.commit_s >= 0.1 and sent.copy_s > 0 and sent.transfer_s > 0, sent


def test_gloos_own_operation_limit_is_reported_as_a_timeout():
    """gloo's per-operation limit (the communicator's timeout) can fire before the wait's deadline,
    as on a loaded machine: its "Timed out waiting ...ms" is a CollectiveTimeoutError (a peer is
    frozen or absent), not a CollectiveError (a peer failed), so the driver judges the members alike."""
    import threading

    import torch

    from asyncrl.comm.errors import CollectiveTimeoutError
    from asyncrl.comm.gloo import GlooCommunicator
    from asyncrl.comm.rendezvous import StoreGroup, reserve_listener

    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    outcome, peer_done, groups = [], threading.Event(), []

    def member(rank):
        group = StoreGroup.create(HOST, port, rank, 2, 10, listener=listener if rank == 0 else None)
        groups.append(group)
        comm = GlooCommunicator.create(group, 1.0)  # gloo's own limit: 1 s
        try:
            if rank == 0:  # rank 1 never takes part: gloo's limit fires long before the 20 s wait's
                start = time.monotonic()
                try:
                    comm.broadcast(torch.zeros(4), 0).wait(20.0)
                except Exception as exc:  # noqa: BLE001 - inspected below
                    outcome.append((exc, time.monotonic() - start))
                peer_done.set()
            else:
                peer_done.wait(30)
        finally:
            comm.close()

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    for group in groups:  # only now: rank 0's store server goes with its group
        group.close()
    ((exc, took),) = outcome
    assert isinstance(exc, CollectiveTimeoutError), repr(exc)
    assert took < 15, took


def test_the_transfer_hook_stalls_one_member_once_after_the_vote(monkeypatch, tmp_path):
    """The test-only hook (`comm/transfer_hook.py`) the GPU fault tests find a sync's transfer
    phase by: rank 1 claims the file in sync v1 (its pid, rank, version), after the first vote and
    before any bucket moved, so the stall shows in its move and in the sender's commit vote, not in
    the votes; the other syncs, and a second claim of the same sync, run as usual."""
    import json
    import threading

    import torch

    from asyncrl.comm.gloo import GlooCommunicator
    from asyncrl.comm.rendezvous import StoreGroup, reserve_listener
    from asyncrl.comm.transfer_hook import TRANSFER_HOOK_ENV, at_transfer_start
    from asyncrl.comm.weights import SyncStats, WeightReceiver, WeightSender

    claim = tmp_path / "claim.json"
    monkeypatch.setenv(TRANSFER_HOOK_ENV, f"1:1:1.0:{claim}")
    listener = reserve_listener(HOST)
    port = listener.getsockname()[1]
    master = {"w": torch.randn(300, 7), "b": torch.randn(5)}
    stats: dict[int, list[SyncStats]] = {0: [], 1: []}
    errors = []

    def member(rank):
        try:
            group = StoreGroup.create(HOST, port, rank, 2, 10, listener=listener if rank == 0 else None)
            comm = GlooCommunicator.create(group, 10)
            if rank == 0:
                sender = WeightSender.create(comm, group, master, bucket_bytes=4096)
                stats[0] += [sender.send(v) for v in range(3)]
            else:
                receiver = WeightReceiver.create(comm, group)
                into = {name: torch.empty_like(t) for name, t in master.items()}
                stats[1] += [receiver.receive(v, into) for v in range(3)]
            comm.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    said = json.loads(claim.read_text())
    assert (said["pid"], said["rank"], said["version"]) == (os.getpid(), 1, 1), said
    sent, got = stats[0], stats[1]
    assert got[1].move_s >= 1.0 and got[1].vote_s < 1.0, got[1]  # stalled after the vote
    assert sent[1].commit_s >= 0.9 and sent[1].vote_s < 1.0, sent[1]  # the sender waited in the commit
    assert all(s.move_s < 1.0 for s in (got[0], got[2])), got  # the other syncs did not stall
    start = time.monotonic()
    at_transfer_start(1, 1)  # claimed already: no second stall
    assert time.monotonic() - start < 1.0 and json.loads(claim.read_text()) == said
    assert [p.name for p in tmp_path.iterdir()] == ["claim.json"]  # no temporary left
