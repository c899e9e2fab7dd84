"""HCCL backend: `HcclCommunicator`, a fixed group of Ascend NPUs exchanging tensors through libhccl.

The pieces it stands on live beside it: `asyncrl.comm.hccl_library` (finding libhccl, its types,
codes and function table), `asyncrl.comm.hccl_init` (the root-info exchange and the bounded
``HcclCommInitRootInfo``) and `asyncrl.comm.npu_runtime` (torch_npu's devices, streams and events).
Importing this module loads neither libhccl nor torch_npu; `HcclCommunicator.create` does.

HCCL has no abort. ``HcclCommSuspend``/``HcclCommResume`` exist on recent CANN but are documented as
reserved, meant for on-chip memory (UCE) faults, and not to be run concurrently with collectives,
so they are deliberately not used; an aborted communicator is released with ``HcclCommDestroy``
from a helper thread with a bounded wait (see `HcclCommunicator._release`).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, NoReturn

import torch

from asyncrl.comm.communicator import Communicator, CompletedWork, ReduceOp, Work
from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError, CommLibraryError
from asyncrl.comm.hccl_init import check_group, exchange_root_info, init_comm
from asyncrl.comm.hccl_library import (
    HCCL_E_TIMEOUT,
    HCCL_SUCCESS,
    HcclLibrary,
    HcclResult,
    hccl_dtype,
    hccl_reduce_dtype,
    hccl_reduce_op,
    load_library,
)
from asyncrl.comm.npu_runtime import NpuRuntime

log = logging.getLogger("asyncrl.comm.hccl")

# -- work ----------------------------------------------------------------------------------------

_POLL_MIN_S = 50e-6  # first pause: a small broadcast is often done within microseconds
_POLL_MAX_S = 5e-3  # pause cap: bounds how late a completion is noticed
_ASYNC_CHECK_EVERY_S = 0.1  # HcclGetCommAsyncError is a synchronous host call; don't spin on it


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

    def _fail(self, cls: type[CollectiveError], why: str, cause: BaseException | None = None) -> NoReturn:
        comm = self._comm
        self._error = cls(f"group {comm.group!r} rank {comm.rank}: hccl {self._what} {why}; communicator aborted")
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

    def __init__(
        self,
        *,
        lib: HcclLibrary,
        runtime: Any,
        handle: int,
        group: str,
        rank: int,
        world_size: int,
        device: torch.device,
    ):
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
    def create(
        cls,
        group: Any,
        device: torch.device | str | int,
        timeout_s: float,
        *,
        library: HcclLibrary | None = None,
        runtime: Any = None,
    ) -> HcclCommunicator:
        """Build the communicator of ``group`` on ``device``: rank 0's root info goes to every rank
        through ``group.broadcast_obj``, then every rank joins in HcclCommInitRootInfo, which must
        finish within ``timeout_s`` (else CollectiveTimeoutError). This binds the calling thread to
        ``device``. ``library``/``runtime`` default to `load_library()` and `NpuRuntime()`."""
        check_group(group)
        lib = library if library is not None else load_library()
        runtime = runtime if runtime is not None else NpuRuntime()
        pinned: torch.device = runtime.normalize_device(device)
        runtime.bind_device(pinned)
        root = exchange_root_info(lib, group)
        handle = init_comm(lib, runtime, pinned, group, root, timeout_s)
        return cls(
            lib=lib,
            runtime=runtime,
            handle=handle,
            group=group.name,
            rank=group.rank,
            world_size=group.world_size,
            device=pinned,
        )

    # -- operations ------------------------------------------------------------------------------

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        what = f"broadcast(src={src}, {tensor.numel()} x {tensor.dtype})"
        self._check_args(tensor, what, src)
        dtype, ptr = hccl_dtype(tensor.dtype), tensor.data_ptr()
        return self._launch(
            what, (tensor,), stream, lambda comm, s: self._lib.HcclBroadcast(ptr, tensor.numel(), dtype, src, comm, s)
        )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.Stream | None = None,
        timeout_s: float | None = None,
    ) -> Work:
        what = f"all_reduce({getattr(op, 'name', op)}, {tensor.numel()} x {tensor.dtype})"
        self._check_args(tensor, what)
        dtype, code, ptr = hccl_reduce_dtype(tensor.dtype), hccl_reduce_op(op), tensor.data_ptr()
        # In place (send buffer = receive buffer), as torch_npu's ProcessGroupHCCL calls it.
        return self._launch(
            what,
            (tensor,),
            stream,
            lambda comm, s: self._lib.HcclAllReduce(ptr, ptr, tensor.numel(), dtype, code, comm, s),
        )

    def send(
        self, tensor: torch.Tensor, dst: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        what = f"send(dst={dst}, {tensor.numel()} x {tensor.dtype})"
        self._check_p2p(tensor, what, dst, "HcclSend")
        dtype, ptr = hccl_dtype(tensor.dtype), tensor.data_ptr()
        return self._launch(
            what, (tensor,), stream, lambda comm, s: self._lib.HcclSend(ptr, tensor.numel(), dtype, dst, comm, s)
        )

    def recv(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        what = f"recv(src={src}, {tensor.numel()} x {tensor.dtype})"
        self._check_p2p(tensor, what, src, "HcclRecv")
        dtype, ptr = hccl_dtype(tensor.dtype), tensor.data_ptr()
        return self._launch(
            what, (tensor,), stream, lambda comm, s: self._lib.HcclRecv(ptr, tensor.numel(), dtype, src, comm, s)
        )

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

    def _launch(self, what: str, keep_alive: tuple[torch.Tensor, ...], stream: torch.Stream | None, call: Any) -> Work:
        """Enqueue ``call(comm_handle, stream_handle)`` and return its Work. A library error aborts
        the communicator: the peers have enqueued their half and will wait on us forever."""
        if keep_alive[0].numel() == 0:
            return CompletedWork()  # same shape on every rank, so every rank skips it alike
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
        raise cls(
            f"group {self.group!r} rank {self.rank}: hccl {what} failed: {self._lib.describe(rc)}; communicator aborted"
        )

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
            log.info(
                "group %r rank %d: HcclGetCommAsyncError unusable (%s); relying on events only",
                self.group,
                self.rank,
                self._lib.describe(rc),
            )
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
            log.warning(
                "group %r rank %d: HcclCommDestroy still running after %g s; left to finish in the background",
                self.group,
                self.rank,
                self.release_grace_s,
            )

    def _take_handle(self) -> int | None:
        if not self._lock.acquire(timeout=self.release_grace_s):
            log.warning(
                "group %r rank %d: an HCCL call did not return within %g s; the communicator "
                "handle is leaked rather than destroyed under it",
                self.group,
                self.rank,
                self.release_grace_s,
            )
            return None
        try:
            handle, self._handle = self._handle, None
            return handle
        finally:
            self._lock.release()

    def _destroy_handle(self, handle: int) -> None:
        rc = self._lib.HcclCommDestroy(handle)
        if rc != HCCL_SUCCESS:
            log.warning("group %r rank %d: HcclCommDestroy failed: %s", self.group, self.rank, self._lib.describe(rc))
