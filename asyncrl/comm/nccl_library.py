"""libnccl, NVIDIA's collective library: where it is found, its types and codes, and its function
table, bound through `asyncrl.comm.ctypes_table`. The communicator built on it is
`asyncrl.comm.pynccl.NcclCommunicator`.

Nothing is loaded at import: `load_library()` finds and binds libnccl once per process. NCCL >=
2.14 is required, for non-blocking communicators (``ncclConfig_t.blocking = 0``).

The idea of a thin ctypes wrapper over libnccl comes from vLLM's ``pynccl``; the code is ours.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from asyncrl.comm.communicator import ReduceOp
from asyncrl.comm.ctypes_table import CLibrary, Function
from asyncrl.comm.errors import CollectiveError, CommLibraryError

ENV_LIBRARY = "ASYNCRL_NCCL_LIBRARY"

SUCCESS, IN_PROGRESS = 0, 7
_RESULTS = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}

# ncclDataType_t. bool travels as its bytes.
DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.bool: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
if hasattr(torch, "uint32"):
    DTYPES.update({torch.uint32: 3, torch.uint64: 5})
if hasattr(torch, "float8_e4m3fn"):  # NCCL >= 2.19
    DTYPES.update({torch.float8_e4m3fn: 10, torch.float8_e5m2: 11})

REDUCE_OPS = {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}

UNIQUE_ID_BYTES = 128
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_UNDEF_INT = -(2**31)


def _nccl_version_code(major: int, minor: int, patch: int) -> int:
    return major * 1000 + minor * 100 + patch if (major, minor) <= (2, 8) else major * 10000 + minor * 100 + patch


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """The leading fields of ``ncclConfig_t`` as of NCCL 2.17. The struct is versioned and
    append-only: NCCL reads ``size`` bytes and defaults every later field, so a prefix is valid."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]

    @classmethod
    def non_blocking(cls) -> Config:
        undef = _CONFIG_UNDEF_INT
        return cls(ctypes.sizeof(cls), _CONFIG_MAGIC, _nccl_version_code(2, 17, 0), 0, undef, undef, undef, None, undef)


_comm_t, _stream_t, _ptr = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
_int, _size = ctypes.c_int, ctypes.c_size_t
_P = ctypes.POINTER
# Every NCCL call returns ncclResult_t (an int-sized enum) unless said otherwise.
NCCL_FUNCTIONS: tuple[Function, ...] = (
    # ncclResult_t ncclGetVersion(int *version)
    Function("ncclGetVersion", _int, (_P(_int),)),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId)
    Function("ncclGetUniqueId", _int, (_P(UniqueId),)),
    # ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
    #                                     ncclConfig_t *config)
    Function("ncclCommInitRankConfig", _int, (_P(_comm_t), _int, UniqueId, _int, _P(Config))),
    # ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError)
    Function("ncclCommGetAsyncError", _int, (_comm_t, _P(_int))),
    # ncclResult_t ncclCommAbort(ncclComm_t comm)
    Function("ncclCommAbort", _int, (_comm_t,)),
    # const char *ncclGetErrorString(ncclResult_t result)
    Function("ncclGetErrorString", ctypes.c_char_p, (_int,)),
    # ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t, int root,
    #                            ncclComm_t, cudaStream_t)
    Function("ncclBroadcast", _int, (_ptr, _ptr, _size, _int, _int, _comm_t, _stream_t)),
    # ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t, ncclRedOp_t,
    #                            ncclComm_t, cudaStream_t)
    Function("ncclAllReduce", _int, (_ptr, _ptr, _size, _int, _int, _comm_t, _stream_t)),
    # ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t, int peer, ncclComm_t, cudaStream_t)
    Function("ncclSend", _int, (_ptr, _size, _int, _int, _comm_t, _stream_t)),
    # ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t, int peer, ncclComm_t, cudaStream_t)
    Function("ncclRecv", _int, (_ptr, _size, _int, _int, _comm_t, _stream_t)),
)


def library_candidates() -> list[str]:
    """Where libnccl is looked for, in order. The override, when set, is the only candidate: a
    misconfigured path should fail loudly, not fall back to another NCCL."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        return [override]
    found = []
    site = Path(torch.__file__).resolve().parent.parent  # the nvidia-nccl-cu* wheel sits beside torch
    for wheel_lib in sorted(site.glob("nvidia/nccl*/lib/libnccl.so*")):
        found.append(str(wheel_lib))
    found.append("libnccl.so.2")  # the system loader path
    return found


class NcclLibrary(CLibrary):
    """libnccl at ``path`` with every function of `NCCL_FUNCTIONS` bound as an attribute. Load once
    per process with `load_library()`."""

    functions = NCCL_FUNCTIONS
    missing_hint = "NCCL >= 2.14 is required"

    def __init__(self, path: str):
        try:
            cdll = ctypes.CDLL(path)
        except OSError as exc:
            raise CommLibraryError(f"cannot load libnccl from {path!r}: {exc}") from exc
        super().__init__(cdll, path)
        code = _int()
        self.check(self.ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
        self.version_code = code.value
        if self.version_code < _nccl_version_code(2, 14, 0):
            raise CommLibraryError(f"{path} is NCCL {self.version}; non-blocking communicators need >= 2.14")

    @property
    def version(self) -> str:
        code = self.version_code
        major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
        minor, patch = divmod(rest, 100)
        return f"{major}.{minor}.{patch}"

    def error_string(self, result: int) -> str:
        raw = self.ncclGetErrorString(result)
        return f"{_RESULTS.get(result, result)} ({raw.decode(errors='replace') if raw else '?'})"

    def check(self, result: int, what: str) -> int:
        if result not in (SUCCESS, IN_PROGRESS):
            raise CollectiveError(f"{what} failed: {self.error_string(result)}")
        return result


_LIBRARY: NcclLibrary | None = None


def load_library() -> NcclLibrary:
    global _LIBRARY
    if _LIBRARY is None:
        errors = []
        for candidate in library_candidates():
            try:
                _LIBRARY = NcclLibrary(candidate)
                break
            except CommLibraryError as exc:
                errors.append(str(exc))
        else:
            raise CommLibraryError("libnccl not found; set ASYNCRL_NCCL_LIBRARY. Tried:\n  " + "\n  ".join(errors))
    return _LIBRARY
