"""Joining a weight-sync group from inside an actor, and forming one from the driver.

`SyncMember` is a mixin of endpoints for an `Actor` that takes part in a group (the trainer as
rank 0, samplers after it). `form_group` is the driver's side: it asks rank 0 for a store address,
then starts every member's join at once and waits for all under one deadline, which is the
rendezvous contract (see `rendezvous.py`). Rebuilding after a member was lost is the same call
with the next generation: each member drops its old communicator and joins the new group.
A member's own join is `asyncrl.comm.join.join_sync_group`, the same call vLLM's worker makes.

The blocking parts (store waits, communicator creation, syncs) run on a worker thread, so the
actor keeps answering calls and the supervisor's heartbeats while they last.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

from asyncrl.comm.communicator import Communicator
from asyncrl.comm.join import join_sync_group, make_communicator
from asyncrl.comm.rendezvous import StoreGroup, join_all, reserve_listener
from asyncrl.runtime.actor import Actor, endpoint

# make_communicator lives in `asyncrl.comm.join`; re-exported for callers that import it from here.
__all__ = ["SyncMember", "form_group", "make_communicator"]


class SyncMember(Actor):
    """Endpoints that let the driver put this actor in a weight-sync group."""

    sync_group: StoreGroup | None = None
    sync_comm: Communicator | None = None
    _sync_listener: socket.socket | None = None

    @endpoint
    async def sync_listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the store's listening socket now, so its port is known (and a port
        in use is reported) before any member is told to join. Returns the port."""
        if self._sync_listener is not None:
            self._sync_listener.close()
        self._sync_listener = reserve_listener(host, port)
        return self._sync_listener.getsockname()[1]

    @endpoint
    async def sync_join(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        generation: int = 0,
        backend: str = "auto",
        timeout_s: float = 60.0,
        name: str = "weights",
    ) -> str:
        """Leave any previous group, join this one and create its communicator. Returns the
        communicator's backend."""
        listener = None
        if rank == 0:
            listener, self._sync_listener = self._sync_listener, None
        await self.sync_leave()  # the previous membership, not the listener just reserved for this one

        # One deadline for rendezvous and communicator (see join_sync_group): the driver waits
        # for this call only a margin beyond timeout_s.
        membership = await asyncio.to_thread(
            join_sync_group,
            host,
            port,
            rank,
            world_size,
            generation=generation,
            backend=backend,
            timeout_s=timeout_s,
            name=name,
            listener=listener,
        )
        self.sync_group, self.sync_comm = membership.group, membership.comm
        return self.sync_comm.backend

    @endpoint
    async def sync_leave(self) -> None:
        """Drop the communicator, the store handle (an aborted one included) and a listening
        socket reserved for a join that never came. Idempotent."""
        comm, group, listener = self.sync_comm, self.sync_group, self._sync_listener
        self.sync_comm = self.sync_group = self._sync_listener = None
        if listener is not None:
            listener.close()
        if comm is not None:
            comm.close()
        if group is not None:
            group.close()

    @endpoint
    async def sync_created(self) -> dict[str, int]:
        """Communicators this process has created, per backend (proves reuse across syncs)."""
        return dict(Communicator.created)

    async def on_stop(self) -> None:
        await self.sync_leave()


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
    """Put ``members`` (handles of `SyncMember` actors; the first is rank 0 and hosts the store on
    ``host``) in one group and return the store's port. Every join starts at once; any failure
    (a member that dies, refuses or never answers) raises `RendezvousError` naming it."""
    port = await members[0].sync_listen(host, port)
    world = len(members)
    joins = [
        m.with_timeout(timeout_s + 10).sync_join(host, port, rank, world, generation, backend, timeout_s, name)
        for rank, m in enumerate(members)
    ]
    await join_all(joins, timeout_s + 15, what=f"join weight-sync group {name}/g{generation}")
    return port
