"""Device placement on a real GPU host (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

from asyncrl import NoFreeDevicesError, Supervisor
from asyncrl.runtime.devices import detect
from tensor_actors import CudaUser

kind, ids = detect("auto")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(kind != "cuda" or not ids, reason="no CUDA device on this host")]


async def test_each_actor_sees_only_its_own_gpus():
    async with Supervisor(device_kind="cuda") as sup:
        group = await sup.spawn_group(CudaUser, len(ids), name="gpu", gpus=1)
        seen = [await h.visible() for h in group]
        assert [count for count, _ in seen] == [1] * len(ids)
        assert sorted(v for _, v in seen) == sorted(ids)
        out = await group[0].on_device(torch.arange(4.0))
        assert out.device.type == "cpu" and out.tolist() == [0.0, 2.0, 4.0, 6.0]
        with pytest.raises(NoFreeDevicesError):
            await sup.spawn(CudaUser, gpus=1)
        cpu_only = await sup.spawn(CudaUser)
        assert await cpu_only.visible() == (0, "")


def test_an_actors_gpu_is_its_cuda_0_without_cudnn_attention():
    # cuDNN's attention builds a plan for every new shape (benchmarks/README.md, "Attention on new shapes")
    from asyncrl.rl.actor_device import actor_device

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        assert actor_device("cuda") == torch.device("cuda", 0) == torch.device("cuda", torch.cuda.current_device())
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
