"""PyNccl and the weight sync on two real GPUs (skipped where there are fewer)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncrl import RemoteError, Supervisor
from asyncrl.comm.member import form_group
from asyncrl.runtime.devices import detect
from sync_actors import NcclProbe, Receiver, Sender, staged_rounds

kind, ids = detect("auto")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(kind != "cuda" or len(ids) < 2, reason="needs two CUDA devices")]
HOST = "127.0.0.1"


async def test_pynccl_broadcast_is_bit_exact_and_matches_torch_distributed():
    async with Supervisor(device_kind="cuda") as sup:
        a, b = await sup.spawn_group(NcclProbe, 2, name="probe", gpus=1)
        await form_group([a, b], HOST, backend="nccl", timeout_s=60)
        for seed, numel, dtype in (
            (1, 1, "float32"),
            (2, 1 << 20, "bfloat16"),
            (3, 12345, "int64"),
            (4, (64 << 20) + 3, "uint8"),
            (5, 4097, "float16"),
        ):
            ours = await asyncio.gather(a.broadcast_random(seed, numel, dtype), b.broadcast_random(seed, numel, dtype))
            ref = await asyncio.gather(
                a.broadcast_random(seed, numel, dtype, True), b.broadcast_random(seed, numel, dtype, True)
            )
            assert ours[0] == ours[1] == ref[0] == ref[1], (seed, dtype)
        assert await a.sync_created() == {"nccl": 1}


async def test_weight_sync_over_nccl_is_bit_exact_on_one_communicator():
    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, kwargs={"device": "cuda"}, name="sender", gpus=1)
        receiver = await sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="receiver", gpus=1)
        await form_group([sender, receiver], HOST, backend="nccl", timeout_s=60)
        await asyncio.gather(sender.setup(), receiver.setup())
        for version in range(10):
            sent, got = await asyncio.gather(sender.step_and_send(version), receiver.receive(version))
            assert sent == got, version
        assert await sender.sync_created() == {"nccl": 1} and await receiver.sync_created() == {"nccl": 1}


async def test_delta_syncs_over_nccl_are_bit_exact_as_indices_as_bitmaps_and_whole():
    """--run.sync_delta on between two GPUs: one element a tensor changed (indices), every 10th
    (a bitmap), every one (whole buckets), in place and through a consumer."""
    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, kwargs={"device": "cuda"}, name="sender", gpus=1)
        in_place = await sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="in_place", gpus=1)
        whole = await sup.spawn(
            Receiver, 3, kwargs={"device": "cuda", "whole": True}, name="whole", share_devices_with="in_place"
        )
        members = [sender, in_place, whole]
        await form_group(members, HOST, backend="nccl", timeout_s=60)
        await asyncio.gather(sender.setup(delta=True), in_place.setup(), whole.setup())
        for version, (small, every) in enumerate([(False, 1), (True, 1), (False, 10), (False, 1), (False, 7)]):
            sent, *got = await asyncio.gather(
                sender.step_and_send(version, small, every), in_place.receive(version), whole.receive(version)
            )
            assert got == [sent, sent], version
        assert [await m.deltas() for m in members] == [4, 4, 4]  # all but the first, which has no base


async def test_staged_receivers_over_nccl_and_ipc_let_the_sender_finish_alone_and_apply_bit_exactly():
    """--sampler.stage_weights: two receivers on one GPU (NCCL to it, CUDA IPC within it) join
    each sync on the sender's notice. The sender's syncs complete with no call to either; their
    weights hold the previous version until `apply`, then the new one, as deltas after the first."""
    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, kwargs={"device": "cuda"}, name="sender", gpus=1)
        first = await sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="first", gpus=1)
        second = await sup.spawn(Receiver, 3, kwargs={"device": "cuda"}, name="second", share_devices_with="first")
        await form_group([sender, first, second], HOST, backend="nccl", timeout_s=60)
        await staged_rounds(sender, [first, second])


async def test_two_receivers_sharing_a_gpu_get_bit_exact_weights_over_nccl_then_ipc():
    """--sampler.per_gpu 2: a group of 3 on 2 GPUs is made in tiers (comm/tiered.py), created once."""
    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, kwargs={"device": "cuda"}, name="sender", gpus=1)
        first = await sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="first", gpus=1)
        second = await sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="second", share_devices_with="first")
        members = [sender, first, second]
        await form_group(members, HOST, backend="nccl", timeout_s=60)
        await asyncio.gather(*(m.setup() for m in members))
        for version in range(10):
            sent, got1, got2 = await asyncio.gather(
                sender.step_and_send(version), first.receive(version), second.receive(version)
            )
            assert sent == got1 == got2, version
        for m in members:
            assert (await m.sync_created()).get("nccl+ipc") == 1


async def test_a_peer_that_never_joins_the_collective_times_out_and_the_group_is_rebuilt():
    async with Supervisor(device_kind="cuda") as sup:
        a, b = await sup.spawn_group(NcclProbe, 2, name="probe", gpus=1)
        await form_group([a, b], HOST, backend="nccl", timeout_s=60)
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:  # rank 1 never calls broadcast
            await a.broadcast_random(1, 1 << 20, "float32", timeout_s=2.0)
        assert info.value.remote_type == "CollectiveTimeoutError" and "communicator aborted" in str(info.value)
        assert time.monotonic() - start < 10
        assert await a.cuda_still_works() == 4.0  # the abort released the spinning kernel
        await form_group([a, b], HOST, generation=1, backend="nccl", timeout_s=60)
        ours = await asyncio.gather(a.broadcast_random(7, 1000, "float32"), b.broadcast_random(7, 1000, "float32"))
        assert ours[0] == ours[1]
        assert await a.sync_created() == {"nccl": 2}


async def test_sigkill_of_a_receiver_mid_sync_fails_the_sender_in_bounded_time():
    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, kwargs={"device": "cuda"}, name="sender", gpus=1)
        victim = await sup.spawn(Receiver, 2, kwargs={"device": "cuda", "slow_s": 0.05}, name="victim", gpus=1)
        await form_group([sender, victim], HOST, backend="nccl", timeout_s=60)
        await asyncio.gather(sender.setup(timeout_s=5), victim.setup(timeout_s=5))
        pending = asyncio.gather(sender.step_and_send(0), victim.receive(0), return_exceptions=True)
        await asyncio.sleep(0.5)
        start = time.monotonic()
        os.kill(victim.info().pid, signal.SIGKILL)
        sent, _ = await pending
        assert isinstance(sent, RemoteError), sent
        assert sent.remote_type in ("CollectiveError", "CollectiveTimeoutError"), sent
        assert time.monotonic() - start < 15
