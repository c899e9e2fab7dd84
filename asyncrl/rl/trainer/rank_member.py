"""`RankMember`: this trainer process as one rank of an N-rank trainer (``--trainer.world_size``).

The strategy (``trainer/parallel.py``) is fixed by the world size the trainer is built for, once:
`Local` at world size 1, from the constructor on; `Sharded` for a rank of N, from its `join` on.
The driver spawns N trainer actors; rank 0 binds the group's store socket (`listen`) and every
rank joins (`join`) at the `SyncAddress` it is given, in torchtitan's order: torch's default
process group made from our rendezvous, then the policy sharded over it (``trainer/fsdp.py``), then
the optimiser built over the shards (`TrainedPolicy.shard`: the first and only one). From then on
the trainer's calls are the same code as at world size 1, and those that run collectives run on
every rank inside the group's guard (`run`), so a failure on one rank ends the call on all of them
within its deadline (see ``trainer/group.py``). A rank of N takes no call that needs its strategy
before its join (the driver joins every rank before any other call): such a call is refused.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import TypeVar

import torch

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.rendezvous import reserve_listener
from asyncrl.rl.trainer.errors import RankGroupError
from asyncrl.rl.trainer.group import RankGroup
from asyncrl.rl.trainer.parallel import Local, Sharded

T = TypeVar("T")
DEADLINE_S = 900.0
"""A call's deadline on a rank group when the driver names none (the default train step deadline)."""


class RankMember:
    """The trainer's strategy for its ``world_size`` (see the module docstring) and the store
    socket rank 0 reserves for the join. ``shard`` shards the policy over the group just formed
    and builds its optimiser (`TrainedPolicy.shard`)."""

    def __init__(self, device: torch.device, world_size: int, shard: Callable[[], None]):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, not {world_size!r}")
        self.device, self.world_size, self._shard = device, world_size, shard
        self._parallel: Local | Sharded | None = Local() if world_size == 1 else None
        self._listener: socket.socket | None = None
        self._closed = False

    @property
    def parallel(self) -> Local | Sharded:
        if self._parallel is None:
            state = "has left its group" if self._closed else "has not joined its group yet (rank_join)"
            raise RankGroupError(f"this trainer is one rank of {self.world_size} and {state}")
        return self._parallel

    @property
    def rank(self) -> int:
        return self.parallel.rank

    async def run(self, what: str, deadline_s: float, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` off the event loop; on a rank group, one guarded call of every rank
        (``deadline_s`` 0: `DEADLINE_S`)."""
        return await self.parallel.run(what, deadline_s or DEADLINE_S, fn, *args)

    def listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the trainer group's store socket; returns its port."""
        if self._listener is not None:
            self._listener.close()
        self._listener = reserve_listener(host, port)
        return self._listener.getsockname()[1]

    async def join(self, address: SyncAddress, rank: int) -> str:
        """Join the trainer group at ``address`` as ``rank``, shard the policy over it and build
        the optimiser over the shards. Returns the group's backend. Once only: a group that failed
        is never rebuilt (the run stops and resumes from a checkpoint)."""
        if self._parallel is not None or self._closed:
            raise RankGroupError(f"trainer rank {rank}: this trainer is built for world size {self.world_size}")
        if address.world_size != self.world_size:
            raise RankGroupError(
                f"trainer rank {rank}: asked to join a group of {address.world_size}, built for {self.world_size}"
            )
        listener, self._listener = (self._listener, None) if rank == 0 else (None, self._listener)

        def join() -> Sharded:
            group = RankGroup.create(address, rank, device=self.device, listener=listener)
            try:
                self._shard()
            except BaseException:
                group.close()
                raise
            return Sharded(group, self.device)

        self._parallel = await asyncio.to_thread(join)
        return self._parallel.backend

    def abort_call(self, failed_rank: int, reason: str) -> None:
        """The driver saw trainer rank ``failed_rank`` die: leave the collective running now."""
        if self._parallel is not None:
            self._parallel.abort_call(failed_rank, reason)

    async def close(self) -> None:
        """Release the reserved socket and leave the group. Idempotent."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        parallel, self._parallel, self._closed = self._parallel, None, True
        if parallel is not None:
            await asyncio.to_thread(parallel.close)
