"""Collectives between processes that share one GPU: CUDA IPC for the bytes, gloo for the signals.

NCCL refuses two ranks on one device, and a trip through host memory costs two PCIe copies per
sync, so a trainer and the samplers colocated on its GPU exchange weights through CUDA IPC: the
source exports the memory of the tensor it broadcasts (a storage handle from torch's CUDA IPC
support, sent as a typed message, never pickled), every other member maps it and copies the bytes
into its own tensor on the GPU. What the sender broadcasts is what `comm/weights.py` hands over:
its two alternating staging buffers and the parameters larger than a bucket, the same memory every
sync, so a receiver maps each allocation once per membership (``mapped`` counts them) and no extra
buffer is made on either side.

One broadcast is a gloo broadcast of the handle and an all_reduce of the receivers' verdicts; it
returns once every receiver has copied (the sender may then overwrite the tensor), so `Work` is
complete when returned. A failed or late member fails the collective everywhere and aborts the
communicator, as for the other backends. ``all_reduce`` (the sync's votes: a few integers) goes
through host memory on gloo.

Every member must be on the same GPU: `create` compares the devices' UUIDs and refuses otherwise
(GPUs of their own talk NCCL). CUDA only (no Ascend equivalent here).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from asyncrl.comm.communicator import Communicator, CompletedWork, ReduceOp, Work, cuda_stream
from asyncrl.comm.errors import CollectiveError
from asyncrl.comm.gloo import GlooCommunicator, all_reduce_on_host
from asyncrl.comm.rendezvous import StoreGroup

_MESSAGE_BYTES = 1024
"""Fixed size of a handle message on the wire (gloo broadcasts same-size tensors): a 4-byte length,
then the msgpack of `_Handle` (about 250 bytes)."""


class _Handle(msgspec.Struct, array_like=True, frozen=True):
    """Where the source's tensor lives: its storage as torch's ``_share_cuda_`` exports it (the
    allocation's IPC handle, the storage's size and offset in it, the producer's reference counter
    and event) and the tensor's bytes within that storage."""

    handle: bytes
    storage_bytes: int
    storage_offset: int
    counter_handle: bytes
    counter_offset: int
    event_handle: bytes
    event_sync: bool
    tensor_offset: int
    nbytes: int


class CudaIpcCommunicator(Communicator):
    backend = "ipc"

    def __init__(self, control: GlooCommunicator, group: StoreGroup, device: torch.device):
        self._control = control
        self._mapped: dict[tuple[bytes, int], torch.UntypedStorage] = {}
        super().__init__(group=group.label, rank=group.rank, world_size=group.world_size, device=device)

    @classmethod
    def create(
        cls, group: StoreGroup, device: torch.device | str | int | None = None, timeout_s: float = 60.0
    ) -> CudaIpcCommunicator:
        """All members call this together, each with its CUDA device (None: the current one)."""
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the ipc communicator needs a CUDA device, not {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        uuids = group.all_gather_obj(uuid, type=str, timeout_s=timeout_s, what="the members' GPU UUIDs")
        others = {rank: u for rank, u in enumerate(uuids) if u != uuid}
        if others:
            raise CollectiveError(
                f"group {group.label!r} rank {group.rank}: CUDA IPC needs every member on one GPU, but this one "
                f"is on {uuid} and rank(s) {sorted(others)} on {sorted(set(others.values()))}; members on GPUs "
                "of their own use nccl"
            )
        return cls(GlooCommunicator.create(group, timeout_s), group, device)

    @property
    def mapped(self) -> int:
        """Allocations of other processes this member has mapped (each once per membership)."""
        return len(self._mapped)

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        self._check_open("broadcast")
        self._check_tensor(tensor, "broadcast")
        timeout_s = 60.0 if timeout_s is None else timeout_s
        on = cuda_stream(stream, self.device)
        message = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)  # all zeros: the source failed to export
        failure: Exception | None = None
        if self.rank == src:
            try:
                on.synchronize()  # the bytes a receiver will read are written
                message = _encode(_export(tensor))
            except Exception as exc:  # still takes part below: the receivers learn it at once
                failure = exc
        self._signal(lambda: self._control.broadcast(message, src, timeout_s=timeout_s), timeout_s)
        if self.rank != src:
            try:
                self._copy_in(tensor, _decode(message, src), on)
            except Exception as exc:
                failure = exc
        # Every member's verdict: the source may overwrite its tensor once every receiver copied.
        verdict = torch.tensor([self.rank + 1 if failure is not None else 0], dtype=torch.int64)
        self._signal(lambda: self._control.all_reduce(verdict, ReduceOp.MAX, timeout_s=timeout_s), timeout_s)
        failed = int(verdict.item()) - 1
        if failed >= 0:
            self.abort(f"rank {failed} failed during a broadcast from rank {src}")
            where = f"group {self.group!r} rank {self.rank} (ipc)"
            if failure is not None:
                raise CollectiveError(
                    f"{where}: broadcast from rank {src} failed here: {type(failure).__name__}: "
                    f"{failure}; communicator aborted"
                ) from failure
            raise CollectiveError(f"{where}: broadcast from rank {src} failed on rank {failed}; communicator aborted")
        return CompletedWork()

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.Stream | None = None,
        timeout_s: float | None = None,
    ) -> Work:
        self._check_open("all_reduce")
        self._check_tensor(tensor, "all_reduce")
        timeout_s = 60.0 if timeout_s is None else timeout_s
        try:
            all_reduce_on_host(self._control, tensor, op, stream=stream, timeout_s=timeout_s)
        except CollectiveError as exc:
            self.abort(f"its gloo signalling failed: {exc}")
            raise
        return CompletedWork()

    def _signal(self, operation: Any, timeout_s: float) -> None:
        """Run one gloo operation to completion; its failure (gloo aborted itself) aborts this one too."""
        try:
            operation().wait(timeout_s)
        except CollectiveError as exc:
            self.abort(f"its gloo signalling failed: {exc}")
            raise

    def _copy_in(self, tensor: torch.Tensor, source: _Handle, stream: torch.cuda.Stream) -> None:
        if source.nbytes != tensor.nbytes:
            raise ValueError(f"the source's tensor has {source.nbytes} bytes, this one {tensor.nbytes}")
        storage = self._storage(source)
        mapped = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        with torch.cuda.stream(stream):
            tensor.reshape(-1).view(torch.uint8).copy_(
                mapped[source.tensor_offset : source.tensor_offset + source.nbytes]
            )
        stream.synchronize()  # copied before the verdict lets the source overwrite its tensor

    def _storage(self, source: _Handle) -> torch.UntypedStorage:
        """The source's storage, mapped on first sight. Every export counts a reference on the
        source's side; one already mapped gives it back at once (as torch's own CUDA tensor
        sharing does), the mapping holds its own until the communicator closes."""
        key = (source.handle, source.storage_offset)
        storage = self._mapped.get(key)
        if storage is not None:
            torch.UntypedStorage._release_ipc_counter(source.counter_handle, source.counter_offset, device=self.device)
            return storage
        storage = torch.UntypedStorage._new_shared_cuda(
            self.device.index,
            source.handle,
            source.storage_bytes,
            source.storage_offset,
            source.counter_handle,
            source.counter_offset,
            source.event_handle,
            source.event_sync,
        )
        self._mapped[key] = storage
        return storage

    def _abort(self) -> None:
        self._control.abort(self._closed_reason or "aborted")
        self._mapped.clear()

    def _destroy(self) -> None:
        self._control.close()
        self._mapped.clear()


def _export(tensor: torch.Tensor) -> _Handle:
    (_, handle, storage_bytes, storage_offset, counter_handle, counter_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return _Handle(
        handle=bytes(handle),
        storage_bytes=storage_bytes,
        storage_offset=storage_offset,
        counter_handle=bytes(counter_handle),
        counter_offset=counter_offset,
        event_handle=bytes(event_handle or b""),
        event_sync=bool(event_sync),
        tensor_offset=int(tensor.storage_offset()) * tensor.element_size(),  # int: the stub allows a SymInt
        nbytes=tensor.nbytes,
    )


def _encode(handle: _Handle) -> torch.Tensor:
    body = msgspec.msgpack.encode(handle)
    if len(body) + 4 > _MESSAGE_BYTES:
        raise ValueError(f"a CUDA IPC handle message of {len(body)} bytes does not fit in {_MESSAGE_BYTES}")
    message = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    message[:4] = torch.frombuffer(bytearray(len(body).to_bytes(4, "little")), dtype=torch.uint8)
    message[4 : 4 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return message


def _decode(message: torch.Tensor, src: int) -> _Handle:
    raw = message.numpy().tobytes()
    size = int.from_bytes(raw[:4], "little")
    if size == 0:
        raise ValueError(f"rank {src} could not export its tensor (see its error)")
    if size > _MESSAGE_BYTES - 4:
        raise ValueError(f"malformed CUDA IPC handle message from rank {src} (length {size})")
    return msgspec.msgpack.decode(raw[4 : 4 + size], type=_Handle)
