"""The HCCL binding without Ascend hardware: its tables, the library search, and the communicator
driven end to end against a stub libhccl compiled here from C (skipped where no C compiler exists).

The stub exports the HCCL functions with the prototypes of CANN's hccl.h, records every call, and
really moves bytes between in-process ranks (CPU tensors, one thread per rank), so a wrong count,
dtype code, root or pointer shows up as wrong data, not only as a wrong record. What it cannot
stand in for is the NPU runtime (streams, events), which a small fake replaces; `test_real_npu`
needs the real thing and is skipped without it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch

from asyncrl.comm import pyhccl
from asyncrl.comm.communicator import Communicator, ReduceOp
from asyncrl.comm.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommLibraryError,
    CommunicatorClosedError,
    RendezvousError,
)
from asyncrl.comm.pyhccl import HcclCommunicator, HcclLibrary

from conftest import wait_until

# --------------------------------------------------------------------------------------------
# the stub libhccl
# --------------------------------------------------------------------------------------------

STUB_C = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define ROOT_BYTES 4108
#define MAXR 8
#define MAXCALLS 512
#define MAGIC 0x48434c53u

typedef int HcclResult;
typedef int HcclDataType;
typedef int HcclReduceOp;
typedef void *HcclComm;
typedef void *aclrtStream;
typedef struct { char internal[ROOT_BYTES]; } HcclRootInfo;
typedef struct { uint32_t magic, rank, nranks; int destroyed; } StubComm;

/* One record per call; Python reads these arrays with ctypes' in_dll. */
typedef struct {
    char fn[32]; uint32_t rank, nranks; uint64_t count; int32_t dtype, op; uint32_t peer;
    uint64_t stream, buf;
} StubCall;
StubCall stub_calls[MAXCALLS];
int stub_ncalls, stub_live_comms, stub_destroyed, stub_use_after_destroy, stub_destroy_delay_ms;
int stub_async_error;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static char fail_fn[8][32];
static int fail_code[8], nfail, root_seed, init_arrived, init_gen, init_seed, init_cancel;

static const int dsize[18] = {1, 2, 4, 2, 4, 8, 8, 1, 2, 4, 8, 2, 16, 0, 1, 1, 1, 1};

void stub_reset(void) {
    pthread_mutex_lock(&mu);
    stub_ncalls = stub_live_comms = stub_destroyed = stub_use_after_destroy = 0;
    stub_destroy_delay_ms = stub_async_error = nfail = init_arrived = init_cancel = 0;
    pthread_mutex_unlock(&mu);
}
void stub_fail(const char *fn, int code) {
    pthread_mutex_lock(&mu);
    strncpy(fail_fn[nfail], fn, 31); fail_code[nfail++] = code;
    pthread_mutex_unlock(&mu);
}
void stub_cancel_init(void) {
    pthread_mutex_lock(&mu); init_cancel = 1; pthread_cond_broadcast(&cv); pthread_mutex_unlock(&mu);
}
static int forced(const char *fn) {
    int code = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nfail; i++) if (strcmp(fail_fn[i], fn) == 0) code = fail_code[i];
    pthread_mutex_unlock(&mu);
    return code;
}
static void record(const char *fn, StubComm *c, uint64_t count, int dtype, int op, uint32_t peer,
                   void *stream, void *buf) {
    pthread_mutex_lock(&mu);
    if (stub_ncalls < MAXCALLS) {
        StubCall *r = &stub_calls[stub_ncalls++];
        memset(r, 0, sizeof *r);
        strncpy(r->fn, fn, 31);
        r->rank = c ? c->rank : 0; r->nranks = c ? c->nranks : 0;
        r->count = count; r->dtype = dtype; r->op = op; r->peer = peer;
        r->stream = (uint64_t)(uintptr_t)stream; r->buf = (uint64_t)(uintptr_t)buf;
    }
    pthread_mutex_unlock(&mu);
}
static int comm_ok(StubComm *c) {
    if (!c || c->magic != MAGIC) return 0;
    if (c->destroyed) { __sync_fetch_and_add(&stub_use_after_destroy, 1); return 0; }
    return 1;
}
static void deadline_in(struct timespec *ts, int ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000; ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) { ts->tv_sec++; ts->tv_nsec -= 1000000000L; }
}

/* Root info: byte i = seed + i (so it holds NUL bytes); init checks all 4108 of them. */
HcclResult HcclGetRootInfo(HcclRootInfo *ri) {
    int f = forced("HcclGetRootInfo");
    record("HcclGetRootInfo", 0, 0, 0, 0, 0, 0, 0);
    if (f) return f;
    if (!ri) return 2;
    pthread_mutex_lock(&mu); int seed = (++root_seed) & 0xff; pthread_mutex_unlock(&mu);
    for (int i = 0; i < ROOT_BYTES; i++) ri->internal[i] = (char)((seed + i) & 0xff);
    return 0;
}
static int root_seed_of(const HcclRootInfo *ri) {
    int seed = (unsigned char)ri->internal[0];
    for (int i = 0; i < ROOT_BYTES; i++)
        if ((unsigned char)ri->internal[i] != ((seed + i) & 0xff)) return -1;
    return seed;
}

/* Blocks until nRanks callers with the same root info arrived, as the real one does. */
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *ri, uint32_t rank, HcclComm *comm) {
    int f = forced("HcclCommInitRootInfo");
    record("HcclCommInitRootInfo", 0, nRanks, 0, 0, rank, 0, 0);
    if (f) return f;
    int seed = ri ? root_seed_of(ri) : -1;
    if (seed < 0 || rank >= nRanks || nRanks > MAXR || !comm) return 1;
    pthread_mutex_lock(&mu);
    if (init_arrived == 0) init_seed = seed;
    else if (seed != init_seed) { pthread_mutex_unlock(&mu); return 1; }
    int gen = init_gen;
    if (++init_arrived == (int)nRanks) { init_arrived = 0; init_gen++; pthread_cond_broadcast(&cv); }
    struct timespec ts; deadline_in(&ts, 60000);
    while (gen == init_gen && !init_cancel)
        if (pthread_cond_timedwait(&cv, &mu, &ts) != 0) break;
    int arrived = gen != init_gen;
    if (!arrived) init_arrived--;
    pthread_mutex_unlock(&mu);
    if (!arrived) return 9;
    StubComm *c = calloc(1, sizeof *c);
    c->magic = MAGIC; c->rank = rank; c->nranks = nRanks;
    __sync_fetch_and_add(&stub_live_comms, 1);
    *comm = c;
    return 0;
}

/* The collectives: every rank posts its buffer; the last to arrive moves the bytes for all. */
enum { K_BCAST, K_REDUCE, K_SEND, K_RECV };
typedef struct { int kind; void *buf; uint64_t count; int dtype, op; uint32_t peer; } Post;
static Post posts[MAXR];
static int coll_arrived, coll_gen, coll_rc;

static int size_of(int dtype) { return dtype >= 0 && dtype < 18 ? dsize[dtype] : 0; }

#define REDUCE_AS(T) do { \
    T *acc = (T *)posts[0].buf; \
    for (uint64_t i = 0; i < p->count; i++) { \
        T v = acc[i]; \
        for (int r = 1; r < n; r++) { T x = ((T *)posts[r].buf)[i]; \
            v = p->op == 0 ? v + x : p->op == 1 ? v * x : p->op == 2 ? (x > v ? x : v) : (x < v ? x : v); } \
        acc[i] = v; } \
    for (int r = 1; r < n; r++) memcpy(posts[r].buf, acc, p->count * sizeof(T)); \
} while (0)

static int run_collective(int n) {
    Post *p = &posts[0];
    for (int r = 1; r < n; r++)
        if (posts[r].count != p->count || posts[r].dtype != p->dtype || posts[r].op != p->op) return 1;
    if (size_of(p->dtype) == 0) return 1;
    if (p->kind == K_BCAST) {
        if (p->peer >= (uint32_t)n) return 1;
        for (int r = 0; r < n; r++)
            if (r != (int)p->peer) memcpy(posts[r].buf, posts[p->peer].buf, p->count * size_of(p->dtype));
        return 0;
    }
    if (p->op < 0 || p->op > 3) return 1;
    if (p->dtype == 4) REDUCE_AS(float);
    else if (p->dtype == 2) REDUCE_AS(int32_t);
    else if (p->dtype == 5) REDUCE_AS(int64_t);
    else return 5;
    return 0;
}
static int run_p2p(void) {
    int s = posts[0].kind == K_SEND ? 0 : 1, r = 1 - s;
    if (posts[s].kind != K_SEND || posts[r].kind != K_RECV) return 1;
    if (posts[s].peer != (uint32_t)r || posts[r].peer != (uint32_t)s) return 1;
    if (posts[s].count != posts[r].count || posts[s].dtype != posts[r].dtype || !size_of(posts[s].dtype)) return 1;
    memcpy(posts[r].buf, posts[s].buf, posts[s].count * size_of(posts[s].dtype));
    return 0;
}
static int exchange(StubComm *c, Post post) {
    pthread_mutex_lock(&mu);
    posts[c->rank] = post;
    int gen = coll_gen, n = (int)c->nranks;
    if (++coll_arrived == n) {
        coll_rc = (post.kind == K_SEND || post.kind == K_RECV) ? run_p2p() : run_collective(n);
        coll_arrived = 0; coll_gen++; pthread_cond_broadcast(&cv);
    }
    struct timespec ts; deadline_in(&ts, 10000);
    while (gen == coll_gen)
        if (pthread_cond_timedwait(&cv, &mu, &ts) != 0) break;
    int rc = gen != coll_gen ? coll_rc : 9;
    if (gen == coll_gen) coll_arrived--;
    pthread_mutex_unlock(&mu);
    return rc;
}
/* A NULL buffer only records the call: lets a test pass values too wide for an int. */
static HcclResult op(const char *fn, int kind, void *buf, uint64_t count, int dtype, int rop,
                     uint32_t peer, HcclComm comm, aclrtStream stream) {
    int f = forced(fn);
    StubComm *c = (StubComm *)comm;
    if (!comm_ok(c)) return 2;
    record(fn, c, count, dtype, rop, peer, stream, buf);
    if (f) return f;
    if (!buf) return 0;
    Post p = {kind, buf, count, dtype, rop, peer};
    return exchange(c, p);
}

HcclResult HcclAllReduce(void *send, void *recv, uint64_t count, HcclDataType dtype, HcclReduceOp rop,
                         HcclComm comm, aclrtStream stream) {
    if (send != recv) return 1;  /* the binding reduces in place */
    return op("HcclAllReduce", K_REDUCE, send, count, dtype, rop, 0, comm, stream);
}
#ifndef STUB_NO_BROADCAST
HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dtype, uint32_t root, HcclComm comm,
                         aclrtStream stream) {
    return op("HcclBroadcast", K_BCAST, buf, count, dtype, -1, root, comm, stream);
}
#endif
HcclResult HcclCommDestroy(HcclComm comm) {
    StubComm *c = (StubComm *)comm;
    int f = forced("HcclCommDestroy");
    if (!comm_ok(c)) return 2;
    record("HcclCommDestroy", c, 0, 0, 0, 0, 0, 0);
    if (stub_destroy_delay_ms) usleep(stub_destroy_delay_ms * 1000);
    c->destroyed = 1;
    __sync_fetch_and_sub(&stub_live_comms, 1);
    __sync_fetch_and_add(&stub_destroyed, 1);
    return f;
}
#ifndef STUB_MINIMAL
HcclResult HcclSend(void *buf, uint64_t count, HcclDataType dtype, uint32_t dst, HcclComm comm, aclrtStream s) {
    return op("HcclSend", K_SEND, buf, count, dtype, -1, dst, comm, s);
}
HcclResult HcclRecv(void *buf, uint64_t count, HcclDataType dtype, uint32_t src, HcclComm comm, aclrtStream s) {
    return op("HcclRecv", K_RECV, buf, count, dtype, -1, src, comm, s);
}
const char *HcclGetErrorString(HcclResult code) {
    switch (code) {
    case 0: return "stub: success";
    case 4: return "stub: internal error";
    case 9: return "stub: timed out";
    case 21: return "stub: error cqe";
    default: return "stub: some hccl error";
    }
}
HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *err) {
    int f = forced("HcclGetCommAsyncError");
    if (!comm_ok((StubComm *)comm)) return 2;
    if (f) return f;
    *err = stub_async_error;
    return 0;
}
#endif
"""


class StubCall(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_char * 32), ("rank", ctypes.c_uint32), ("nranks", ctypes.c_uint32),
                ("count", ctypes.c_uint64), ("dtype", ctypes.c_int32), ("op", ctypes.c_int32),
                ("peer", ctypes.c_uint32), ("stream", ctypes.c_uint64), ("buf", ctypes.c_uint64)]


class Stub:
    """A compiled stub libhccl: its HcclLibrary binding plus the controls and call records."""

    def __init__(self, path: str):
        self.path = path
        self.cdll = ctypes.CDLL(path)
        self.lib = HcclLibrary(self.cdll, path)
        self.cdll.stub_fail.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def int(self, name: str) -> ctypes.c_int:
        return ctypes.c_int.in_dll(self.cdll, name)

    def reset(self) -> None:
        self.cdll.stub_reset()

    def fail(self, fn: str, code: int) -> None:
        self.cdll.stub_fail(fn.encode(), code)

    def calls(self, fn: str | None = None) -> list[dict]:
        table = (StubCall * 512).in_dll(self.cdll, "stub_calls")
        rows = [table[i] for i in range(self.int("stub_ncalls").value)]
        out = [{k: getattr(r, k) for k, _ in StubCall._fields_} for r in rows]
        for row in out:
            row["fn"] = row["fn"].decode()
        return [r for r in out if fn is None or r["fn"] == fn]


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="session")
def stub_builds(tmp_path_factory):
    """Path of the stub built three ways: complete, without the optional symbols, without HcclBroadcast."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) on this machine: the stub libhccl cannot be built")
    root = tmp_path_factory.mktemp("hccl_stub")
    src = root / "stub.c"
    src.write_text(STUB_C)
    paths = {}
    for variant, flags in {"full": [], "minimal": ["-DSTUB_MINIMAL"], "nobcast": ["-DSTUB_NO_BROADCAST"]}.items():
        out = root / f"libhccl_{variant}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread", *flags, "-o", str(out),
                        str(src)], check=True, capture_output=True, text=True)
        paths[variant] = str(out)
    return paths


@pytest.fixture(scope="session")
def _stubs(stub_builds):
    return {variant: Stub(stub_builds[variant]) for variant in ("full", "minimal")}


@pytest.fixture
def stub(_stubs):
    _stubs["full"].reset()
    yield _stubs["full"]
    # Free any init still waiting for a missing rank, and let it leave before the next reset.
    _stubs["full"].cdll.stub_cancel_init()
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith("hccl-init-")], 5)


@pytest.fixture
def minimal_stub(_stubs):
    _stubs["minimal"].reset()
    return _stubs["minimal"]


# --------------------------------------------------------------------------------------------
# fakes for what only an NPU host has: the rendezvous group and torch_npu's streams/events
# --------------------------------------------------------------------------------------------


class Hub:
    """The shared side of an in-process group: broadcast_obj by per-rank call order, through a
    msgspec round trip as the TCPStore one does (so only msgspec-encodable values get through)."""

    def __init__(self, world_size: int, name: str = "g"):
        self.world_size, self.name = world_size, name
        self._cv = threading.Condition()
        self._slots: dict[int, bytes] = {}
        self._seq = [0] * world_size

    def broadcast_obj(self, rank: int, obj, src: int, type):
        with self._cv:
            key = self._seq[rank]
            self._seq[rank] += 1
            if rank == src:
                self._slots[key] = msgspec.msgpack.encode(obj)
                self._cv.notify_all()
            elif not self._cv.wait_for(lambda: key in self._slots, timeout=10):
                raise RendezvousError(f"group {self.name!r}: rank {src} never broadcast #{key}")
            return msgspec.msgpack.decode(self._slots[key], type=type)

    def group(self, rank: int) -> FakeGroup:
        return FakeGroup(self, rank)


class FakeGroup:
    def __init__(self, hub: Hub, rank: int):
        self._hub, self.rank, self.world_size, self.name = hub, rank, hub.world_size, hub.name

    def broadcast_obj(self, obj, src: int = 0, type=bytes):
        return self._hub.broadcast_obj(self.rank, obj, src, type)


class FakeEvent:
    def __init__(self, runtime: FakeRuntime):
        self._rt = runtime

    def query(self) -> bool:
        if self._rt.query_error is not None:
            raise self._rt.query_error
        return not self._rt.hang


class FakeRuntime:
    """Stands in for NpuRuntime on CPU tensors. The stub finishes an op inside the call, so events
    are complete at once unless a test sets ``hang``."""

    STREAM = 0x5EED0000

    def __init__(self):
        self.hang = False
        self.query_error: BaseException | None = None
        self.bound: list[tuple[str, torch.device]] = []

    def normalize_device(self, device):
        return torch.device(device)

    def bind_device(self, device):
        self.bound.append((threading.current_thread().name, device))

    def resolve_stream(self, stream, device):
        return self.STREAM if stream is None else stream

    def stream_handle(self, stream):
        return stream

    def record_event(self, stream):
        return FakeEvent(self)

    def check_format(self, tensor, what):
        pass


CPU = torch.device("cpu")


def create(stub: Stub, group, timeout_s: float = 10.0, runtime: FakeRuntime | None = None) -> HcclCommunicator:
    return HcclCommunicator.create(group, CPU, timeout_s, library=stub.lib, runtime=runtime or FakeRuntime())


def on_ranks(world_size: int, fn, timeout_s: float = 20.0) -> list:
    """Run ``fn(rank)`` on one thread per rank (the stub blocks until all ranks call) and return
    the results in rank order, re-raising the first exception."""
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def run(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001  (re-raised below, in the test thread)
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@pytest.fixture
def pair(stub):
    """Two ranks of one group, created concurrently against the stub."""
    hub = Hub(2, name="pair")
    runtime = FakeRuntime()
    comms = on_ranks(2, lambda r: create(stub, hub.group(r), runtime=runtime))
    yield comms, runtime
    for comm in comms:
        comm.close()


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------


def test_importing_the_module_needs_neither_libhccl_nor_torch_npu():
    code = ("import sys, asyncrl.comm.pyhccl as m; "
            "assert 'torch_npu' not in sys.modules; assert m._loaded == {}; print('ok')")
    env = dict(os.environ, ASYNCRL_HCCL_LIBRARY="/nonexistent/libhccl.so")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_root_info_is_an_opaque_4108_byte_block_that_survives_nul_bytes():
    assert pyhccl.HCCL_ROOT_INFO_BYTES == 4108
    assert ctypes.sizeof(pyhccl.HcclRootInfo) == 4108
    data = bytes(range(256)) * 16 + bytes(12)  # NULs inside and at the end
    assert len(data) == 4108
    assert bytes(pyhccl.HcclRootInfo.from_buffer_copy(data)) == data


def test_dtype_codes_are_hccl_types_h():
    expected = {
        torch.int8: 0, torch.int16: 1, torch.int32: 2, torch.float16: 3, torch.float32: 4, torch.int64: 5,
        torch.uint64: 6, torch.uint8: 7, torch.uint16: 8, torch.uint32: 9, torch.float64: 10,
        torch.bfloat16: 11, torch.bool: 7, torch.float8_e4m3fn: 15, torch.float8_e5m2: 16,
        torch.float8_e8m0fnu: 17,
    }
    assert pyhccl.HCCL_DTYPES == expected
    for dtype, code in expected.items():
        assert pyhccl.hccl_dtype(dtype) == code


def _all_torch_dtypes() -> set[torch.dtype]:
    return {v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def test_every_other_torch_dtype_is_refused_by_name():
    refused = _all_torch_dtypes() - set(pyhccl.HCCL_DTYPES)
    assert {torch.complex64, torch.float8_e4m3fnuz, torch.quint8} <= refused
    for dtype in refused:
        with pytest.raises(TypeError, match="hccl cannot transfer") as info:
            pyhccl.hccl_dtype(dtype)
        assert str(dtype) in str(info.value)


def test_only_the_dtypes_hccl_reduces_everywhere_are_reducible():
    assert pyhccl.HCCL_REDUCE_DTYPES == {torch.int8, torch.int16, torch.int32, torch.int64,
                                         torch.float16, torch.float32, torch.bfloat16}
    for dtype in pyhccl.HCCL_REDUCE_DTYPES:
        assert pyhccl.hccl_reduce_dtype(dtype) == pyhccl.HCCL_DTYPES[dtype]
    for dtype in (torch.uint8, torch.bool, torch.uint32, torch.float64, torch.float8_e5m2, torch.complex64):
        with pytest.raises(TypeError, match=f"hccl cannot reduce {dtype}"):
            pyhccl.hccl_reduce_dtype(dtype)


def test_reduce_ops_map_to_hccl_codes():
    assert {op: pyhccl.hccl_reduce_op(op) for op in ReduceOp} == {
        ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}
    assert pyhccl.hccl_reduce_op(2) == 2  # a plain int naming a ReduceOp is fine
    for bad in (4, -1, "avg"):
        with pytest.raises(TypeError, match="hccl has no reduction"):
            pyhccl.hccl_reduce_op(bad)


def test_symbol_table_has_the_hccl_h_prototypes():
    P, u32, u64, vp, i = ctypes.POINTER, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
    root = P(pyhccl.HcclRootInfo)
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
    table = {s.name: (s.restype, s.argtypes, s.required) for s in pyhccl.SIGNATURES}
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


# --------------------------------------------------------------------------------------------
# finding and binding the library
# --------------------------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for var in (pyhccl.ENV_LIBRARY, *pyhccl.TOOLKIT_ENV_VARS):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_search_order_is_override_then_toolkit_then_loader(clean_env):
    default = os.path.join(pyhccl.DEFAULT_TOOLKIT, "lib64", "libhccl.so")
    assert [p for _, p in pyhccl.library_candidates()] == [default, "libhccl.so"]
    clean_env.setenv("ASCEND_HOME_PATH", "/opt/a")
    clean_env.setenv("ASCEND_TOOLKIT_HOME", "/opt/b")
    assert [p for _, p in pyhccl.library_candidates()] == [
        "/opt/a/lib64/libhccl.so", "/opt/b/lib64/libhccl.so", default, "libhccl.so"]
    clean_env.setenv("ASCEND_TOOLKIT_HOME", pyhccl.DEFAULT_TOOLKIT)  # the same place is tried once
    assert [p for _, p in pyhccl.library_candidates()] == ["/opt/a/lib64/libhccl.so", default, "libhccl.so"]
    clean_env.setenv(pyhccl.ENV_LIBRARY, "/x/libhccl.so")  # an explicit choice is the only one
    assert pyhccl.library_candidates() == [(f"${pyhccl.ENV_LIBRARY}", "/x/libhccl.so")]


def test_no_library_anywhere_lists_every_place_tried(clean_env, tmp_path):
    if os.path.exists(os.path.join(pyhccl.DEFAULT_TOOLKIT, "lib64", "libhccl.so")):
        pytest.skip("this machine has CANN installed")
    clean_env.setenv("ASCEND_HOME_PATH", str(tmp_path / "a"))
    clean_env.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "b"))
    try:
        ctypes.CDLL("libhccl.so")
        pytest.skip("the dynamic loader finds a libhccl.so on this machine")
    except OSError:
        pass
    with pytest.raises(CommLibraryError) as info:
        pyhccl.load_library()
    text = str(info.value)
    for where in (f"{tmp_path}/a/lib64/libhccl.so (no such file)", f"{tmp_path}/b/lib64/libhccl.so (no such file)",
                  f"{pyhccl.DEFAULT_TOOLKIT}/lib64/libhccl.so (no such file)",
                  "system loader path (LD_LIBRARY_PATH, ld.so.cache): libhccl.so (dlopen failed"):
        assert where in text
    assert pyhccl.ENV_LIBRARY in text  # says how to point at it


def test_override_to_a_missing_file_names_it(clean_env, tmp_path):
    clean_env.setenv(pyhccl.ENV_LIBRARY, str(tmp_path / "nope.so"))
    with pytest.raises(CommLibraryError, match=r"\$ASYNCRL_HCCL_LIBRARY: .*nope\.so \(no such file\)") as info:
        pyhccl.load_library()
    assert "ascend-toolkit" not in str(info.value)  # nothing else was tried


def _loaded_path(fragment: str) -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if fragment in os.path.basename(path) and path.startswith("/"):
                return path
    return None


def test_override_to_a_library_that_is_not_hccl_names_the_missing_symbol(clean_env):
    libc = _loaded_path("libc.so")
    assert libc, "libc is always mapped into this process"
    clean_env.setenv(pyhccl.ENV_LIBRARY, libc)
    with pytest.raises(CommLibraryError, match=f"{libc} lacks the required symbol HcclGetRootInfo"):
        pyhccl.load_library()


def test_a_library_missing_a_later_required_symbol_is_refused(clean_env, stub_builds):
    clean_env.setenv(pyhccl.ENV_LIBRARY, stub_builds["nobcast"])
    with pytest.raises(CommLibraryError, match="lacks the required symbol HcclBroadcast"):
        pyhccl.load_library()


def test_override_loads_and_caches_the_stub(clean_env, stub_builds):
    clean_env.setenv(pyhccl.ENV_LIBRARY, stub_builds["full"])
    lib = pyhccl.load_library()
    assert lib.path == stub_builds["full"] and pyhccl.load_library() is lib
    assert all(lib.has(s.name) for s in pyhccl.SIGNATURES)
    assert lib.describe(21) == "HCCL_E_REMOTE (21): stub: error cqe"


def test_optional_symbols_may_be_absent(minimal_stub):
    lib = minimal_stub.lib
    for name in ("HcclSend", "HcclRecv", "HcclGetErrorString", "HcclGetCommAsyncError"):
        assert getattr(lib, name) is None and not lib.has(name)
    assert lib.describe(4) == "HCCL_E_INTERNAL (4)"
    hub = Hub(2)
    comms = on_ranks(2, lambda r: create(minimal_stub, hub.group(r)))
    data = [torch.arange(4.0), torch.zeros(4)]
    on_ranks(2, lambda r: comms[r].broadcast(data[r], 0).wait(5))
    assert torch.equal(data[1], data[0]) and comms[0].async_error() == 0
    before = len(minimal_stub.calls())
    with pytest.raises(CommLibraryError, match="has no HcclSend"):
        comms[0].send(data[0], 1)
    with pytest.raises(CommLibraryError, match="has no HcclRecv"):
        comms[1].recv(data[1], 0)
    assert len(minimal_stub.calls()) == before and not comms[0].closed
    for comm in comms:
        comm.close()


def test_create_without_torch_npu_says_so(stub):
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed here")
    except ImportError:
        pass
    with pytest.raises(CommLibraryError, match="needs torch_npu"):
        HcclCommunicator.create(Hub(1).group(0), "npu:0", 5, library=stub.lib)


# --------------------------------------------------------------------------------------------
# the communicator against the stub
# --------------------------------------------------------------------------------------------


def test_two_ranks_build_one_communicator_each_from_rank0s_root_info(stub):
    before = Communicator.created["hccl"]
    hub, runtime = Hub(2, name="weights"), FakeRuntime()
    comms = on_ranks(2, lambda r: create(stub, hub.group(r), runtime=runtime))
    assert Communicator.created["hccl"] == before + 2
    assert [(c.backend, c.group, c.rank, c.world_size) for c in comms] == [("hccl", "weights", 0, 2),
                                                                          ("hccl", "weights", 1, 2)]
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
    for dtype, code in pyhccl.HCCL_DTYPES.items():
        size = torch.empty(0, dtype=dtype).element_size() * 64
        # 64 elements at the front of a larger buffer: an overrun lands in the guard, not the heap
        sent_buf = torch.randint(0, 256, (size * 4,), dtype=torch.uint8)
        got_buf = torch.zeros(size * 4, dtype=torch.uint8)
        tensors = [sent_buf[:size].view(dtype), got_buf[:size].view(dtype)]
        on_ranks(2, lambda r, tensors=tensors: comms[r].broadcast(tensors[r], src=0).wait(5))
        assert torch.equal(got_buf[:size], sent_buf[:size]), f"{dtype}: bytes missing"
        assert not got_buf[size:].any(), f"{dtype}: bytes past the tensor were written"
        assert stub.calls("HcclBroadcast")[-1]["dtype"] == code


@pytest.mark.parametrize("op, dtype, expected", [
    (ReduceOp.SUM, torch.float32, [11.0, 22.0]), (ReduceOp.MAX, torch.float32, [10.0, 20.0]),
    (ReduceOp.MIN, torch.int32, [1, 2]), (ReduceOp.PROD, torch.int64, [10, 40]),
])
def test_all_reduce_in_place(pair, stub, op, dtype, expected):
    comms, _ = pair
    tensors = [torch.tensor([1, 2], dtype=dtype), torch.tensor([10, 20], dtype=dtype)]
    on_ranks(2, lambda r: comms[r].all_reduce(tensors[r], op).wait(5))
    assert tensors[0].tolist() == tensors[1].tolist() == expected
    call = stub.calls("HcclAllReduce")[-1]
    assert (call["op"], call["dtype"], call["count"]) == (pyhccl.HCCL_REDUCE_OPS[op], pyhccl.HCCL_DTYPES[dtype], 2)


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
    assert f"{pyhccl.RESULT_NAMES[code]} ({code}): stub: " in text
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
    assert "group 't' rank 0: hccl broadcast(src=0, 3 x torch.bfloat16) did not complete within 0.2 s" in str(info.value)
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
    with pytest.raises(CollectiveError, match=r"HCCL reported an async error: HCCL_E_REMOTE \(21\): stub: error cqe") as info:
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


# --------------------------------------------------------------------------------------------
# real hardware
# --------------------------------------------------------------------------------------------


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
