"""libhccl, Huawei's collective library for Ascend NPUs: where it is found, its C types and codes,
and its function table, bound through `asyncrl.comm.ctypes_table`. The communicator built on it is
`asyncrl.comm.pyhccl.HcclCommunicator`.

Nothing here is loaded at import: libhccl is found and bound on the first `load_library()`, and
torch_npu is never imported here, so this module can be imported and its tables checked on a
machine with neither.

Facts the binding relies on (CANN ``hccl.h`` / ``hccl_types.h`` as vendored by Ascend/pytorch,
the CANN API reference, and torch_npu's ProcessGroupHCCL):

* every HCCL entry point returns ``HcclResult`` (a C enum, 0 = success); ``HcclComm`` and
  ``aclrtStream`` are opaque pointers; counts are ``uint64_t``, ranks ``uint32_t``.
* ``HcclRootInfo`` is an opaque ``char[4108]`` made by rank 0 and copied to every rank.
* ``HcclGetCommAsyncError`` and ``HcclGetErrorString`` are documented from CANN 7.0.0 on (and not
  on Ascend 950); ``HcclSend``/``HcclRecv`` from CANN 6.0.1 on. All four are optional in the table.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from asyncrl.comm.communicator import ReduceOp
from asyncrl.comm.ctypes_table import CLibrary, Function
from asyncrl.comm.errors import CommLibraryError

# -- library location ------------------------------------------------------------------------

ENV_LIBRARY = "ASYNCRL_HCCL_LIBRARY"
TOOLKIT_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
DEFAULT_TOOLKIT = "/usr/local/Ascend/ascend-toolkit/latest"
LIBRARY_NAME = "libhccl.so"

# -- C types (hccl_types.h) ------------------------------------------------------------------

HCCL_ROOT_INFO_BYTES = 4108

HcclResult = ctypes.c_int  # C enum: int-sized on every ABI CANN ships for
HcclDataType = ctypes.c_int  # C enum
HcclReduceOp = ctypes.c_int  # C enum
HcclComm = ctypes.c_void_p  # typedef void *HcclComm
AclrtStream = ctypes.c_void_p  # typedef void *aclrtStream


class HcclRootInfo(ctypes.Structure):
    """``struct HcclRootInfoDef { char internal[HCCL_ROOT_INFO_BYTES]; }``, opaque to us."""

    _fields_ = [("internal", ctypes.c_char * HCCL_ROOT_INFO_BYTES)]


HCCL_SUCCESS = 0
HCCL_E_TIMEOUT = 9

# HcclResult names, so an error says which one even where HcclGetErrorString is missing.
RESULT_NAMES = {
    0: "HCCL_SUCCESS",
    1: "HCCL_E_PARA",
    2: "HCCL_E_PTR",
    3: "HCCL_E_MEMORY",
    4: "HCCL_E_INTERNAL",
    5: "HCCL_E_NOT_SUPPORT",
    6: "HCCL_E_NOT_FOUND",
    7: "HCCL_E_UNAVAIL",
    8: "HCCL_E_SYSCALL",
    9: "HCCL_E_TIMEOUT",
    10: "HCCL_E_OPEN_FILE_FAILURE",
    11: "HCCL_E_TCP_CONNECT",
    12: "HCCL_E_ROCE_CONNECT",
    13: "HCCL_E_TCP_TRANSFER",
    14: "HCCL_E_ROCE_TRANSFER",
    15: "HCCL_E_RUNTIME",
    16: "HCCL_E_DRV",
    17: "HCCL_E_PROFILING",
    18: "HCCL_E_CCE",
    19: "HCCL_E_NETWORK",
    20: "HCCL_E_AGAIN",
    21: "HCCL_E_REMOTE",
    22: "HCCL_E_SUSPENDING",
    23: "HCCL_E_OPRETRY_FAIL",
    24: "HCCL_E_OOM",
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
        "int8": HCCL_INT8,
        "int16": HCCL_INT16,
        "int32": HCCL_INT32,
        "int64": HCCL_INT64,
        "uint8": HCCL_UINT8,
        "uint16": HCCL_UINT16,
        "uint32": HCCL_UINT32,
        "uint64": HCCL_UINT64,
        "float16": HCCL_FP16,
        "float32": HCCL_FP32,
        "float64": HCCL_FP64,
        "bfloat16": HCCL_BFP16,
        # bool travels as uint8, as torch_npu's ProcessGroupHCCL does: same size, HCCL has no bool.
        "bool": HCCL_UINT8,
        # HCCL's FP8E4M3 is the finite-only "fn" variant (torch_npu and CANN's GE map it so).
        "float8_e4m3fn": HCCL_FP8E4M3,
        "float8_e5m2": HCCL_FP8E5M2,
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
    ReduceOp.SUM: 0,
    ReduceOp.PROD: 1,
    ReduceOp.MAX: 2,
    ReduceOp.MIN: 3,
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


# -- the function table (hccl.h) ---------------------------------------------------------------

_P = ctypes.POINTER
HCCL_FUNCTIONS: tuple[Function, ...] = (
    # HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo)
    Function("HcclGetRootInfo", HcclResult, (_P(HcclRootInfo),)),
    # HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm)
    Function("HcclCommInitRootInfo", HcclResult, (ctypes.c_uint32, _P(HcclRootInfo), ctypes.c_uint32, _P(HcclComm))),
    # HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType, uint32_t root, HcclComm, aclrtStream)
    Function(
        "HcclBroadcast",
        HcclResult,
        (ctypes.c_void_p, ctypes.c_uint64, HcclDataType, ctypes.c_uint32, HcclComm, AclrtStream),
    ),
    # HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType, HcclReduceOp,
    #                          HcclComm, aclrtStream)
    Function(
        "HcclAllReduce",
        HcclResult,
        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, HcclDataType, HcclReduceOp, HcclComm, AclrtStream),
    ),
    # HcclResult HcclCommDestroy(HcclComm comm)
    Function("HcclCommDestroy", HcclResult, (HcclComm,)),
    # HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType, uint32_t destRank, HcclComm, aclrtStream)
    Function(
        "HcclSend",
        HcclResult,
        (ctypes.c_void_p, ctypes.c_uint64, HcclDataType, ctypes.c_uint32, HcclComm, AclrtStream),
        required=False,
    ),
    # HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType, uint32_t srcRank, HcclComm, aclrtStream)
    Function(
        "HcclRecv",
        HcclResult,
        (ctypes.c_void_p, ctypes.c_uint64, HcclDataType, ctypes.c_uint32, HcclComm, AclrtStream),
        required=False,
    ),
    # const char *HcclGetErrorString(HcclResult code)
    Function("HcclGetErrorString", ctypes.c_char_p, (HcclResult,), required=False),
    # HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult *asyncError)
    Function("HcclGetCommAsyncError", HcclResult, (HcclComm, _P(HcclResult)), required=False),
)


class HcclLibrary(CLibrary):
    """libhccl with every function of `HCCL_FUNCTIONS` bound as an attribute. Required functions
    always exist; an optional one is None where this libhccl lacks it."""

    functions = HCCL_FUNCTIONS
    missing_hint = "it is not libhccl, or a CANN too old for this binding"

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
        f"{LIBRARY_NAME} (Huawei HCCL) could not be loaded; tried:\n  "
        + "\n  ".join(tried)
        + f"\nInstall the CANN toolkit and source its set_env.sh, or set {ENV_LIBRARY} to the library."
    )
