"""The HCCL communicator driven end to end against the stub libhccl of `hccl_support`: creation from
rank 0's root info, every operation moving real bytes, and every way of failing (library errors,
init and work deadlines, async errors, device errors, abort and release)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from asyncrl.comm import hccl_library
from asyncrl.comm.communicator import Communicator, ReduceOp
from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError, CommunicatorClosedError, RendezvousError
from conftest import wait_until
from hccl_support import FakeRuntime, Hub, create, on_ranks

pytest_plugins = ["hccl_support"]  # its fixtures: stub_builds, stub, minimal_stub, pair


def test_two_ranks_build_one_communicator_each_from_rank0s_root_info(stub):
    before = Communicator.created["hccl"]
    hub, runtime = Hub(2, name="weights"), FakeRuntime()
    comms = on_ranks(2, lambda r: create(stub, hub.group(r), runtime=runtime))
    assert Communicator.created["hccl"] == before + 2
    assert [(c.backend, c.group, c.rank, c.world_size) for c in comms] == [
        ("hccl", "weights", 0, 2),
        ("hccl", "weights", 1, 2),
    ]
    assert len(stub.calls("HcclGetRootInfo")) == 1  # only rank 0 asks HCCL
    inits = stub.calls("HcclCommInitRootInfo")
    assert sorted((c["peer"], c["count"]) for c in inits) == [(0, 2), (1, 2)]  # (rank, nRanks)
    # the stub verified all 4108 root-info bytes; the device is bound on the thread that calls init
    assert stub.int("stub_live_comms").value == 2
    assert {"hccl-init-weights-r0", "hccl-init-weights-r1"} <= {name for name, _ in runtime.bound}
    for c in comms:
        c.close()
    assert stub.int("stub_live_comms").value == 0


def test_broadcast_reaches_hcclbroadcast_and_moves_the_data(pair, stub):
    comms, _ = pair
    data = [torch.zeros(1000), torch.arange(1000, dtype=torch.float32)]
    on_ranks(2, lambda r: comms[r].broadcast(data[r], src=1).wait(5))
    assert torch.equal(data[0], torch.arange(1000, dtype=torch.float32))
    calls = stub.calls("HcclBroadcast")
    assert sorted(c["rank"] for c in calls) == [0, 1]
    for c, r in ((c, c["rank"]) for c in calls):
        assert (c["count"], c["dtype"], c["peer"], c["stream"]) == (1000, 4, 1, FakeRuntime.STREAM)
        assert c["buf"] == data[r].data_ptr()


def test_broadcast_of_every_supported_dtype_moves_every_byte(pair, stub):
    """The stub sizes elements by hccl_types.h; any code whose size differs from torch's element
    size would leave bytes unmoved (or overrun), so this cross-checks the whole dtype table."""
    comms, _ = pair
    for dtype, code in hccl_library.HCCL_DTYPES.items():
        size = torch.empty(0, dtype=dtype).element_size() * 64
        # 64 elements at the front of a larger buffer: an overrun lands in the guard, not the heap
        sent_buf = torch.randint(0, 256, (size * 4,), dtype=torch.uint8)
        got_buf = torch.zeros(size * 4, dtype=torch.uint8)
        tensors = [sent_buf[:size].view(dtype), got_buf[:size].view(dtype)]
        on_ranks(2, lambda r, tensors=tensors: comms[r].broadcast(tensors[r], src=0).wait(5))
        assert torch.equal(got_buf[:size], sent_buf[:size]), f"{dtype}: bytes missing"
        assert not got_buf[size:].any(), f"{dtype}: bytes past the tensor were written"
        assert stub.calls("HcclBroadcast")[-1]["dtype"] == code


@pytest.mark.parametrize(
    "op, dtype, expected",
    [
        (ReduceOp.SUM, torch.float32, [11.0, 22.0]),
        (ReduceOp.MAX, torch.float32, [10.0, 20.0]),
        (ReduceOp.MIN, torch.int32, [1, 2]),
        (ReduceOp.PROD, torch.int64, [10, 40]),
    ],
)
def test_all_reduce_in_place(pair, stub, op, dtype, expected):
    comms, _ = pair
    tensors = [torch.tensor([1, 2], dtype=dtype), torch.tensor([10, 20], dtype=dtype)]
    on_ranks(2, lambda r: comms[r].all_reduce(tensors[r], op).wait(5))
    assert tensors[0].tolist() == tensors[1].tolist() == expected
    call = stub.calls("HcclAllReduce")[-1]
    assert (call["op"], call["dtype"], call["count"]) == (
        hccl_library.HCCL_REDUCE_OPS[op],
        hccl_library.HCCL_DTYPES[dtype],
        2,
    )


def test_send_and_recv(pair, stub):
    comms, _ = pair
    out, into = torch.arange(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64)
    on_ranks(2, lambda r: (comms[0].send(out, 1) if r == 0 else comms[1].recv(into, 0)).wait(5))
    assert torch.equal(into, out)
    assert [c["peer"] for c in stub.calls("HcclSend")] == [1] and [c["peer"] for c in stub.calls("HcclRecv")] == [0]
    with pytest.raises(ValueError, match="cannot exchange with itself"):
        comms[0].send(out, 0)


def test_bad_arguments_are_refused_before_c_and_leave_the_comm_open(stub):
    comm = create(stub, Hub(1).group(0))
    before = len(stub.calls())
    with pytest.raises(ValueError, match="contiguous"):
        comm.broadcast(torch.zeros(4, 4).t(), 0)
    with pytest.raises(ValueError, match="is on meta"):
        comm.broadcast(torch.zeros(4, device="meta"), 0)
    with pytest.raises(ValueError, match="rank 1 is outside the group of 1"):
        comm.broadcast(torch.zeros(4), 1)
    with pytest.raises(TypeError, match="hccl cannot transfer torch.complex64"):
        comm.broadcast(torch.zeros(4, dtype=torch.complex64), 0)
    with pytest.raises(TypeError, match="hccl cannot reduce torch.uint8"):
        comm.all_reduce(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="hccl has no reduction"):
        comm.all_reduce(torch.zeros(4), 7)
    assert len(stub.calls()) == before and not comm.closed
    comm.close()


def test_an_empty_tensor_needs_no_call(stub):
    comm = create(stub, Hub(1).group(0))
    work = comm.broadcast(torch.zeros(0), 0)
    assert work.done()
    work.wait(1)
    assert stub.calls("HcclBroadcast") == []
    comm.close()


@pytest.mark.parametrize("code, cls", [(4, CollectiveError), (9, CollectiveTimeoutError)])
def test_a_library_error_is_typed_and_aborts_the_communicator(stub, code, cls):
    comm = create(stub, Hub(1, name="w").group(0))
    stub.fail("HcclBroadcast", code)
    with pytest.raises(cls) as info:
        comm.broadcast(torch.zeros(8), 0)
    text = str(info.value)
    assert "group 'w' rank 0: hccl broadcast(src=0, 8 x torch.float32) failed" in text
    assert f"{hccl_library.RESULT_NAMES[code]} ({code}): stub: " in text
    assert comm.closed and stub.int("stub_destroyed").value == 1
    calls = len(stub.calls())
    with pytest.raises(CommunicatorClosedError, match="cannot broadcast"):
        comm.broadcast(torch.zeros(8), 0)
    assert len(stub.calls()) == calls and stub.int("stub_use_after_destroy").value == 0


def test_a_failed_init_is_typed(stub):
    stub.fail("HcclCommInitRootInfo", 7)
    with pytest.raises(CollectiveError, match=r"HcclCommInitRootInfo failed: HCCL_E_UNAVAIL \(7\)"):
        create(stub, Hub(1).group(0))


def test_rank0_root_info_failure_fails_the_others_at_once(stub):
    stub.fail("HcclGetRootInfo", 4)
    hub = Hub(2, name="r")
    errors = []

    def run(rank):
        try:
            create(stub, hub.group(rank), timeout_s=30)
        except (CollectiveError, RendezvousError) as exc:
            errors.append((rank, exc))

    t0 = time.monotonic()
    on_ranks(2, run)
    assert time.monotonic() - t0 < 5
    by_rank = dict(errors)
    assert isinstance(by_rank[0], CollectiveError) and "HcclGetRootInfo failed: HCCL_E_INTERNAL" in str(by_rank[0])
    assert isinstance(by_rank[1], RendezvousError) and "rank 0 could not create it" in str(by_rank[1])
    assert stub.calls("HcclCommInitRootInfo") == []


def test_init_timeout_names_the_rank_and_a_late_communicator_is_destroyed(stub):
    hub = Hub(2, name="late")
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        create(stub, hub.group(0), timeout_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 3
    text = str(info.value)
    assert "group 'late' rank 0" in text and "HCCL_CONNECT_TIMEOUT" in text
    # rank 1 turns up now: rank 0's abandoned init completes too, and its comm must not leak
    comm1 = create(stub, hub.group(1), timeout_s=10)
    assert wait_until(lambda: stub.int("stub_destroyed").value == 1, 5)
    assert stub.int("stub_live_comms").value == 1
    comm1.close()
    assert stub.int("stub_live_comms").value == 0


def test_an_abandoned_init_that_never_completes_leaves_nothing(stub):
    with pytest.raises(CollectiveTimeoutError):
        create(stub, Hub(2).group(0), timeout_s=0.2)
    stub.cdll.stub_cancel_init()  # what HCCL_CONNECT_TIMEOUT does to the real call
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("hccl-init-")], 5)
    assert stub.int("stub_live_comms").value == 0


def test_work_timeout_aborts_and_names_the_op(stub):
    runtime = FakeRuntime()
    comm = create(stub, Hub(1, name="t").group(0), runtime=runtime)
    runtime.hang = True  # the event never fires, as with a peer that never joins
    work = comm.broadcast(torch.zeros(3, dtype=torch.bfloat16), 0)
    assert not work.done()
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        work.wait(0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.5
    assert "group 't' rank 0: hccl broadcast(src=0, 3 x torch.bfloat16) did not complete within 0.2 s" in str(
        info.value
    )
    assert comm.closed and work.done() and stub.int("stub_destroyed").value == 1
    with pytest.raises(CollectiveTimeoutError):  # the same error again, not a new wait
        work.wait(5)


def test_an_async_hccl_error_fails_the_wait_early(stub):
    runtime = FakeRuntime()
    comm = create(stub, Hub(1).group(0), runtime=runtime)
    runtime.hang = True
    work = comm.all_reduce(torch.ones(4))
    ctypes.c_int.in_dll(stub.cdll, "stub_async_error").value = 21
    t0 = time.monotonic()
    with pytest.raises(
        CollectiveError, match=r"HCCL reported an async error: HCCL_E_REMOTE \(21\): stub: error cqe"
    ) as info:
        work.wait(30)
    assert not isinstance(info.value, CollectiveTimeoutError)
    assert time.monotonic() - t0 < 2 and comm.closed


def test_an_unusable_async_query_is_not_a_failure(stub):
    comm = create(stub, Hub(1).group(0))
    stub.fail("HcclGetCommAsyncError", 5)
    comm.broadcast(torch.ones(4), 0).wait(5)
    comm.broadcast(torch.ones(4), 0).wait(5)
    assert not comm.closed and comm._async_query_ok is False
    comm.close()


def test_a_device_error_from_the_event_is_a_collective_error(stub):
    runtime = FakeRuntime()
    comm = create(stub, Hub(1).group(0), runtime=runtime)
    runtime.query_error = RuntimeError("EZ9999: device fault")
    work = comm.broadcast(torch.ones(4), 0)
    with pytest.raises(CollectiveError, match="the device reported an error: EZ9999") as info:
        work.wait(5)
    assert isinstance(info.value.__cause__, RuntimeError) and comm.closed


def test_other_outstanding_work_fails_once_the_comm_is_aborted(stub):
    runtime = FakeRuntime()
    comm = create(stub, Hub(1).group(0), runtime=runtime)
    runtime.hang = True
    first, second = comm.broadcast(torch.ones(4), 0), comm.broadcast(torch.ones(4), 0)
    with pytest.raises(CollectiveTimeoutError):
        first.wait(0.05)
    with pytest.raises(CollectiveError, match="communicator was aborted after broadcast"):
        second.wait(5)
    assert len(comm._orphans) == 2  # both tensors are kept from the allocator


def test_abort_does_not_hang_behind_a_slow_destroy(stub):
    comm = create(stub, Hub(1).group(0))
    comm.release_grace_s = 0.2
    ctypes.c_int.in_dll(stub.cdll, "stub_destroy_delay_ms").value = 1500
    t0 = time.monotonic()
    comm.abort("test")
    assert time.monotonic() - t0 < 1.0
    assert comm.closed and stub.int("stub_destroyed").value == 0
    assert wait_until(lambda: stub.int("stub_destroyed").value == 1, 5)  # finished in the background


def test_close_and_abort_release_once(stub):
    comm = create(stub, Hub(1).group(0))
    with comm:
        comm.broadcast(torch.ones(2), 0).wait(5)
    comm.close()
    comm.abort()
    assert len(stub.calls("HcclCommDestroy")) == 1 and stub.int("stub_use_after_destroy").value == 0
    with pytest.raises(CommunicatorClosedError, match="hccl communicator is closed"):
        comm.all_reduce(torch.ones(2))
