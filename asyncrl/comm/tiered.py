"""A weight-sync group with more than one member on some GPU: NCCL between GPUs, CUDA IPC within one.

NCCL refuses two ranks of one communicator on one device, yet a sampler GPU does most with two vLLM
engines on it: each engine's client process is one saturated core long before the GPU is busy
(benchmarks/README.md, "Every GPU of a host"). So such a group is joined in two tiers. The lowest
rank on each GPU, its *leader*, is a rank of an NCCL communicator of the leaders; the members of one
GPU share a CUDA IPC communicator (`cuda_ipc.py`), in which their leader passes on what NCCL brought.

A broadcast from rank ``src`` runs: within ``src``'s GPU over IPC; from ``src``'s leader to every
other leader over NCCL; within each other GPU from its leader over IPC. A leader with mates waits
for the NCCL part before it exports the bytes (another process cannot wait on its stream), so only
a leader without mates (the trainer on a GPU of its own) gets the NCCL work back still running, and
its double buffering (`weights.py`) works as before. ``all_reduce`` (the sync's votes: a few
integers) goes through host memory on gloo over the whole group.

`nccl_or_tiered` is what the ``nccl`` backend makes: plain NCCL where every member has a GPU of its
own (as before), this where some share one. A failure in any tier aborts every tier here; the group
is rebuilt, as for any other backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from asyncrl.comm.communicator import Communicator, CompletedWork, ReduceOp, Work
from asyncrl.comm.gloo import GlooCommunicator, all_reduce_on_host
from asyncrl.comm.rendezvous import StoreGroup

TierFactory = Callable[[StoreGroup, torch.device, float], Communicator]
"""Makes one tier's communicator on a subgroup (NCCL between GPUs, IPC within one; gloo in tests)."""


class _TierWork(Work):
    """An NCCL tier's work still running: its failure aborts the other tiers too."""

    def __init__(self, inner: Work, owner: TieredCommunicator):
        self._inner, self._owner = inner, owner

    def wait(self, timeout_s: float) -> None:
        try:
            self._inner.wait(timeout_s)
        except BaseException as exc:
            self._owner.abort(f"its NCCL tier failed: {type(exc).__name__}")
            raise

    def done(self) -> bool:
        return self._inner.done()


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def nccl_or_tiered(group: StoreGroup, device: torch.device | str | int | None, timeout_s: float) -> Communicator:
    """The ``nccl`` backend's communicator: plain NCCL where the members' GPUs are all different,
    a `TieredCommunicator` where some share one (all members call this together)."""
    from asyncrl.comm.cuda_ipc import CudaIpcCommunicator
    from asyncrl.comm.pynccl import NcclCommunicator

    deadline = time.monotonic() + timeout_s
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"NCCL needs a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    places = group.all_gather_obj(gpu_uuid(device), type=str, timeout_s=timeout_s, what="the members' GPU UUIDs")
    left = max(deadline - time.monotonic(), 1e-3)
    if len(set(places)) == len(places):
        return NcclCommunicator.create(group, device, timeout_s=left)
    return TieredCommunicator.create(
        group,
        places,
        device,
        left,
        across=lambda g, d, t: NcclCommunicator.create(g, d, timeout_s=t),
        within=CudaIpcCommunicator.create,
    )


class TieredCommunicator(Communicator):
    backend = "nccl+ipc"

    def __init__(
        self,
        group: StoreGroup,
        gpu_of: list[int],
        device: torch.device,
        control: GlooCommunicator,
        across: Communicator | None,
        within: Communicator | None,
    ):
        self._gpu_of = gpu_of
        """Each rank's GPU, numbered in order of the GPUs' lowest ranks."""
        self._mates = [r for r, g in enumerate(gpu_of) if g == gpu_of[group.rank]]
        self._control, self._across, self._within = control, across, within
        super().__init__(group=group.label, rank=group.rank, world_size=group.world_size, device=device)

    @classmethod
    def create(
        cls,
        group: StoreGroup,
        places: list[str],
        device: torch.device,
        timeout_s: float,
        *,
        across: TierFactory,
        within: TierFactory,
    ) -> TieredCommunicator:
        """All members call this together; ``places[r]``: the GPU rank ``r`` is on (its UUID)."""
        if len(places) != group.world_size:
            raise ValueError(f"{len(places)} places for a group of {group.world_size}")
        deadline = time.monotonic() + timeout_s
        order = list(dict.fromkeys(places))
        gpu_of = [order.index(p) for p in places]
        mine = gpu_of[group.rank]
        leaders = [gpu_of.index(g) for g in range(len(order))]
        mates = [r for r, g in enumerate(gpu_of) if g == mine]
        made: list[Communicator] = []
        try:
            control = GlooCommunicator.create(group, _left(deadline))
            made.append(control)
            # Every leader makes the NCCL tier before any IPC tier, so no member waits on one busy in the other.
            tier_across = None
            if len(leaders) > 1 and group.rank in leaders:
                tier_across = across(group.subgroup("gpus", leaders), device, _left(deadline))
                made.append(tier_across)
            tier_within = None
            if len(mates) > 1:
                tier_within = within(group.subgroup(f"gpu{mine}", mates), device, _left(deadline))
                made.append(tier_within)
        except BaseException:
            for comm in made:
                comm.abort("the tiered communicator's creation failed")
            raise
        return cls(group, gpu_of, device, control, tier_across, tier_within)

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers this member takes part in (``across`` between GPUs, ``within`` its own)."""
        return tuple(name for name, comm in (("across", self._across), ("within", self._within)) if comm is not None)

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        self._check_open("broadcast")
        self._check_tensor(tensor, "broadcast")
        deadline = time.monotonic() + (60.0 if timeout_s is None else timeout_s)
        home = self._gpu_of[src]
        try:
            if self._gpu_of[self.rank] == home:
                if self._within is not None:
                    _pass_on(self._within, tensor, self._mates.index(src), stream, deadline)
                if self._across is None:
                    return CompletedWork()
                return _TierWork(self._across.broadcast(tensor, home, stream=stream, timeout_s=_left(deadline)), self)
            if self._across is not None:  # the across tier's ranks are the leaders by GPU: home's is ``home``
                work = self._across.broadcast(tensor, home, stream=stream, timeout_s=_left(deadline))
                if self._within is None:
                    return _TierWork(work, self)
                work.wait(_left(deadline))  # the bytes are here before the mates map them
            if self._within is not None:
                _pass_on(self._within, tensor, 0, stream, deadline)  # from the leader, local rank 0
            return CompletedWork()
        except BaseException as exc:
            self.abort(f"a tier failed during a broadcast from rank {src}: {type(exc).__name__}")
            raise

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
        except BaseException as exc:
            self.abort(f"its gloo tier failed during an all_reduce: {type(exc).__name__}")
            raise
        return CompletedWork()

    def _tiers(self) -> list[Communicator]:
        return [c for c in (self._control, self._across, self._within) if c is not None]

    def _abort(self) -> None:
        for comm in self._tiers():
            comm.abort(self._closed_reason or "aborted")

    def _destroy(self) -> None:
        for comm in self._tiers():
            comm.close()


def _pass_on(
    within: Communicator, tensor: torch.Tensor, local_src: int, stream: torch.Stream | None, deadline: float
) -> None:
    """The within tier's broadcast from its rank ``local_src``, to completion."""
    within.broadcast(tensor, local_src, stream=stream, timeout_s=_left(deadline)).wait(_left(deadline))


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 1e-3)
