"""CPU collectives: torch's `ProcessGroupGloo`, built directly on a `StoreGroup`'s store.

No `init_process_group`, no global state: the process group is an object this communicator owns.
Gloo runs each operation on its own threads, so an enqueued broadcast proceeds while the caller
packs the next bucket; that is what makes the double buffering in `weights.py` pay off on CPU too.
A peer that dies closes its TCP pairs and every member's pending work fails within milliseconds; a
frozen peer trips the deadline, after which gloo closes the pairs itself.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from asyncrl.comm.communicator import Communicator, ReduceOp, Work, cuda_stream
from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError
from asyncrl.comm.rendezvous import StoreGroup, local_address_towards
from asyncrl.errors import first_line

_REDUCE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


class GlooWork(Work):
    def __init__(self, comm: GlooCommunicator, work: dist.Work, what: str):
        self._comm = comm
        self._work = work
        self._what = what

    def done(self) -> bool:
        return self._work.is_completed()

    def wait(self, timeout_s: float) -> None:
        comm = self._comm
        try:
            self._work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            # gloo says "Timed out waiting 2999ms for recv" when its own per-operation limit fires
            # first (a loaded machine): that is a timeout too, not a peer's failure.
            text = str(exc).lower()
            timed_out = "timed out" in text or "timeout" in text
            reason = f"{'timed out' if timed_out else 'failed'} during {self._what}"
            comm.abort(reason)
            where = f"group {comm.group!r} rank {comm.rank}/{comm.world_size} (gloo)"
            if timed_out:
                raise CollectiveTimeoutError(
                    f"{where}: {self._what} did not complete within {timeout_s:g} s "
                    f"(a peer is frozen, gone, or never joined); communicator aborted"
                ) from exc
            raise CollectiveError(
                f"{where}: {self._what} failed, a peer died or closed its connection: "
                f"{first_line(exc)}; communicator aborted"
            ) from exc


class GlooCommunicator(Communicator):
    backend = "gloo"

    def __init__(self, pg: ProcessGroupGloo, group: StoreGroup, timeout_s: float):
        # Any: torch's stub of ProcessGroupGloo lacks its collectives (broadcast, allreduce, send, recv).
        self._pg: Any = pg
        self._timeout_s = timeout_s
        super().__init__(group=group.label, rank=group.rank, world_size=group.world_size, device=torch.device("cpu"))

    @classmethod
    def create(cls, group: StoreGroup, timeout_s: float = 60.0) -> GlooCommunicator:
        """Connect every member's gloo pairs (all members call this together). ``timeout_s`` bounds
        the connection and is gloo's own per-operation limit; `Work.wait` deadlines come on top."""
        options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the stub names it Options
        options._timeout = datetime.timedelta(seconds=timeout_s)
        # Bind on the interface that reaches the store host, never a wildcard address.
        options._devices = [ProcessGroupGloo.create_device(hostname=local_address_towards(group.host))]
        store = dist.PrefixStore("gloo/", group.store)
        start = time.monotonic()
        # gloo waits for its peers' addresses with the store's own timeout (the one the group was
        # made with), not with _timeout: bound that wait by ours too, for this call only.
        previous = store.timeout  # type: ignore[attr-defined]  # a property the stub lacks
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            pg = ProcessGroupGloo(store, group.rank, group.world_size, options)
        except RuntimeError as exc:
            raise CollectiveTimeoutError(
                f"group {group.label!r} rank {group.rank}: gloo could not connect to every peer within "
                f"{timeout_s:g} s ({time.monotonic() - start:.1f} s spent): {first_line(exc)}"
            ) from exc
        finally:
            store.set_timeout(previous)
        return cls(pg, group, timeout_s)

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        self._check_op(tensor, "broadcast")
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self._set_timeout(options, timeout_s)
        return GlooWork(self, self._pg.broadcast([tensor], options), f"broadcast from rank {src}")

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.Stream | None = None,
        timeout_s: float | None = None,
    ) -> Work:
        self._check_op(tensor, "all_reduce")
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(_REDUCE_OPS[ReduceOp(op)])
        self._set_timeout(options, timeout_s)
        return GlooWork(self, self._pg.allreduce([tensor], options), f"all_reduce({ReduceOp(op).name})")

    def send(
        self, tensor: torch.Tensor, dst: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        self._check_op(tensor, "send")
        return GlooWork(self, self._pg.send([tensor], dst, 0), f"send to rank {dst}")

    def recv(
        self, tensor: torch.Tensor, src: int, *, stream: torch.Stream | None = None, timeout_s: float | None = None
    ) -> Work:
        self._check_op(tensor, "recv")
        return GlooWork(self, self._pg.recv([tensor], src, 0), f"recv from rank {src}")

    @staticmethod
    def _set_timeout(options: Any, timeout_s: float | None) -> None:
        if timeout_s is not None:
            options.timeout = datetime.timedelta(seconds=max(timeout_s, 0.001))

    def _check_op(self, tensor: torch.Tensor, what: str) -> None:
        self._check_open(what)
        self._check_tensor(tensor, what)

    def _abort(self) -> None:
        # Closing the pairs wakes gloo's threads blocked on a frozen peer; peers see the
        # connection close and fail their own pending work at once instead of at their deadline.
        holder, self._pg = [self._pg], None
        try:
            holder[0].abort()
        except RuntimeError:
            pass
        # gloo's destructor joins its worker threads, which can sit in an operation on a frozen
        # peer until gloo's own timeout; the last reference is dropped on a daemon thread so
        # that wait never lands on the caller (often an event loop).
        threading.Thread(target=holder.clear, name="asyncrl-gloo-release", daemon=True).start()

    def _destroy(self) -> None:
        # No operation is in flight on a healthy group, so the destructor returns at once.
        pg, self._pg = self._pg, None
        pg.shutdown()
        del pg


def all_reduce_on_host(
    control: GlooCommunicator, tensor: torch.Tensor, op: ReduceOp, *, stream: torch.Stream | None, timeout_s: float
) -> None:
    """Reduce ``tensor`` (on a device) over ``control`` through host memory, to completion: the few
    integers of a sync's votes, for the communicators whose bytes go another way (cuda_ipc.py,
    tiered.py). ``stream``: the one whose work on ``tensor`` must come first (None: the current)."""
    with torch.cuda.stream(cuda_stream(stream, tensor.device)) if stream is not None else contextlib.nullcontext():
        host = tensor.cpu()  # waits for the stream's work on the tensor
        control.all_reduce(host, op, timeout_s=timeout_s).wait(timeout_s)
        tensor.copy_(host)
