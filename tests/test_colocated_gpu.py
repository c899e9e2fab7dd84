"""Colocation on one GPU: weights over CUDA IPC between processes that share it, and into a CUDA
model over gloo (skipped without a CUDA device; the CPU side of colocation is in test_device_plan.py).

Run on nvidia-h100-x1 (docs/gpu.md).
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl import Supervisor
from asyncrl.comm.member import form_group
from asyncrl.runtime.devices import detect
from sync_actors import Receiver, Sender

kind, ids = detect("auto")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(kind != "cuda" or not ids, reason="needs a CUDA device")]
HOST = "127.0.0.1"


async def test_weight_sync_over_cuda_ipc_is_bit_exact_and_maps_each_allocation_once():
    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, kwargs={"device": "cuda"}, name="sender", gpus=1)
        inplace, whole = await asyncio.gather(
            sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="inplace", share_devices_with="sender"),
            sup.spawn(Receiver, 3, kwargs={"device": "cuda", "whole": True}, name="whole", share_devices_with="sender"),
        )
        assert await form_group([sender, inplace, whole], HOST, backend="ipc", timeout_s=60) > 0
        buckets, direct = (await asyncio.gather(sender.setup(bucket_bytes=1024), inplace.setup(), whole.setup()))[0]
        assert buckets > 1 and direct >= 1  # both ways a tensor travels: staged and sent whole
        mapped = []
        for version in range(5):
            sent, a, b = await asyncio.gather(
                sender.step_and_send(version), inplace.receive(version), whole.receive(version)
            )
            assert sent == a == b, version
            mapped.append(await asyncio.gather(inplace.mapped(), whole.mapped()))
        assert all(m == mapped[0] for m in mapped) and min(mapped[0]) > 0, mapped  # once per membership
        assert await sender.sync_created() == {"gloo": 1, "ipc": 1}  # gloo: the handles' control channel


async def test_weight_sync_over_gloo_into_a_cuda_model():
    """A CPU sender and a receiver whose tensors are on the GPU (the HF sampler on a GPU taking
    weights over gloo): tensors larger than a bucket arrive through a temporary."""
    async with Supervisor(device_kind="cuda") as sup:
        sender = await sup.spawn(Sender, 1, name="sender")
        receiver = await sup.spawn(Receiver, 2, kwargs={"device": "cuda"}, name="receiver", gpus=1)
        await form_group([sender, receiver], HOST, backend="gloo", timeout_s=60)
        assert (await asyncio.gather(sender.setup(), receiver.setup()))[0][1] >= 1
        for version in range(3):
            sent, got = await asyncio.gather(sender.step_and_send(version), receiver.receive(version))
            assert sent == got, version
