"""The HCCL communicator on real Ascend hardware; skipped without an NPU, torch_npu and CANN's libhccl."""

from __future__ import annotations

import pytest
import torch

from asyncrl.comm.pyhccl import HcclCommunicator
from hccl_support import Hub


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available() and torch.npu.device_count() >= 1


@pytest.mark.skipif(not _npu_available(), reason="needs an Ascend NPU with torch_npu and CANN's libhccl")
def test_real_npu_single_rank_broadcast_and_all_reduce():
    comm = HcclCommunicator.create(Hub(1, name="npu").group(0), "npu:0", 120)
    x = torch.arange(16, dtype=torch.float32, device="npu:0")
    comm.broadcast(x, 0).wait(60)
    comm.all_reduce(x).wait(60)
    assert x.cpu().tolist() == list(map(float, range(16)))
    comm.close()
