"""The HCCL binding's tables without Ascend hardware: the root-info block, the dtype and reduction
codes of hccl_types.h, and the function table with the prototypes of hccl.h (checked against the
stub libhccl of `hccl_support` where it needs a library)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from asyncrl.comm import hccl_library
from asyncrl.comm.communicator import ReduceOp
from hccl_support import Hub, create

pytest_plugins = ["hccl_support"]  # its fixtures: stub_builds, stub, minimal_stub, pair


def test_importing_the_module_needs_neither_libhccl_nor_torch_npu():
    code = (
        "import sys, asyncrl.comm.pyhccl, asyncrl.comm.hccl_library as m; "
        "assert 'torch_npu' not in sys.modules; assert m._loaded == {}; print('ok')"
    )
    env = dict(os.environ, ASYNCRL_HCCL_LIBRARY="/nonexistent/libhccl.so")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_root_info_is_an_opaque_4108_byte_block_that_survives_nul_bytes():
    assert hccl_library.HCCL_ROOT_INFO_BYTES == 4108
    assert ctypes.sizeof(hccl_library.HcclRootInfo) == 4108
    data = bytes(range(256)) * 16 + bytes(12)  # NULs inside and at the end
    assert len(data) == 4108
    assert bytes(hccl_library.HcclRootInfo.from_buffer_copy(data)) == data


def test_dtype_codes_are_hccl_types_h():
    expected = {
        torch.int8: 0,
        torch.int16: 1,
        torch.int32: 2,
        torch.float16: 3,
        torch.float32: 4,
        torch.int64: 5,
        torch.uint64: 6,
        torch.uint8: 7,
        torch.uint16: 8,
        torch.uint32: 9,
        torch.float64: 10,
        torch.bfloat16: 11,
        torch.bool: 7,
        torch.float8_e4m3fn: 15,
        torch.float8_e5m2: 16,
        torch.float8_e8m0fnu: 17,
    }
    assert hccl_library.HCCL_DTYPES == expected
    for dtype, code in expected.items():
        assert hccl_library.hccl_dtype(dtype) == code


def _all_torch_dtypes() -> set[torch.dtype]:
    return {v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def test_every_other_torch_dtype_is_refused_by_name():
    refused = _all_torch_dtypes() - set(hccl_library.HCCL_DTYPES)
    assert {torch.complex64, torch.float8_e4m3fnuz, torch.quint8} <= refused
    for dtype in refused:
        with pytest.raises(TypeError, match="hccl cannot transfer") as info:
            hccl_library.hccl_dtype(dtype)
        assert str(dtype) in str(info.value)


def test_only_the_dtypes_hccl_reduces_everywhere_are_reducible():
    assert hccl_library.HCCL_REDUCE_DTYPES == {
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.bfloat16,
    }
    for dtype in hccl_library.HCCL_REDUCE_DTYPES:
        assert hccl_library.hccl_reduce_dtype(dtype) == hccl_library.HCCL_DTYPES[dtype]
    for dtype in (torch.uint8, torch.bool, torch.uint32, torch.float64, torch.float8_e5m2, torch.complex64):
        with pytest.raises(TypeError, match=f"hccl cannot reduce {dtype}"):
            hccl_library.hccl_reduce_dtype(dtype)


def test_reduce_ops_map_to_hccl_codes():
    assert {op: hccl_library.hccl_reduce_op(op) for op in ReduceOp} == {
        ReduceOp.SUM: 0,
        ReduceOp.PROD: 1,
        ReduceOp.MAX: 2,
        ReduceOp.MIN: 3,
    }
    assert hccl_library.hccl_reduce_op(2) == 2  # a plain int naming a ReduceOp is fine
    for bad in (4, -1, "avg"):
        with pytest.raises(TypeError, match="hccl has no reduction"):
            hccl_library.hccl_reduce_op(bad)


def test_symbol_table_has_the_hccl_h_prototypes():
    P, u32, u64, vp, i = ctypes.POINTER, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
    root = P(hccl_library.HcclRootInfo)
    expected = {
        "HcclGetRootInfo": (i, (root,), True),
        "HcclCommInitRootInfo": (i, (u32, root, u32, P(vp)), True),
        "HcclBroadcast": (i, (vp, u64, i, u32, vp, vp), True),
        "HcclAllReduce": (i, (vp, vp, u64, i, i, vp, vp), True),
        "HcclCommDestroy": (i, (vp,), True),
        "HcclSend": (i, (vp, u64, i, u32, vp, vp), False),
        "HcclRecv": (i, (vp, u64, i, u32, vp, vp), False),
        "HcclGetErrorString": (ctypes.c_char_p, (i,), False),
        "HcclGetCommAsyncError": (i, (vp, P(i)), False),
    }
    table = {s.name: (s.restype, s.argtypes, s.required) for s in hccl_library.HCCL_FUNCTIONS}
    assert table == expected
    assert ctypes.sizeof(ctypes.c_uint64) == 8 and ctypes.sizeof(ctypes.c_void_p) == 8


def test_bound_prototypes_carry_full_width_values_to_c(stub):
    """A count past 2**32, a root past 2**31 and a 64-bit stream pointer reach C unchanged: the
    widths are those of hccl.h, not int (a NULL buffer makes the stub record without moving data)."""
    hub = Hub(1)
    comm = create(stub, hub.group(0))
    handle = comm._handle
    count, root, stream = 2**40 + 3, 2**31 + 5, 0xFFFF_8000_0000_1234
    assert stub.lib.HcclBroadcast(None, count, 11, root, handle, stream) == 0
    assert stub.lib.HcclSend(None, count, 4, root, handle, stream) == 0
    for fn, dtype in (("HcclBroadcast", 11), ("HcclSend", 4)):
        (call,) = stub.calls(fn)
        assert (call["count"], call["dtype"], call["peer"], call["stream"]) == (count, dtype, root, stream)
    comm.close()
