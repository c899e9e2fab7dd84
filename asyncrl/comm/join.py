"""Forming one member's side of a weight-sync group: the rendezvous, then the communicator.

`join_sync_group` is the one way a process joins a group, whoever calls it: an actor's `SyncSeat`
(``member.py``), or vLLM's worker extension in the engine's process. Each passes the group's
`SyncAddress` and its own rank. Rebuilding after a member was lost is the same call at the
address's next ``generation``, once the caller has closed its previous `SyncMembership` (a group
with a failed member is rebuilt, never patched).

`make_communicator` is the factory above the backends: it imports the one it builds, so importing
this module loads no collective library.
"""

from __future__ import annotations

import socket
import time

import torch

from asyncrl.comm.address import SyncAddress, check_backend
from asyncrl.comm.communicator import Communicator
from asyncrl.comm.rendezvous import StoreGroup

_BACKEND_OF_DEVICE = {"cuda": "nccl", "npu": "hccl"}


def resolve_backend(backend: str, device: torch.device | str | int | None = None) -> str:
    """The backend ``auto`` stands for: that of ``device`` (nccl on cuda, hccl on npu, gloo on
    anything else), or with no device nccl where CUDA is available and gloo elsewhere. Any other
    name is returned as it is, once checked."""
    check_backend(backend)
    if backend != "auto":
        return backend
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return _BACKEND_OF_DEVICE.get(_device_type(device), "gloo")


def _device_type(device: torch.device | str | int) -> str:
    # A string is read by hand: torch.device("npu:0") fails until torch_npu is imported.
    if isinstance(device, str):
        return device.split(":", 1)[0]
    return torch.device(device).type


def make_communicator(
    group: StoreGroup, backend: str = "auto", timeout_s: float = 60.0, *, device: torch.device | str | int | None = None
) -> Communicator:
    """The communicator of ``group`` for this process: ``nccl`` on a CUDA device (in tiers with CUDA
    IPC where some members share a GPU: `tiered.py`), ``hccl`` on an
    Ascend NPU, ``gloo`` on CPU, ``ipc`` for members sharing one GPU; ``auto`` picks by
    `resolve_backend`. ``device`` is the accelerator
    (None: the current CUDA device for nccl, NPU 0 for hccl); gloo always works on CPU tensors."""
    backend = resolve_backend(backend, device)
    if backend == "gloo":
        from asyncrl.comm.gloo import GlooCommunicator

        return GlooCommunicator.create(group, timeout_s)
    if backend == "ipc":
        from asyncrl.comm.cuda_ipc import CudaIpcCommunicator

        return CudaIpcCommunicator.create(group, device, timeout_s)
    if backend == "nccl":  # NCCL between GPUs; NCCL and CUDA IPC in tiers where some members share one
        from asyncrl.comm.tiered import nccl_or_tiered

        return nccl_or_tiered(group, device, timeout_s)
    from asyncrl.comm.pyhccl import HcclCommunicator

    return HcclCommunicator.create(group, torch.device("npu", 0) if device is None else device, timeout_s)


class SyncMembership:
    """One member's place in one group: its `StoreGroup` and the communicator made from it.
    Owns both; `close` releases both, communicator first, and is idempotent."""

    def __init__(self, group: StoreGroup, comm: Communicator):
        self.group = group
        self.comm = comm

    @property
    def backend(self) -> str:
        return self.comm.backend

    def close(self) -> None:
        try:
            self.comm.close()
        finally:
            self.group.close()

    def __enter__(self) -> SyncMembership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SyncMembership {self.group!r} {self.comm!r}>"


def join_sync_group(
    address: SyncAddress,
    rank: int,
    *,
    device: torch.device | str | int | None = None,
    listener: socket.socket | None = None,
) -> SyncMembership:
    """Join the group at ``address`` as ``rank`` and create its communicator (`make_communicator`
    with the address's backend and ``device``). Blocking; every member calls it at the same time
    (see `rendezvous.py`). Rank 0 may pass the ``listener`` it reserved with `reserve_listener`.

    Both steps share one deadline of ``address.timeout_s``: callers wait for a join only a margin
    beyond it, and a communicator given a whole ``timeout_s`` of its own after a slow rendezvous
    (a peer lost in between) would answer after the caller gave up. On failure nothing is left
    open."""
    address.check_rank(rank)
    deadline = time.monotonic() + address.timeout_s
    group = StoreGroup.create(
        address.host,
        address.port,
        rank,
        address.world_size,
        address.timeout_s,
        name=address.name,
        generation=address.generation,
        listener=listener,
    )
    try:
        comm = make_communicator(group, address.backend, max(deadline - time.monotonic(), 1e-3), device=device)
    except BaseException:
        group.close()
        raise
    return SyncMembership(group, comm)
