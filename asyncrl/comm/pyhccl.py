"""HCCL backend: a ctypes binding of Huawei's libhccl (Ascend NPU collectives) behind `Communicator`.

Nothing here is loaded at import: libhccl is found and bound on the first `load_library()` (or
`HcclCommunicator.create`), and torch_npu is imported only by `NpuRuntime`, so this module can be
imported and its tables checked on a machine with neither.

Facts the binding relies on (CANN ``hccl.h`` / ``hccl_types.h`` as vendored by Ascend/pytorch,
the CANN API reference, and torch_npu's ProcessGroupHCCL):

* every HCCL entry point returns ``HcclResult`` (a C enum, 0 = success); ``HcclComm`` and
  ``aclrtStream`` are opaque pointers; counts are ``uint64_t``, ranks ``uint32_t``.
* ``HcclRootInfo`` is an opaque ``char[4108]`` made by rank 0 and copied to every rank.
* HCCL has no abort. ``HcclCommSuspend``/``HcclCommResume`` exist on recent CANN but are documented
  as reserved, meant for on-chip memory (UCE) faults, and not to be run concurrently with
  collectives, so they are deliberately not used; an aborted communicator is released with
  ``HcclCommDestroy`` from a helper thread with a bounded wait (see `HcclCommunicator._release`).
* ``HcclGetCommAsyncError`` and ``HcclGetErrorString`` are documented from CANN 7.0.0 on (and not
  on Ascend 950); ``HcclSend``/``HcclRecv`` from CANN 6.0.1 on. All four are bound only if present.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.comm.communicator import Communicator, ReduceOp, Work
from asyncrl.comm.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommLibraryError,
    RendezvousError,
)

log = logging.getLogger("asyncrl.comm.hccl")

# -- library location ------------------------------------------------------------------------

ENV_LIBRARY = "ASYNCRL_HCCL_LIBRARY"
TOOLKIT_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
DEFAULT_TOOLKIT = "/usr/local/Ascend/ascend-toolkit/latest"
LIBRARY_NAME = "libhccl.so"

# -- C types (hccl_types.h) ------------------------------------------------------------------

HCCL_ROOT_INFO_BYTES = 4108

HcclResult = ctypes.c_int      # C enum: int-sized on every ABI CANN ships for
HcclDataType = ctypes.c_int    # C enum
HcclReduceOp = ctypes.c_int    # C enum
HcclComm = ctypes.c_void_p     # typedef void *HcclComm
AclrtStream = ctypes.c_void_p  # typedef void *aclrtStream


class HcclRootInfo(ctypes.Structure):
    """``struct HcclRootInfoDef { char internal[HCCL_ROOT_INFO_BYTES]; }``, opaque to us."""

    _fields_ = [("internal", ctypes.c_char * HCCL_ROOT_INFO_BYTES)]


HCCL_SUCCESS = 0
HCCL_E_TIMEOUT = 9

# HcclResult names, so an error says which one even where HcclGetErrorString is missing.
RESULT_NAMES = {
    0: "HCCL_SUCCESS", 1: "HCCL_E_PARA", 2: "HCCL_E_PTR", 3: "HCCL_E_MEMORY",
    4: "HCCL_E_INTERNAL", 5: "HCCL_E_NOT_SUPPORT", 6: "HCCL_E_NOT_FOUND", 7: "HCCL_E_UNAVAIL",
    8: "HCCL_E_SYSCALL", 9: "HCCL_E_TIMEOUT", 10: "HCCL_E_OPEN_FILE_FAILURE",
    11: "HCCL_E_TCP_CONNECT", 12: "HCCL_E_ROCE_CONNECT", 13: "HCCL_E_TCP_TRANSFER",
    14: "HCCL_E_ROCE_TRANSFER", 15: "HCCL_E_RUNTIME", 16: "HCCL_E_DRV", 17: "HCCL_E_PROFILING",
    18: "HCCL_E_CCE", 19: "HCCL_E_NETWORK", 20: "HCCL_E_AGAIN", 21: "HCCL_E_REMOTE",
    22: "HCCL_E_SUSPENDING", 23: "HCCL_E_OPRETRY_FAIL", 24: "HCCL_E_OOM",
}

# -- data types and reductions -----------------------------------------------------------------

# HcclDataType codes (hccl_types.h). 12 (INT128) and 14 (HIF8) have no torch dtype.
HCCL_INT8, HCCL_INT16, HCCL_INT32, HCCL_FP16, HCCL_FP32 = 0, 1, 2, 3, 4
HCCL_INT64, HCCL_UINT64, HCCL_UINT8, HCCL_UINT16, HCCL_UINT32 = 5, 6, 7, 8, 9
HCCL_FP64, HCCL_BFP16 = 10, 11
HCCL_FP8E4M3, HCCL_FP8E5M2, HCCL_FP8E8M0 = 15, 16, 17


def _dtype_table() -> dict[torch.dtype, int]:
    # getattr: the fp8 and wide unsigned dtypes do not exist in every torch the project allows.
    named = {
        "int8": HCCL_INT8, "int16": HCCL_INT16, "int32": HCCL_INT32, "int64": HCCL_INT64,
        "uint8": HCCL_UINT8, "uint16": HCCL_UINT16, "uint32": HCCL_UINT32, "uint64": HCCL_UINT64,
        "float16": HCCL_FP16, "float32": HCCL_FP32, "float64": HCCL_FP64, "bfloat16": HCCL_BFP16,
        # bool travels as uint8, as torch_npu's ProcessGroupHCCL does: same size, HCCL has no bool.
        "bool": HCCL_UINT8,
        # HCCL's FP8E4M3 is the finite-only "fn" variant (torch_npu and CANN's GE map it so).
        "float8_e4m3fn": HCCL_FP8E4M3, "float8_e5m2": HCCL_FP8E5M2,
        "float8_e8m0fnu": HCCL_FP8E8M0,
    }
    return {getattr(torch, n): code for n, code in named.items() if hasattr(torch, n)}


HCCL_DTYPES: dict[torch.dtype, int] = _dtype_table()

# Reductions are refused for unsigned, bool and fp8 by HCCL's own parameter check on every CANN;
# fp64/uint64 reductions are accepted only by some CANN versions and devices, so they are refused
# here too, as torch_npu does: a clear TypeError beats a device-side failure on one SoC only.
HCCL_REDUCE_DTYPES = frozenset(
    (torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16)
)

# HcclReduceOp codes (hccl_types.h).
HCCL_REDUCE_OPS: dict[ReduceOp, int] = {
    ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3,
}


def hccl_dtype(dtype: torch.dtype) -> int:
    """HCCL's code for ``dtype``; TypeError naming it when HCCL cannot carry it."""
    try:
        return HCCL_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(sorted(str(d) for d in HCCL_DTYPES))
        raise TypeError(f"hccl cannot transfer {dtype}; supported: {supported}") from None


def hccl_reduce_dtype(dtype: torch.dtype) -> int:
    """Like `hccl_dtype`, but only for dtypes HCCL can reduce."""
    if dtype not in HCCL_REDUCE_DTYPES:
        supported = ", ".join(sorted(str(d) for d in HCCL_REDUCE_DTYPES))
        raise TypeError(f"hccl cannot reduce {dtype}; reducible dtypes: {supported}")
    return hccl_dtype(dtype)


def hccl_reduce_op(op: ReduceOp) -> int:
    """HCCL's code for ``op``; TypeError for anything that is not one of our ReduceOps."""
    try:
        return HCCL_REDUCE_OPS[ReduceOp(op)]
    except (KeyError, ValueError):
        raise TypeError(f"hccl has no reduction {op!r}; use one of {[o.name for o in HCCL_REDUCE_OPS]}") from None


# -- the symbol table --------------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """One C function of libhccl: its ctypes prototype and whether the binding can live without it."""

    name: str
    restype: Any
    argtypes: tuple[Any, ...]
    required: bool


_P = ctypes.POINTER
SIGNATURES: tuple[Signature, ...] = (
    # HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo)
    Signature("HcclGetRootInfo", HcclResult, (_P(HcclRootInfo),), True),
    # HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm)
    Signature("HcclCommInitRootInfo", HcclResult,
              (ctypes.c_uint32, _P(HcclRootInfo), ctypes.c_uint32, _P(HcclComm)), True),
    # HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType, uint32_t root, HcclComm, aclrtStream)
    Signature("HcclBroadcast", HcclResult,
              (ctypes.c_void_p, ctypes.c_uint64, HcclDataType, ctypes.c_uint32, HcclComm, AclrtStream), True),
    # HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType, HcclReduceOp,
    #                          HcclComm, aclrtStream)
    Signature("HcclAllReduce", HcclResult,
              (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, HcclDataType, HcclReduceOp, HcclComm,
               AclrtStream), True),
    # HcclResult HcclCommDestroy(HcclComm comm)
    Signature("HcclCommDestroy", HcclResult, (HcclComm,), True),
    # HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType, uint32_t destRank, HcclComm, aclrtStream)
    Signature("HcclSend", HcclResult,
              (ctypes.c_void_p, ctypes.c_uint64, HcclDataType, ctypes.c_uint32, HcclComm, AclrtStream), False),
    # HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType, uint32_t srcRank, HcclComm, aclrtStream)
    Signature("HcclRecv", HcclResult,
              (ctypes.c_void_p, ctypes.c_uint64, HcclDataType, ctypes.c_uint32, HcclComm, AclrtStream), False),
    # const char *HcclGetErrorString(HcclResult code)
    Signature("HcclGetErrorString", ctypes.c_char_p, (HcclResult,), False),
    # HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *asyncError)
    Signature("HcclGetCommAsyncError", HcclResult, (HcclComm, _P(HcclResult)), False),
)


class HcclLibrary:
    """libhccl with every known function given its prototype. Required functions are attributes
    that always exist; an optional one is None where this libhccl lacks it."""

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self.path = path
        self._cdll = cdll
        for sig in SIGNATURES:
            setattr(self, sig.name, self._bind(sig))

    def _bind(self, sig: Signature) -> Any:
        # cdll[name] makes a fresh function object, so prototypes set here cannot clash with
        # anyone else's binding of the same library in this process.
        try:
            fn = self._cdll[sig.name]
        except AttributeError:
            if sig.required:
                raise CommLibraryError(
                    f"{self.path} lacks the required symbol {sig.name}: it is not libhccl, or a CANN "
                    f"too old for this binding"
                ) from None
            return None
        fn.restype = sig.restype
        fn.argtypes = list(sig.argtypes)
        return fn

    def has(self, name: str) -> bool:
        return getattr(self, name, None) is not None

    def describe(self, code: int) -> str:
        """``NAME (code): library text`` for an HcclResult, as far as this libhccl can say."""
        text = ""
        if self.HcclGetErrorString is not None:
            raw = self.HcclGetErrorString(code)
            text = raw.decode(errors="replace") if raw else ""
        head = f"{RESULT_NAMES.get(code, 'unknown HcclResult')} ({code})"
        return f"{head}: {text}" if text else head


def library_candidates() -> list[tuple[str, str]]:
    """Where libhccl is looked for, in order, as (why this place, path or bare name).

    An explicit ``$ASYNCRL_HCCL_LIBRARY`` is the only candidate: silently falling back to another
    libhccl (perhaps of another CANN than torch_npu's) would hide the configuration error."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        return [(f"${ENV_LIBRARY}", override)]
    found: list[tuple[str, str]] = []
    for var in TOOLKIT_ENV_VARS:
        if os.environ.get(var):
            found.append((f"${var}/lib64", os.path.join(os.environ[var], "lib64", LIBRARY_NAME)))
    found.append(("CANN default", os.path.join(DEFAULT_TOOLKIT, "lib64", LIBRARY_NAME)))
    found.append(("system loader path (LD_LIBRARY_PATH, ld.so.cache)", LIBRARY_NAME))
    unique = {path: where for where, path in reversed(found)}  # first mention wins
    return [(where, path) for path, where in reversed(unique.items())]


_loaded: dict[str, HcclLibrary] = {}
_load_lock = threading.Lock()


def _dlopen(path: str) -> tuple[ctypes.CDLL | None, str]:
    # A path with a slash must exist; a bare name is left to the dynamic loader's search.
    if os.sep in path and not os.path.exists(path):
        return None, "no such file"
    try:
        return ctypes.CDLL(path), ""
    except OSError as exc:
        return None, f"dlopen failed: {exc}"


def load_library() -> HcclLibrary:
    """Find, load and bind libhccl (once per path per process). CommLibraryError lists every place
    tried and why each failed, or names the missing required symbol."""
    tried = []
    with _load_lock:
        for where, path in library_candidates():
            if path in _loaded:
                return _loaded[path]
            cdll, reason = _dlopen(path)
            if cdll is None:
                tried.append(f"{where}: {path} ({reason})")
                continue
            _loaded[path] = HcclLibrary(cdll, path)
            return _loaded[path]
    raise CommLibraryError(
        f"{LIBRARY_NAME} (Huawei HCCL) could not be loaded; tried:\n  " + "\n  ".join(tried)
        + f"\nInstall the CANN toolkit and source its set_env.sh, or set {ENV_LIBRARY} to the library."
    )


# -- the device runtime (torch_npu) ------------------------------------------------------------


class NpuRuntime:
    """The few torch_npu calls the communicator makes: device binding, streams and events.

    Kept apart so the communicator's logic can be driven without an NPU (tests pass an object with
    the same methods)."""

    # aclFormat values torch_npu treats as plain layouts, whose numel() is the element count HCCL
    # must be given (ACL_FORMAT_NCHW = 0, ACL_FORMAT_ND = 2).
    PLAIN_FORMATS = (0, 2)

    def __init__(self) -> None:
        try:
            import torch_npu  # registers torch.npu
        except ImportError as exc:
            raise CommLibraryError(f"the HCCL backend needs torch_npu, which is not importable: {exc}") from exc
        self._torch_npu = torch_npu

    def normalize_device(self, device: torch.device | str | int) -> torch.device:
        # A device without an index must be pinned now: the comm is tied to one NPU for life.
        device = torch.device(device)
        if device.type != "npu":
            raise ValueError(f"the HCCL backend needs an npu device, got {device}")
        if device.index is None:
            device = torch.device("npu", torch.npu.current_device())
        return device

    def bind_device(self, device: torch.device) -> None:
        # ACL device contexts are per thread: every thread that calls HCCL must set the device.
        torch.npu.set_device(device)

    def resolve_stream(self, stream: Any, device: torch.device) -> Any:
        return stream if stream is not None else torch.npu.current_stream(device)

    def stream_handle(self, stream: Any) -> int:
        # Read right before each HCCL call, never cached: torch_npu's npu_stream getter first
        # drains its host task queue, so the ops that produced the tensor are already on the stream.
        return int(stream.npu_stream)

    def record_event(self, stream: Any) -> Any:
        event = torch.npu.Event()
        event.record(stream)
        return event

    def check_format(self, tensor: torch.Tensor, what: str) -> None:
        # A private layout (e.g. FRACTAL_NZ) has more storage elements than numel(); HCCL would
        # move a truncated buffer.
        get_format = getattr(self._torch_npu, "get_npu_format", None)
        if get_format is not None and get_format(tensor) not in self.PLAIN_FORMATS:
            raise ValueError(
                f"hccl {what}: tensor has NPU format {get_format(tensor)}; cast it to ND first "
                f"(torch_npu.npu_format_cast(t, 2))"
            )


# -- communicator creation ---------------------------------------------------------------------


def _check_group(group: Any) -> None:
    # HCCL takes ranks as uint32; catch nonsense here rather than as a wrapped-around C value.
    if not 1 <= group.world_size < 2**32 or not 0 <= group.rank < group.world_size:
        raise RendezvousError(f"group {group.name!r}: bad rank {group.rank} / world size {group.world_size}")


def _make_root_info(lib: HcclLibrary, group: Any) -> HcclRootInfo:
    """Rank 0 asks HCCL for the root info; on failure it still broadcasts an empty payload, so the
    other ranks fail at once instead of waiting out the rendezvous timeout."""
    root = HcclRootInfo()
    rc = lib.HcclGetRootInfo(ctypes.byref(root))
    if rc != HCCL_SUCCESS:
        group.broadcast_obj(b"", src=0, type=bytes)
        raise CollectiveError(f"group {group.name!r} rank 0: HcclGetRootInfo failed: {lib.describe(rc)}")
    group.broadcast_obj(bytes(root), src=0, type=bytes)
    return root


def _receive_root_info(group: Any) -> HcclRootInfo:
    data = group.broadcast_obj(None, src=0, type=bytes)
    if len(data) != HCCL_ROOT_INFO_BYTES:
        why = "rank 0 could not create it (see its error)" if not data else f"{len(data)} bytes"
        raise RendezvousError(
            f"group {group.name!r} rank {group.rank}: bad HCCL root info from rank 0: {why}, "
            f"expected {HCCL_ROOT_INFO_BYTES} bytes"
        )
    return HcclRootInfo.from_buffer_copy(data)


def _exchange_root_info(lib: HcclLibrary, group: Any) -> HcclRootInfo:
    return _make_root_info(lib, group) if group.rank == 0 else _receive_root_info(group)


class _InitCall:
    """One HcclCommInitRootInfo call on a worker thread. It blocks until every rank has arrived, so
    the caller may give up first; a communicator the call builds after that is destroyed at once
    rather than leaked."""

    def __init__(self, lib: HcclLibrary, runtime: Any, device: torch.device, group: Any, root: HcclRootInfo):
        self._lib, self._runtime, self._device, self._group, self._root = lib, runtime, device, group, root
        self._lock = threading.Lock()
        self._abandoned = False
        self.finished = threading.Event()
        self.rc: int | None = None
        self.handle: int | None = None
        self.exc: BaseException | None = None

    def start(self) -> None:
        name = f"hccl-init-{self._group.name}-r{self._group.rank}"
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        comm, rc, exc = HcclComm(), None, None
        try:
            self._runtime.bind_device(self._device)
            rc = self._lib.HcclCommInitRootInfo(
                self._group.world_size, ctypes.byref(self._root), self._group.rank, ctypes.byref(comm))
        except BaseException as e:  # noqa: BLE001  (handed to the creating thread, which raises it)
            exc = e
        self._settle(rc, comm.value, exc)

    def _settle(self, rc: int | None, handle: int | None, exc: BaseException | None) -> None:
        with self._lock:
            self.rc, self.handle, self.exc = rc, handle, exc
            orphan = self._abandoned and rc == HCCL_SUCCESS and handle
            self.finished.set()
        if orphan:
            log.warning("group %r rank %d: HcclCommInitRootInfo returned after the caller gave up; "
                        "destroying that communicator", self._group.name, self._group.rank)
            self._lib.HcclCommDestroy(handle)

    def abandon(self) -> bool:
        """Give up on the call; False if it finished meanwhile (its result is then valid)."""
        with self._lock:
            if self.finished.is_set():
                return False
            self._abandoned = True
            return True


def _init_comm(lib: HcclLibrary, runtime: Any, device: torch.device, group: Any, root: HcclRootInfo,
               timeout_s: float) -> int:
    """Run HcclCommInitRootInfo under a deadline and return the comm handle."""
    call = _InitCall(lib, runtime, device, group, root)
    call.start()
    if not call.finished.wait(timeout_s) and call.abandon():
        raise CollectiveTimeoutError(
            f"group {group.name!r} rank {group.rank}: HcclCommInitRootInfo (world size {group.world_size}) "
            f"did not return within {timeout_s:g} s: a member is missing or unreachable. Its thread may "
            f"linger until HCCL gives up after HCCL_CONNECT_TIMEOUT (default 120 s); a communicator "
            f"it builds after this is destroyed at once"
        )
    if call.exc is not None:
        raise call.exc
    if call.rc != HCCL_SUCCESS:
        cls = CollectiveTimeoutError if call.rc == HCCL_E_TIMEOUT else CollectiveError
        raise cls(f"group {group.name!r} rank {group.rank}: HcclCommInitRootInfo failed: {lib.describe(call.rc)}")
    if not call.handle:
        raise CollectiveError(f"group {group.name!r} rank {group.rank}: HcclCommInitRootInfo returned no communicator")
    return call.handle


# -- work ----------------------------------------------------------------------------------------

_POLL_MIN_S = 50e-6        # first pause: a small broadcast is often done within microseconds
_POLL_MAX_S = 5e-3         # pause cap: bounds how late a completion is noticed
_ASYNC_CHECK_EVERY_S = 0.1  # HcclGetCommAsyncError is a synchronous host call; don't spin on it


class _DoneWork(Work):
    """Work that needed no device op (an empty tensor): nothing to wait for."""

    def wait(self, timeout_s: float) -> None:
        return None

    def done(self) -> bool:
        return True


class HcclWork(Work):
    """One enqueued HCCL op: an NPU event recorded after it on the same stream, polled with a
    bounded backoff, plus HCCL's async-error query where the library has one."""

    def __init__(self, comm: HcclCommunicator, what: str, event: Any, keep_alive: tuple[torch.Tensor, ...]):
        self._comm = comm
        self._what = what
        self._event = event
        # The device reads/writes these until the event fires; holding them stops the caching
        # allocator from handing their memory to someone else mid-collective.
        self._keep_alive = keep_alive
        self._complete = False
        self._error: BaseException | None = None
        self._next_async_check = 0.0

    def done(self) -> bool:
        if self._complete or self._error is not None or self._comm.closed:
            return True
        try:
            return bool(self._event.query())
        except Exception:  # noqa: BLE001  (a device error: the op is over, wait() reports it)
            return True

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = _POLL_MIN_S
        while not self._step():
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(CollectiveTimeoutError, f"did not complete within {timeout_s:g} s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)

    def _step(self) -> bool:
        """True once complete; raises the (stored) error if the op failed."""
        if self._error is not None:
            raise self._error
        if self._complete:
            return True
        if self._comm.closed:
            self._fail(CollectiveError, f"communicator was {self._comm.closed_reason} while it was outstanding")
        finished = self._query_event()
        self._check_async_error(force=finished)
        if finished:
            self._complete = True
            self._keep_alive = ()
        return finished

    def _query_event(self) -> bool:
        try:
            return bool(self._event.query())
        except Exception as exc:  # noqa: BLE001  (whatever torch_npu raises, the op failed)
            self._fail(CollectiveError, f"the device reported an error: {exc}", cause=exc)

    def _check_async_error(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now < self._next_async_check:
            return
        self._next_async_check = now + _ASYNC_CHECK_EVERY_S
        code = self._comm.async_error()
        if code != HCCL_SUCCESS:
            cls = CollectiveTimeoutError if code == HCCL_E_TIMEOUT else CollectiveError
            self._fail(cls, f"HCCL reported an async error: {self._comm.describe(code)}")

    def _fail(self, cls: type[CollectiveError], why: str, cause: BaseException | None = None) -> None:
        comm = self._comm
        self._error = cls(f"group {comm.group!r} rank {comm.rank}: hccl {self._what} {why}; "
                          f"communicator aborted")
        self._error.__cause__ = cause
        comm.adopt_orphans(self._keep_alive)
        self._keep_alive = ()
        comm.abort(f"aborted after {self._what} failed")
        raise self._error


# -- the communicator ------------------------------------------------------------------------------


class HcclCommunicator(Communicator):
    """A fixed group of Ascend NPUs exchanging tensors through libhccl. Build it with `create`."""

    backend = "hccl"
    # How long close()/abort() wait for HcclCommDestroy before leaving it to finish in the background:
    # HCCL has no abort, and destroying a comm whose kernel waits on a dead peer may block.
    release_grace_s = 10.0

    def __init__(self, *, lib: HcclLibrary, runtime: Any, handle: int, group: str, rank: int,
                 world_size: int, device: torch.device):
        self._lib = lib
        self._runtime = runtime
        self._handle: int | None = handle
        # Serialises launches, async-error queries and release, so HcclCommDestroy can never run
        # while another thread is inside an HCCL call on the same handle.
        self._lock = threading.Lock()
        self._async_query_ok = lib.has("HcclGetCommAsyncError")
        self._orphans: list[torch.Tensor] = []
        super().__init__(group=group, rank=rank, world_size=world_size, device=device)

    @classmethod
    def create(cls, group: Any, device: torch.device | str | int, timeout_s: float, *,
               library: HcclLibrary | None = None, runtime: Any = None) -> HcclCommunicator:
        """Build the communicator of ``group`` on ``device``: rank 0's root info goes to every rank
        through ``group.broadcast_obj``, then every rank joins in HcclCommInitRootInfo, which must
        finish within ``timeout_s`` (else CollectiveTimeoutError). This binds the calling thread to
        ``device``. ``library``/``runtime`` default to `load_library()` and `NpuRuntime()`."""
        _check_group(group)
        lib = library if library is not None else load_library()
        runtime = runtime if runtime is not None else NpuRuntime()
        device = runtime.normalize_device(device)
        runtime.bind_device(device)
        root = _exchange_root_info(lib, group)
        handle = _init_comm(lib, runtime, device, group, root, timeout_s)
        return cls(lib=lib, runtime=runtime, handle=handle, group=group.name, rank=group.rank,
                   world_size=group.world_size, device=device)

    # -- operations ------------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int, *, stream: Any = None,
                  timeout_s: float | None = None) -> Work:
        what = f"broadcast(src={src}, {tensor.numel()} x {tensor.dtype})"
        self._check_args(tensor, what, src)
        dtype, ptr = hccl_dtype(tensor.dtype), tensor.data_ptr()
        return self._launch(what, (tensor,), stream, lambda comm, s: self._lib.HcclBroadcast(
            ptr, tensor.numel(), dtype, src, comm, s))

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, stream: Any = None,
                  timeout_s: float | None = None) -> Work:
        what = f"all_reduce({getattr(op, 'name', op)}, {tensor.numel()} x {tensor.dtype})"
        self._check_args(tensor, what)
        dtype, code, ptr = hccl_reduce_dtype(tensor.dtype), hccl_reduce_op(op), tensor.data_ptr()
        # In place (send buffer = receive buffer), as torch_npu's ProcessGroupHCCL calls it.
        return self._launch(what, (tensor,), stream, lambda comm, s: self._lib.HcclAllReduce(
            ptr, ptr, tensor.numel(), dtype, code, comm, s))

    def send(self, tensor: torch.Tensor, dst: int, *, stream: Any = None,
                  timeout_s: float | None = None) -> Work:
        what = f"send(dst={dst}, {tensor.numel()} x {tensor.dtype})"
        self._check_p2p(tensor, what, dst, "HcclSend")
        dtype, ptr = hccl_dtype(tensor.dtype), tensor.data_ptr()
        return self._launch(what, (tensor,), stream, lambda comm, s: self._lib.HcclSend(
            ptr, tensor.numel(), dtype, dst, comm, s))

    def recv(self, tensor: torch.Tensor, src: int, *, stream: Any = None,
                  timeout_s: float | None = None) -> Work:
        what = f"recv(src={src}, {tensor.numel()} x {tensor.dtype})"
        self._check_p2p(tensor, what, src, "HcclRecv")
        dtype, ptr = hccl_dtype(tensor.dtype), tensor.data_ptr()
        return self._launch(what, (tensor,), stream, lambda comm, s: self._lib.HcclRecv(
            ptr, tensor.numel(), dtype, src, comm, s))

    # -- helpers of the operations ---------------------------------------------------------------

    def _check_args(self, tensor: torch.Tensor, what: str, peer: int | None = None) -> None:
        self._check_open(what)
        self._check_tensor(tensor, what)
        self._runtime.check_format(tensor, what)
        if peer is not None and not 0 <= peer < self.world_size:
            raise ValueError(f"hccl {what}: rank {peer} is outside the group of {self.world_size}")

    def _check_p2p(self, tensor: torch.Tensor, what: str, peer: int, symbol: str) -> None:
        self._check_args(tensor, what, peer)
        if peer == self.rank:
            raise ValueError(f"hccl {what}: rank {self.rank} cannot exchange with itself")
        if not self._lib.has(symbol):
            raise CommLibraryError(f"{self._lib.path} has no {symbol} (CANN older than 6.0.1?)")

    def _launch(self, what: str, keep_alive: tuple[torch.Tensor, ...], stream: Any, call: Any) -> Work:
        """Enqueue ``call(comm_handle, stream_handle)`` and return its Work. A library error aborts
        the communicator: the peers have enqueued their half and will wait on us forever."""
        if keep_alive[0].numel() == 0:
            return _DoneWork()  # same shape on every rank, so every rank skips it alike
        stream = self._runtime.resolve_stream(stream, self.device)
        with self._lock:
            self._check_open(what)  # again, under the lock: an abort may have raced us
            rc = call(self._handle, self._runtime.stream_handle(stream))
            event = self._runtime.record_event(stream) if rc == HCCL_SUCCESS else None
        if rc != HCCL_SUCCESS:
            self._fail_launch(what, rc)
        return HcclWork(self, what, event, keep_alive)

    def _fail_launch(self, what: str, rc: int) -> None:
        self.abort(f"aborted after {what} failed to launch")
        cls = CollectiveTimeoutError if rc == HCCL_E_TIMEOUT else CollectiveError
        raise cls(f"group {self.group!r} rank {self.rank}: hccl {what} failed: {self._lib.describe(rc)}; "
                  f"communicator aborted")

    # -- what Work needs -------------------------------------------------------------------------

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

    def describe(self, code: int) -> str:
        return self._lib.describe(code)

    def async_error(self) -> int:
        """HCCL's pending async error of this comm (HCCL_SUCCESS if none, or if it cannot tell)."""
        if not self._async_query_ok:
            return HCCL_SUCCESS
        # Never wait behind a launch or a release: the next poll will ask again.
        if not self._lock.acquire(timeout=0.05):
            return HCCL_SUCCESS
        try:
            if self._handle is None:
                return HCCL_SUCCESS
            err = HcclResult(HCCL_SUCCESS)
            rc = self._lib.HcclGetCommAsyncError(self._handle, ctypes.byref(err))
        finally:
            self._lock.release()
        return self._async_result(rc, err.value)

    def _async_result(self, rc: int, err: int) -> int:
        # A failing query (e.g. HCCL_E_NOT_SUPPORT on a device without it) says nothing about the
        # collective: stop asking rather than abort a healthy communicator.
        if rc != HCCL_SUCCESS:
            self._async_query_ok = False
            log.info("group %r rank %d: HcclGetCommAsyncError unusable (%s); relying on events only",
                     self.group, self.rank, self._lib.describe(rc))
            return HCCL_SUCCESS
        return err

    def adopt_orphans(self, tensors: tuple[torch.Tensor, ...]) -> None:
        # A failed op's kernel may still write into these; keep their memory out of the allocator's
        # hands for as long as this communicator object lives.
        self._orphans.extend(tensors)

    # -- lifetime --------------------------------------------------------------------------------

    def _abort(self) -> None:
        self._release()

    def _destroy(self) -> None:
        self._release()

    def _release(self) -> None:
        """HcclCommDestroy the handle, waiting at most ``release_grace_s``: close/abort must not hang
        behind a kernel that waits on a dead peer. Runs once (the base class guards re-entry)."""
        deadline = time.monotonic() + self.release_grace_s
        handle = self._take_handle()
        if handle is None:
            return
        name = f"hccl-destroy-{self.group}-r{self.rank}"
        worker = threading.Thread(target=self._destroy_handle, args=(handle,), name=name, daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            log.warning("group %r rank %d: HcclCommDestroy still running after %g s; left to finish in "
                        "the background", self.group, self.rank, self.release_grace_s)

    def _take_handle(self) -> int | None:
        if not self._lock.acquire(timeout=self.release_grace_s):
            log.warning("group %r rank %d: an HCCL call did not return within %g s; the communicator "
                        "handle is leaked rather than destroyed under it", self.group, self.rank,
                        self.release_grace_s)
            return None
        try:
            handle, self._handle = self._handle, None
            return handle
        finally:
            self._lock.release()

    def _destroy_handle(self, handle: int) -> None:
        rc = self._lib.HcclCommDestroy(handle)
        if rc != HCCL_SUCCESS:
            log.warning("group %r rank %d: HcclCommDestroy failed: %s", self.group, self.rank,
                        self._lib.describe(rc))
