"""NCCL backend: `NcclCommunicator`, a fixed group of CUDA devices with a non-blocking libnccl communicator.

Why not `torch.distributed`'s NCCL backend: it wants the global default group or a store-backed
group per membership, and its watchdog takes the whole process down (or hangs for minutes) when a
peer dies. Here the communicator is created with ``blocking = 0`` (NCCL >= 2.14), so no NCCL call
ever blocks the caller: initialisation and every enqueued operation are driven to completion by
polling ``ncclCommGetAsyncError`` and a CUDA event under a deadline, and on a deadline or a peer
failure the communicator is aborted with ``ncclCommAbort``, which also makes any kernel spinning on
the dead peer return. NCCL offers no waitable handle for either condition, so polling with a short,
growing sleep is the documented way.

The library itself (its search, types, codes and function table) is `asyncrl.comm.nccl_library`.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, NoReturn

import torch

from asyncrl.comm.communicator import Communicator, ReduceOp, Work, cuda_stream
from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError, RendezvousError
from asyncrl.comm.nccl_library import (
    DTYPES,
    IN_PROGRESS,
    REDUCE_OPS,
    SUCCESS,
    UNIQUE_ID_BYTES,
    Config,
    NcclLibrary,
    UniqueId,
    load_library,
)


class NcclWork(Work):
    """Completion of everything enqueued on ``stream`` up to this point."""

    def __init__(self, comm: NcclCommunicator, stream: torch.cuda.Stream, what: str):
        self._comm = comm
        self._what = what
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def done(self) -> bool:
        return self._event.query()

    def wait(self, timeout_s: float) -> None:
        self._comm._drive(lambda: self._event.query(), timeout_s, self._what)


class NcclCommunicator(Communicator):
    backend = "nccl"
    SPIN_S = 2e-3
    MAX_PAUSE_S = 200e-6

    def __init__(
        self,
        lib: NcclLibrary,
        handle: ctypes.c_void_p,
        *,
        group: str,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
    ):
        self._lib = lib
        self._handle: ctypes.c_void_p | None = handle
        self.timeout_s = timeout_s
        super().__init__(group=group, rank=rank, world_size=world_size, device=device)

    @classmethod
    def create(cls, group, device: torch.device | int | str | None = None, timeout_s: float = 60.0) -> NcclCommunicator:
        """Create the communicator of ``group`` (a `StoreGroup`; every member calls this together)
        on ``device`` (default: the current CUDA device). Rank 0 makes the unique id and shares it
        through the store; initialisation is non-blocking and bounded by ``timeout_s``."""
        lib = load_library()
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NCCL needs a CUDA device, got {device}")
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        unique = UniqueId()
        if group.rank == 0:
            lib.check(lib.ncclGetUniqueId(ctypes.byref(unique)), "ncclGetUniqueId")
        raw = group.broadcast_obj(
            bytes(unique.internal) if group.rank == 0 else None,
            src=0,
            type=bytes,
            timeout_s=timeout_s,
            what="the NCCL unique id",
        )
        if len(raw) != UNIQUE_ID_BYTES:
            raise RendezvousError(f"group {group.label!r}: NCCL unique id has {len(raw)} bytes, not {UNIQUE_ID_BYTES}")
        ctypes.memmove(unique.internal, raw, UNIQUE_ID_BYTES)
        handle = ctypes.c_void_p()
        config = Config.non_blocking()
        result = lib.ncclCommInitRankConfig(
            ctypes.byref(handle), group.world_size, unique, group.rank, ctypes.byref(config)
        )
        comm = cls(
            lib,
            handle,
            group=group.label,
            rank=group.rank,
            world_size=group.world_size,
            device=device,
            timeout_s=timeout_s,
        )
        try:
            lib.check(result, "ncclCommInitRankConfig")
            comm._drive(lambda: True, timeout_s, "communicator initialisation")
        except CollectiveError:
            comm.abort("failed to initialise")
            raise
        return comm

    # -- operations ---------------------------------------------------------------------------
    def broadcast(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        stream = self._prepare(tensor, "broadcast", stream)
        ptr = tensor.data_ptr()
        return self._enqueue(
            f"broadcast from rank {src}",
            stream,
            timeout_s,
            self._lib.ncclBroadcast,
            ptr,
            ptr,
            tensor.numel(),
            _dtype_code(tensor),
            src,
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.Stream | None = None,
        timeout_s: float | None = None,
    ) -> Work:
        stream = self._prepare(tensor, "all_reduce", stream)
        if tensor.dtype == torch.bool:
            raise TypeError("all_reduce of bool tensors is not supported")
        ptr = tensor.data_ptr()
        return self._enqueue(
            f"all_reduce({ReduceOp(op).name})",
            stream,
            timeout_s,
            self._lib.ncclAllReduce,
            ptr,
            ptr,
            tensor.numel(),
            _dtype_code(tensor),
            REDUCE_OPS[ReduceOp(op)],
        )

    def send(
        self, tensor: torch.Tensor, dst: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        stream = self._prepare(tensor, "send", stream)
        return self._enqueue(
            f"send to rank {dst}",
            stream,
            timeout_s,
            self._lib.ncclSend,
            tensor.data_ptr(),
            tensor.numel(),
            _dtype_code(tensor),
            dst,
        )

    def recv(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        stream = self._prepare(tensor, "recv", stream)
        return self._enqueue(
            f"recv from rank {src}",
            stream,
            timeout_s,
            self._lib.ncclRecv,
            tensor.data_ptr(),
            tensor.numel(),
            _dtype_code(tensor),
            src,
        )

    # -- internals ----------------------------------------------------------------------------
    def _prepare(self, tensor: torch.Tensor, what: str, stream: torch.Stream | None) -> torch.cuda.Stream:
        self._check_open(what)
        self._check_tensor(tensor, what)
        return cuda_stream(stream, self.device)

    def _enqueue(self, what: str, stream: torch.cuda.Stream, timeout_s: float | None, fn, *args: Any) -> NcclWork:
        result = fn(*args, self._handle, stream.cuda_stream)
        if result == IN_PROGRESS:
            # A non-blocking communicator may still be enqueueing (the first operation with a peer
            # also connects to it), and must be idle before the next call: finish that first.
            self._drive(lambda: True, self.timeout_s if timeout_s is None else timeout_s, f"enqueueing {what}")
        elif result != SUCCESS:
            self._fail(what, f"{self._lib.error_string(result)}")
        return NcclWork(self, stream, what)

    def _drive(self, finished, timeout_s: float, what: str) -> None:
        """Poll until the communicator is idle (no ncclInProgress) and ``finished()`` holds. A
        communicator error or the deadline aborts the communicator and raises.

        The first ``SPIN_S`` are a busy poll (both checks cost about a microsecond, and a bucket
        of a weight sync completes in a millisecond or less); after that the poll sleeps, with a
        pause growing to ``MAX_PAUSE_S``, so a long wait does not burn a core."""
        start = time.monotonic()
        deadline = start + timeout_s
        spin_until = start + self.SPIN_S
        state = ctypes.c_int()
        pause = 50e-6
        while True:
            self._check_open(what)
            result = self._lib.ncclCommGetAsyncError(self._handle, ctypes.byref(state))
            if result != SUCCESS or state.value not in (SUCCESS, IN_PROGRESS):
                code = state.value if result == SUCCESS else result
                self._fail(what, f"peer or library failure: {self._lib.error_string(code)}")
            if state.value == SUCCESS and finished():
                return
            now = time.monotonic()
            if now >= deadline:
                self.abort(f"timed out during {what}")
                raise CollectiveTimeoutError(
                    f"group {self.group!r} rank {self.rank}/{self.world_size} (nccl on {self.device}): {what} did "
                    f"not complete within {timeout_s:g} s (a peer is frozen, gone, or never joined); "
                    f"communicator aborted"
                )
            if now >= spin_until:
                time.sleep(pause)
                pause = min(pause * 2, self.MAX_PAUSE_S)

    def _fail(self, what: str, why: str) -> NoReturn:
        self.abort(f"failed during {what}")
        raise CollectiveError(
            f"group {self.group!r} rank {self.rank}/{self.world_size} (nccl on {self.device}): "
            f"{what} failed: {why}; communicator aborted"
        )

    def _abort(self) -> None:
        if self._handle:
            self._lib.ncclCommAbort(self._handle)  # local, does not wait for peers
            self._handle = None

    def _destroy(self) -> None:
        # Abort rather than finalize: close() must not wait for peers, and a clean shutdown is
        # the caller's barrier. ncclCommAbort frees every resource the communicator holds.
        self._abort()


def _dtype_code(tensor: torch.Tensor) -> int:
    try:
        return DTYPES[tensor.dtype]
    except KeyError:
        raise TypeError(f"NCCL cannot carry {tensor.dtype}") from None
