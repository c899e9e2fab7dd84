"""The NCCL binding without a GPU: the struct layouts and tables against nccl.h, the library
search, and the non-blocking state machine (init completion, async errors, deadlines, abort)
driven against a stub libnccl compiled here from C. Real NCCL runs in tests/test_gpu_comm.py."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from asyncrl.comm import nccl_library, pynccl
from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError, CommLibraryError, CommunicatorClosedError
from asyncrl.comm.nccl_library import Config, NcclLibrary, UniqueId
from asyncrl.comm.pynccl import NcclCommunicator

STUB_C = r"""
#include <stddef.h>
typedef struct { size_t size; unsigned magic, version; int blocking, cga, minc, maxc; const char *net; int split; } Cfg;
typedef struct { char internal[128]; } UniqueId;  /* passed by value, as in nccl.h */
int stub_state = 7;          /* what ncclCommGetAsyncError reports */
int stub_ready_after = 0;    /* polls left before the state turns to success (0: never on its own) */
int stub_seen_id_tail = 0, stub_seen_rank = -1, stub_seen_n = 0;
int stub_aborts = 0, stub_seen_blocking = -1, stub_seen_magic = 0, stub_seen_version = 0, stub_seen_size = 0;
static int handle_storage;
int ncclGetVersion(int *v) { *v = 22805; return 0; }
int ncclGetUniqueId(void *id) { return 0; }
int ncclCommInitRankConfig(void **comm, int n, UniqueId id, int rank, Cfg *cfg) {
  stub_seen_id_tail = id.internal[127]; stub_seen_rank = rank; stub_seen_n = n;
  stub_seen_blocking = cfg->blocking; stub_seen_magic = (int)cfg->magic;
  stub_seen_version = (int)cfg->version; stub_seen_size = (int)cfg->size;
  *comm = &handle_storage; return 7; }
int ncclCommGetAsyncError(void *comm, int *state) {
  if (stub_ready_after > 0 && --stub_ready_after == 0) stub_state = 0;
  *state = stub_state; return 0; }
int ncclCommAbort(void *comm) { stub_aborts++; return 0; }
const char *ncclGetErrorString(int r) { return r == 6 ? "remote process exited or there was a network error" : "stub"; }
int ncclBroadcast(void *s, void *r, size_t c, int t, int root, void *comm, void *st) { return 0; }
int ncclAllReduce(void *s, void *r, size_t c, int t, int op, void *comm, void *st) { return 0; }
int ncclSend(void *s, size_t c, int t, int peer, void *comm, void *st) { return 0; }
int ncclRecv(void *r, size_t c, int t, int peer, void *comm, void *st) { return 0; }
"""


@pytest.fixture(scope="module")
def stub_path(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) on this machine: the stub libnccl cannot be built")
    d = tmp_path_factory.mktemp("stubnccl")
    (d / "stub.c").write_text(STUB_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libnccl_stub.so"), str(d / "stub.c")], check=True)
    return str(d / "libnccl_stub.so")


@pytest.fixture
def stub(stub_path):
    lib = NcclLibrary(stub_path)
    raw = ctypes.CDLL(stub_path)
    for name, value in (("stub_state", 7), ("stub_ready_after", 0), ("stub_aborts", 0)):
        ctypes.c_int.in_dll(raw, name).value = value
    return lib, raw


def value(raw, name):
    return ctypes.c_int.in_dll(raw, name).value


def comm_on(lib, timeout_s=5.0):
    """A communicator around the stub's handle, as `create` builds it once init returned."""
    handle = ctypes.c_void_p()
    config = Config.non_blocking()
    unique = UniqueId()
    unique.internal[127] = 42
    lib.ncclCommInitRankConfig(ctypes.byref(handle), 2, unique, 1, ctypes.byref(config))
    return NcclCommunicator(
        lib, handle, group="g/g0", rank=1, world_size=2, device=torch.device("cpu"), timeout_s=timeout_s
    )


def test_config_is_a_prefix_of_ncclconfig_t_with_blocking_off():
    offsets = {name: getattr(Config, name).offset for name, _ in Config._fields_}
    assert offsets == {
        "size": 0,
        "magic": 8,
        "version": 12,
        "blocking": 16,
        "cgaClusterSize": 20,
        "minCTAs": 24,
        "maxCTAs": 28,
        "netName": 32,
        "splitShare": 40,
    }
    config = Config.non_blocking()
    assert config.size == ctypes.sizeof(Config) and config.magic == 0xCAFEBEEF
    assert config.version == 21700 and config.blocking == 0
    assert config.cgaClusterSize == config.minCTAs == config.maxCTAs == config.splitShare == -(2**31)
    assert ctypes.sizeof(UniqueId) == 128


def test_dtype_and_reduce_codes_are_nccl_h():
    dtypes = nccl_library.DTYPES
    assert dtypes[torch.int8] == 0 and dtypes[torch.uint8] == 1 and dtypes[torch.int32] == 2
    assert dtypes[torch.int64] == 4 and dtypes[torch.float16] == 6 and dtypes[torch.float32] == 7
    assert dtypes[torch.float64] == 8 and dtypes[torch.bfloat16] == 9
    assert [nccl_library.REDUCE_OPS[op] for op in sorted(nccl_library.REDUCE_OPS)] == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="cannot carry torch.complex64"):
        pynccl._dtype_code(torch.zeros(1, dtype=torch.complex64))


def test_function_table_has_the_nccl_h_prototypes():
    P, i, vp, size = ctypes.POINTER, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    expected = {
        "ncclGetVersion": (i, (P(i),)),
        "ncclGetUniqueId": (i, (P(UniqueId),)),
        "ncclCommInitRankConfig": (i, (P(vp), i, UniqueId, i, P(Config))),  # the id goes by value
        "ncclCommGetAsyncError": (i, (vp, P(i))),
        "ncclCommAbort": (i, (vp,)),
        "ncclGetErrorString": (ctypes.c_char_p, (i,)),
        "ncclBroadcast": (i, (vp, vp, size, i, i, vp, vp)),
        "ncclAllReduce": (i, (vp, vp, size, i, i, vp, vp)),
        "ncclSend": (i, (vp, size, i, i, vp, vp)),
        "ncclRecv": (i, (vp, size, i, i, vp, vp)),
    }
    assert {f.name: (f.restype, f.argtypes) for f in nccl_library.NCCL_FUNCTIONS} == expected
    assert all(f.required for f in nccl_library.NCCL_FUNCTIONS)


def test_the_override_is_the_only_candidate(monkeypatch):
    monkeypatch.setenv(nccl_library.ENV_LIBRARY, "/opt/custom/libnccl.so.2")
    assert nccl_library.library_candidates() == ["/opt/custom/libnccl.so.2"]
    monkeypatch.delenv(nccl_library.ENV_LIBRARY)
    assert nccl_library.library_candidates()[-1] == "libnccl.so.2"


def test_a_missing_or_foreign_library_is_a_clear_error(tmp_path):
    with pytest.raises(CommLibraryError, match="cannot load libnccl"):
        NcclLibrary(str(tmp_path / "nope.so"))
    with pytest.raises(CommLibraryError, match="libc.so.6 lacks the required symbol ncclGetVersion: NCCL >= 2.14"):
        NcclLibrary("libc.so.6")


def test_init_is_non_blocking_and_driven_to_completion(stub):
    lib, raw = stub
    assert lib.version == "2.28.5"
    ctypes.c_int.in_dll(raw, "stub_ready_after").value = 5
    comm = comm_on(lib)
    assert value(raw, "stub_seen_blocking") == 0 and value(raw, "stub_seen_magic") == ctypes.c_int(0xCAFEBEEF).value
    assert value(raw, "stub_seen_size") == ctypes.sizeof(Config) and value(raw, "stub_seen_version") == 21700
    # the 128-byte id arrives by value, with the rank and world size after it intact
    assert (value(raw, "stub_seen_id_tail"), value(raw, "stub_seen_rank"), value(raw, "stub_seen_n")) == (42, 1, 2)
    comm._drive(lambda: True, 5.0, "communicator initialisation")  # returns once NCCL says ncclSuccess
    assert not comm.closed and value(raw, "stub_aborts") == 0
    comm.close()
    comm.close()
    assert value(raw, "stub_aborts") == 1  # released exactly once


def test_a_peer_failure_aborts_and_raises_a_typed_error(stub):
    lib, raw = stub
    comm = comm_on(lib)
    ctypes.c_int.in_dll(raw, "stub_state").value = 6  # ncclRemoteError
    with pytest.raises(CollectiveError, match="ncclRemoteError.*remote process exited.*communicator aborted"):
        comm._drive(lambda: False, 5.0, "broadcast from rank 0")
    assert comm.closed and value(raw, "stub_aborts") == 1
    with pytest.raises(CommunicatorClosedError, match="failed during broadcast from rank 0"):
        comm.broadcast(torch.zeros(1), 0)


def test_a_deadline_aborts_and_names_the_rank_and_operation(stub):
    import time

    lib, raw = stub
    comm = comm_on(lib)
    ctypes.c_int.in_dll(raw, "stub_state").value = 0
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"rank 1/2 .*all_reduce\(MAX\) did not complete within 0.3 s"):
        comm._drive(lambda: False, 0.3, "all_reduce(MAX)")  # the event never completes: a frozen peer
    assert 0.3 <= time.monotonic() - start < 2
    assert comm.closed and value(raw, "stub_aborts") == 1
