"""`RankMember`: this trainer process as one rank of an N-rank trainer (``--trainer.world_size``).

The driver spawns N trainer actors; rank 0 binds the group's store socket (`listen`) and every
rank joins (`join`): each makes torch's default process group from our rendezvous, shards its
policy over it (``trainer/fsdp.py``), rebuilds its optimiser over the shards, and swaps its
strategy (``trainer/parallel.py``) from `Local` to `Sharded`, once. From then on the trainer's
calls are the same code as at world size 1, and those that run collectives run on every rank
inside the group's guard (`run`), so a failure on one rank ends the call on all of them within
its deadline (see ``trainer/group.py``).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from asyncrl.comm.rendezvous import reserve_listener
from asyncrl.rl.trainer.group import RankGroup
from asyncrl.rl.trainer.parallel import Local, Sharded

T = TypeVar("T")
DEADLINE_S = 900.0
"""A call's deadline on a rank group when the driver names none (the default train step deadline)."""


class RankMember:
    """The trainer's strategy (``parallel``: `Local` until it joins a group, `Sharded` after) and
    the store socket rank 0 reserves for the join. ``shard`` shards the policy and rebuilds its
    optimiser over the group just formed (`TrainedPolicy.shard`)."""

    def __init__(self, device: torch.device, shard: Callable[[], None]):
        self.device, self._shard = device, shard
        self.parallel: Local | Sharded = Local()
        self._listener: socket.socket | None = None

    @property
    def rank(self) -> int:
        return self.parallel.rank

    async def run(self, what: str, deadline_s: float, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` off the event loop; on a rank group, one guarded call of every rank
        (``deadline_s`` 0: `DEADLINE_S`)."""
        return await self.parallel.run(what, deadline_s or DEADLINE_S, fn, *args)

    def listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the trainer group's store socket; returns its port."""
        if self._listener is not None:
            self._listener.close()
        self._listener = reserve_listener(host, port)
        return self._listener.getsockname()[1]

    async def join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60.0) -> str:
        """Join the trainer group, shard the policy over it and rebuild the optimiser over the
        shards. Returns the group's backend. Once only: a group that failed is never rebuilt
        (the run stops and resumes from a checkpoint)."""
        if isinstance(self.parallel, Sharded):
            raise RuntimeError(f"trainer rank {rank} is already in a rank group")
        listener, self._listener = (self._listener, None) if rank == 0 else (None, self._listener)

        def join() -> str:
            group = RankGroup.create(
                host, port, rank, world_size, device=self.device, timeout_s=timeout_s, listener=listener
            )
            try:
                self._shard()
            except BaseException:
                group.close()
                raise
            self.parallel = Sharded(group, self.device)
            return group.backend

        return await asyncio.to_thread(join)

    def abort_call(self, failed_rank: int, reason: str) -> None:
        """The driver saw trainer rank ``failed_rank`` die: leave the collective running now."""
        self.parallel.abort_call(failed_rank, reason)

    async def close(self) -> None:
        """Release the reserved socket and leave the group. Idempotent."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        parallel, self.parallel = self.parallel, Local()
        await asyncio.to_thread(parallel.close)
