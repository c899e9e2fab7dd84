"""`ActorSink`: a `WeightSink` that receives in the sampler actor's own process.

The sink joins the group through the seat it is handed (`WeightReceiving`'s `SyncSeat`), builds a
`WeightReceiver` over it and copies each sync straight into the backend's tensors
(`InPlaceBackend`), at the moment the backend says no generation reads them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from asyncrl.comm.communicator import Communicator
from asyncrl.rl.digest import tensor_digest
from asyncrl.rl.sampler.backend import SamplerSyncStats, WeightSink
from asyncrl.rl.sampler.errors import SamplerError

if TYPE_CHECKING:
    from asyncrl.comm.address import SyncAddress
    from asyncrl.comm.member import SyncSeat
    from asyncrl.comm.weights import SyncStats, WeightReceiver


class InPlaceBackend(Protocol):
    """A backend whose weights are tensors in this process (`HFBackend`)."""

    def weight_tensors(self) -> Mapping[str, torch.Tensor]: ...

    async def load_weights(
        self,
        load: Callable[[Mapping[str, torch.Tensor]], object],
        *,
        version: int,
        in_flight: bool = False,
        timeout_s: float = 600.0,
    ) -> None: ...


class ActorSink(WeightSink):
    """Weight sync in the sampler actor: the group is joined through ``seat`` (the sampler's
    `SyncSeat`, `WeightReceiving`'s), the weights are ``backend``'s tensors, written by
    `InPlaceBackend.load_weights`."""

    def __init__(self, seat: SyncSeat, backend: InPlaceBackend):
        self.seat, self.backend = seat, backend
        self.receiver: WeightReceiver | None = None

    async def join(self, address: SyncAddress, rank: int) -> str:
        self.receiver = None  # its communicator is the one this join replaces
        return await self.seat.join(address, rank)

    async def setup(self, timeout_s: float) -> int:
        from asyncrl.comm.weights import WeightReceiver

        comm, group = self.seat.comm, self.seat.group
        if comm is None or group is None:
            raise SamplerError("setup_receiver before joining a weight-sync group")
        receiver = await asyncio.to_thread(
            WeightReceiver.create, comm, group, src=0, expect=self.backend.weight_tensors(), timeout_s=timeout_s
        )
        self.receiver = receiver
        return len(receiver.layout.buckets)

    @property
    def ready(self) -> bool:
        return self.receiver is not None

    @property
    def weight_dtype(self) -> str:
        return floating_dtype(self.backend.weight_tensors().values())

    async def receive(self, version: int, *, in_flight: bool, timeout_s: float) -> SamplerSyncStats:
        deadline = time.monotonic() + timeout_s
        receiver, start = self.receiver, time.perf_counter()
        if receiver is None:
            raise SamplerError(f"receive_weights of v{version} before setup_receiver")
        marks: dict[str, float] = {}
        stats: list[SyncStats] = []

        def load(tensors: Mapping[str, torch.Tensor]) -> None:  # on a worker thread, once no generation reads them
            marks["loading"] = time.perf_counter()
            stats.append(receiver.receive(version, tensors, timeout_s=max(deadline - time.monotonic(), 1e-3)))
            marks["loaded"] = time.perf_counter()

        await self.backend.load_weights(load, version=version, in_flight=in_flight, timeout_s=timeout_s)
        # The resume: from the load's end to the backend's return (its thread's hop back included).
        return SamplerSyncStats(
            pause_s=marks["loading"] - start, receive=stats[0], resume_s=time.perf_counter() - marks["loaded"]
        )

    async def leave(self) -> None:
        self.receiver = None
        await self.seat.leave()

    async def created(self) -> dict[str, int]:
        return dict(Communicator.created)

    async def digest(self) -> str:
        return await asyncio.to_thread(tensor_digest, self.backend.weight_tensors())


def floating_dtype(tensors) -> str:
    """The one dtype of the floating-point ``tensors`` ("" when they have several, or none)."""
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else ""
