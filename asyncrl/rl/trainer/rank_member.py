"""The endpoints that make a trainer actor one rank of an N-rank trainer (``--trainer.world_size``).

The driver spawns N trainer actors; rank 0 binds the group's store socket (`rank_listen`) and
every rank joins (`rank_join`): each makes torch's default process group from our rendezvous,
shards its policy over it (``trainer/fsdp.py``), rebuilds its optimiser over the shards, and
swaps its strategy (``trainer/parallel.py``) from `Local` to `Sharded`, once. From then on the
trainer's calls are the same code as at world size 1, and those that run collectives run on
every rank inside the group's guard, so a failure on one rank ends the call on all of them
within its deadline (see ``trainer/group.py``).
"""

from __future__ import annotations

import asyncio
import socket

from asyncrl.comm.rendezvous import reserve_listener
from asyncrl.rl.trainer.group import RankGroup
from asyncrl.rl.trainer.parallel import Local, Sharded
from asyncrl.runtime.actor import Actor, endpoint


class RankMember(Actor):
    """Joining a rank group. The actor provides ``parallel`` (its strategy, `Local` until it joins),
    ``device`` and ``_shard_policy``."""

    parallel: Local | Sharded
    _rank_listener: socket.socket | None = None

    @endpoint
    async def rank_listen(self, host: str, port: int = 0) -> int:
        """Rank 0 only: bind the trainer group's store socket; returns its port."""
        if self._rank_listener is not None:
            self._rank_listener.close()
        self._rank_listener = reserve_listener(host, port)
        return self._rank_listener.getsockname()[1]

    @endpoint
    async def rank_join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60.0) -> str:
        """Join the trainer group, shard the policy over it and rebuild the optimiser over the
        shards. Returns the group's backend. Once only: a group that failed is never rebuilt
        (the run stops and resumes from a checkpoint)."""
        if isinstance(self.parallel, Sharded):
            raise RuntimeError(f"trainer rank {rank} is already in a rank group")
        listener, self._rank_listener = (self._rank_listener, None) if rank == 0 else (None, self._rank_listener)

        def join() -> str:
            group = RankGroup.create(
                host, port, rank, world_size, device=self.device, timeout_s=timeout_s, listener=listener
            )
            try:
                self._shard_policy()
            except BaseException:
                group.close()
                raise
            self.parallel = Sharded(group, self.device)
            return group.backend

        return await asyncio.to_thread(join)

    @endpoint
    async def abort_call(self, failed_rank: int, reason: str) -> None:
        """The driver saw trainer rank ``failed_rank`` die: leave the collective running now."""
        self.parallel.abort_call(failed_rank, reason)

    @property
    def rank(self) -> int:
        return self.parallel.rank

    async def on_stop(self) -> None:
        await super().on_stop()
        if self._rank_listener is not None:
            self._rank_listener.close()
            self._rank_listener = None
        parallel, self.parallel = self.parallel, Local()
        await asyncio.to_thread(parallel.close)
