"""Joining a weight-sync group from inside an actor, and forming one from the driver.

`SyncSeat` is one process's place in a group across its generations (the listener rank 0 reserved,
the current `SyncMembership`), owned by whatever joins for the process (the trainer's and the
sampler's weight-sync parts, which hand it to a sampler's sink). `SyncEndpoints` is the group's
four endpoints (``sync_listen``, ``sync_join``, ``sync_leave``, ``sync_created``), written once for
every actor that takes part: each forwards to the actor's `SyncSide` (the trainer's seat, the
sampler's `WeightReceiving`); `SyncMember` is the same over a seat of its own, for a small `Actor`
that takes part in a group (tests, benchmarks). `form_group` is the driver's side: it asks rank 0
for a store port, then starts every member's join at once and waits for all under one deadline,
which is the rendezvous contract (see `rendezvous.py`).
Rebuilding after a member was lost is the same call with the next generation: each member drops
its old communicator and joins the new group. A member's own join is
`asyncrl.comm.join.join_sync_group`, the same call vLLM's worker makes.

The blocking parts (store waits, communicator creation, syncs) run on a worker thread, so the
actor keeps answering calls and the supervisor's heartbeats while they last.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any, Protocol

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.communicator import Communicator
from asyncrl.comm.join import SyncMembership, join_sync_group, make_communicator
from asyncrl.comm.rendezvous import StoreGroup, join_all, reserve_listener
from asyncrl.runtime.actor import Actor, endpoint

# make_communicator lives in `asyncrl.comm.join`; re-exported for callers that import it from here.
__all__ = ["SyncEndpoints", "SyncMember", "SyncSeat", "SyncSide", "form_group", "make_communicator"]


class SyncSide(Protocol):
    """An actor's side of the weight-sync group, as its four endpoints reach it (`SyncEndpoints`):
    a `SyncSeat` where the actor's own process sends or receives, or a part that joins elsewhere
    (a vLLM sampler's engine process)."""

    def listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the store's listening socket now (`SyncSeat.listen`). Returns the port."""
        ...

    async def join(self, address: SyncAddress, rank: int) -> str:
        """Leave any previous group, join the one at ``address`` as ``rank`` and create its
        communicator. Returns the communicator's backend."""
        ...

    async def leave(self) -> None:
        """Drop the communicator, the store handle and a reserved listener. Idempotent."""
        ...

    async def created(self) -> dict[str, int]:
        """Communicators created for weight sync, per backend (proves reuse across syncs)."""
        ...


class SyncSeat:
    """One process's seat in a weight-sync group: the store's listening socket, reserved by rank 0
    before its join, and the current membership. Owns both; one membership at a time (a join
    leaves the previous one); `leave` is idempotent."""

    def __init__(self) -> None:
        self.membership: SyncMembership | None = None
        self._listener: socket.socket | None = None

    @property
    def group(self) -> StoreGroup | None:
        return None if self.membership is None else self.membership.group

    @property
    def comm(self) -> Communicator | None:
        return None if self.membership is None else self.membership.comm

    def listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the store's listening socket now, so its port is known (and a port
        in use is reported) before any member is told to join. Returns the port."""
        if self._listener is not None:
            self._listener.close()
        self._listener = reserve_listener(host, port)
        return self._listener.getsockname()[1]

    async def join(self, address: SyncAddress, rank: int) -> str:
        """Leave any previous group, join the one at ``address`` as ``rank`` and create its
        communicator, on a worker thread. Returns the communicator's backend."""
        listener = None
        if rank == 0:
            listener, self._listener = self._listener, None
        self._leave()  # the previous membership, not the listener just taken for this one
        # One deadline for rendezvous and communicator (see join_sync_group): the driver waits
        # for this call only a margin beyond address.timeout_s.
        self.membership = await asyncio.to_thread(join_sync_group, address, rank, listener=listener)
        return self.membership.backend

    async def leave(self) -> None:
        """Drop the communicator, the store handle (an aborted one included) and a listening
        socket reserved for a join that never came. Idempotent."""
        self._leave()

    async def created(self) -> dict[str, int]:
        """Communicators this process has created, per backend."""
        return dict(Communicator.created)

    def _leave(self) -> None:
        membership, listener = self.membership, self._listener
        self.membership = self._listener = None
        if listener is not None:
            listener.close()
        if membership is not None:
            membership.close()


class SyncEndpoints(Actor):
    """The weight-sync group's endpoints of an actor that takes part in it, each forwarded to its
    ``sync_side``: the driver's calls that put the actor in a group (`form_group`, the fleet's
    `SyncGroup`), written once for every such actor."""

    @property
    def sync_side(self) -> SyncSide:
        """The actor's side of the group (each subclass names its part)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not name its side of the weight-sync group")

    @endpoint
    async def sync_listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the store's listening socket now. Returns the port."""
        return self.sync_side.listen(host, port)

    @endpoint
    async def sync_join(self, address: SyncAddress, rank: int) -> str:
        """Leave any previous group, join the one at ``address`` as ``rank`` and create its
        communicator. Returns the communicator's backend."""
        return await self.sync_side.join(address, rank)

    @endpoint
    async def sync_leave(self) -> None:
        """Drop the communicator, the store handle and a reserved listener. Idempotent."""
        await self.sync_side.leave()

    @endpoint
    async def sync_created(self) -> dict[str, int]:
        """Communicators created for weight sync, per backend (proves reuse across syncs)."""
        return await self.sync_side.created()


class SyncMember(SyncEndpoints):
    """`SyncEndpoints` over a `SyncSeat` of the actor's own (``sync_comm`` and ``sync_group`` are
    the seat's, None outside a group): a small actor that sends or receives itself."""

    _sync_seat: SyncSeat | None = None

    @property
    def sync_seat(self) -> SyncSeat:
        # Made on first use: the actors that mix this in have constructors of their own.
        if self._sync_seat is None:
            self._sync_seat = SyncSeat()
        return self._sync_seat

    @property
    def sync_side(self) -> SyncSide:
        return self.sync_seat

    @property
    def sync_comm(self) -> Communicator | None:
        return self.sync_seat.comm

    @property
    def sync_group(self) -> StoreGroup | None:
        return self.sync_seat.group

    async def on_stop(self) -> None:
        await self.sync_seat.leave()


async def form_group(
    members: Sequence[Any],
    host: str,
    *,
    generation: int = 0,
    backend: str = "auto",
    timeout_s: float = 60.0,
    port: int = 0,
    name: str = "weights",
) -> int:
    """Put ``members`` (handles of actors with the ``sync_*`` endpoints; the first is rank 0 and
    hosts the store on ``host``) in one group and return the store's port. Every join starts at
    once; any failure (a member that dies, refuses or never answers) raises `RendezvousError`
    naming it."""
    port = await members[0].sync_listen(host, port)
    address = SyncAddress(
        host=host,
        port=port,
        world_size=len(members),
        generation=generation,
        backend=backend,
        timeout_s=timeout_s,
        name=name,
    )
    joins = [m.with_timeout(timeout_s + 10).sync_join(address, rank) for rank, m in enumerate(members)]
    await join_all(joins, timeout_s + 15, what=f"join weight-sync group {address.label}")
    return port
