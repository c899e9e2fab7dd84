"""Creating an HCCL communicator: rank 0's root info goes to every rank through the rendezvous
group, then every rank joins in ``HcclCommInitRootInfo`` under a deadline.

``HcclCommInitRootInfo`` blocks until every rank has arrived and cannot be interrupted, so it runs
on a helper thread that the caller may give up on (`init_comm`); a communicator that call builds
after the caller gave up is destroyed at once rather than leaked.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import torch

from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError, RendezvousError
from asyncrl.comm.hccl_library import (
    HCCL_E_TIMEOUT,
    HCCL_ROOT_INFO_BYTES,
    HCCL_SUCCESS,
    HcclComm,
    HcclLibrary,
    HcclRootInfo,
)

log = logging.getLogger("asyncrl.comm.hccl")


def check_group(group: Any) -> None:
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


def exchange_root_info(lib: HcclLibrary, group: Any) -> HcclRootInfo:
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
                self._group.world_size, ctypes.byref(self._root), self._group.rank, ctypes.byref(comm)
            )
        except BaseException as e:  # noqa: BLE001  (handed to the creating thread, which raises it)
            exc = e
        self._settle(rc, comm.value, exc)

    def _settle(self, rc: int | None, handle: int | None, exc: BaseException | None) -> None:
        with self._lock:
            self.rc, self.handle, self.exc = rc, handle, exc
            orphan = self._abandoned and rc == HCCL_SUCCESS and handle
            self.finished.set()
        if orphan:
            log.warning(
                "group %r rank %d: HcclCommInitRootInfo returned after the caller gave up; "
                "destroying that communicator",
                self._group.name,
                self._group.rank,
            )
            self._lib.HcclCommDestroy(handle)

    def abandon(self) -> bool:
        """Give up on the call; False if it finished meanwhile (its result is then valid)."""
        with self._lock:
            if self.finished.is_set():
                return False
            self._abandoned = True
            return True


def init_comm(
    lib: HcclLibrary, runtime: Any, device: torch.device, group: Any, root: HcclRootInfo, timeout_s: float
) -> int:
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
    if call.rc is None:
        raise RuntimeError("HcclCommInitRootInfo finished with neither an exception nor a return code")
    if call.rc != HCCL_SUCCESS:
        cls = CollectiveTimeoutError if call.rc == HCCL_E_TIMEOUT else CollectiveError
        raise cls(f"group {group.name!r} rank {group.rank}: HcclCommInitRootInfo failed: {lib.describe(call.rc)}")
    if not call.handle:
        raise CollectiveError(f"group {group.name!r} rank {group.rank}: HcclCommInitRootInfo returned no communicator")
    return call.handle
