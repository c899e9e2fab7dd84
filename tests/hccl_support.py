"""The stand-ins the HCCL tests (tests/test_pyhccl_*.py) drive the binding with, on a machine
without Ascend hardware: a stub libhccl compiled here from C (skipped where no C compiler exists),
an in-process rendezvous group, and a fake of torch_npu's streams and events.

The stub exports the HCCL functions with the prototypes of CANN's hccl.h, records every call, and
really moves bytes between in-process ranks (CPU tensors, one thread per rank), so a wrong count,
dtype code, root or pointer shows up as wrong data, not only as a wrong record. What it cannot
stand in for is the NPU runtime (streams, events), which `FakeRuntime` replaces.

Test modules load this one as a plugin (``pytest_plugins = ["hccl_support"]``) for its fixtures, so
the session-scoped stub build runs once however many of them run.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading

import msgspec
import pytest
import torch

from asyncrl.comm.errors import RendezvousError
from asyncrl.comm.hccl_library import HcclLibrary
from asyncrl.comm.pyhccl import HcclCommunicator
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
    _fields_ = [
        ("fn", ctypes.c_char * 32),
        ("rank", ctypes.c_uint32),
        ("nranks", ctypes.c_uint32),
        ("count", ctypes.c_uint64),
        ("dtype", ctypes.c_int32),
        ("op", ctypes.c_int32),
        ("peer", ctypes.c_uint32),
        ("stream", ctypes.c_uint64),
        ("buf", ctypes.c_uint64),
    ]


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
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread", *flags, "-o", str(out), str(src)],
            check=True,
            capture_output=True,
            text=True,
        )
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
