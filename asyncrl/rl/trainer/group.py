"""The trainer's rank group: N trainer processes as one torch.distributed world, and the guard that
makes a failure on one rank end every rank's collective within the step's deadline.

Formation. The ranks meet on our own rendezvous (`StoreGroup`, at the `SyncAddress` the driver
gives them all, named ``trainer``; rank 0 hosts the store), and torch's default process group is made from that
store (`init_process_group(store=...)`): no MASTER_ADDR / RANK / WORLD_SIZE for anyone to set.
FSDP2, DTensor and DCP need a registered group; it lives in the trainer's own process, which
holds nothing else. On CPU the group is gloo bound to the address that reaches the store host
(registered as the ``asyncrl_gloo`` backend: torch's plain "gloo" binds to whatever the host name
resolves to, which on a multi-homed node may not reach the peers); on CUDA it is NCCL.

NCCL-safe calls (`RankGroup.run`). Every call that runs collectives on the group (a train step,
a weight gather, a checkpoint) runs inside the guard, and every rank makes the same sequence of
guarded calls, so call ``k`` on one rank is call ``k`` on every other. Invariants:

* A rank whose call raises writes one `RankFailure` into every peer's key for call ``k``
  (``compare_set``: the first verdict stays) and aborts its process group.
* Every rank runs a watcher for the call, blocked on its own key on a second store connection
  (the first one may be busy). A failure record there, the driver's word that a peer died
  (`abort_call`), or the call's deadline aborts the process group and answers the call at once,
  with `PeerRankFailedError` (naming the rank that failed, and why) or `StepDeadlineError`. The
  answer does not wait for the collective to return: gloo's abort does not wake a blocked
  operation (measured: it waits out its own timeout), NCCL's does. A rank that finishes writes
  ``done`` into its own key to free its watcher.
* A peer that is SIGKILLed writes nothing: gloo sees its connections close at once; NCCL does
  not, so the driver, which sees the death, tells the survivors (`abort_call`) and the deadline
  is the last resort. The store itself lives in rank 0: when rank 0 dies, the others' watchers
  lose it and abort at once.
* After any failure the group is dead (a collective can never be re-matched across ranks):
  every later call raises `RankGroupClosedError` at once. The run stops and resumes from its
  last checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.rendezvous import StoreGroup, local_address_towards
from asyncrl.errors import first_line
from asyncrl.rl.trainer.errors import (
    PeerRankFailedError,
    RankCollectiveError,
    RankGroupClosedError,
    RankGroupError,
    StepDeadlineError,
)

T = TypeVar("T")
GLOO_BACKEND = "asyncrl_gloo"
_DONE = b"\x01done"
WATCH_MARGIN_S = 2.0
"""The watcher's deadline is the call's minus this, so a rank's typed error reaches the driver
before the driver's own deadline for the call passes."""


class RankFailure(msgspec.Struct, array_like=True, frozen=True):
    """What a failing rank tells its peers, through the store (msgspec, never pickle)."""

    rank: int
    what: str
    error: str  # "TypeName: first line"


def _gloo_backend(options, _backend_options=None):
    """torch's gloo, with its device bound to the address that reaches the group's store host."""
    pg_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: not in torch's stubs
    pg_options._timeout = options.timeout
    pg_options._devices = [dist.ProcessGroupGloo.create_device(hostname=_GLOO_ADDRESS[0])]
    return dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, pg_options)


_GLOO_ADDRESS = ["127.0.0.1"]  # set before the group is created; one group per process


class RankGroup:
    """This process's membership of the trainer rank group. Build with `create`; `close()` ends it."""

    def __init__(self, group: StoreGroup, watch_store: dist.Store, backend: str, timeout_s: float):
        self.group, self.backend = group, backend
        self.rank, self.world_size = group.rank, group.world_size
        self._watch_store: dist.Store | None = watch_store
        self._guard_store = dist.PrefixStore("guard/", group.store)  # the same keys as watch_store's
        self._timeout_s = timeout_s
        self._calls = 0
        self._failure: RankFailure | None = None  # a peer's record, or our own deadline, once aborted
        self._current: tuple[str, float, Future] | None = None  # the call running now
        self._closed = ""  # why the group can no longer be used

    @classmethod
    def create(
        cls, address: SyncAddress, rank: int, *, device: torch.device, listener: socket.socket | None = None
    ) -> RankGroup:
        """Join the group at ``address`` as ``rank`` (all ranks call this together; one deadline,
        ``address.timeout_s``, for the rendezvous and the process group) and make torch's default
        process group from it: NCCL on CUDA, gloo elsewhere (``address.backend`` is not read).
        Rank 0 hosts the store, on ``listener`` if given. Raises `RendezvousTimeoutError` naming
        ranks that never came."""
        if dist.is_initialized():
            raise RankGroupError("this process already has a default process group; a trainer rank joins one group")
        address.check_rank(rank)
        host, world_size, timeout_s = address.host, address.world_size, address.timeout_s
        group = StoreGroup.create(
            host,
            address.port,
            rank,
            world_size,
            timeout_s,
            name=address.name,
            generation=address.generation,
            listener=listener,
        )
        try:
            if device.type == "cuda":
                backend = "nccl"
            else:
                backend = GLOO_BACKEND
                _GLOO_ADDRESS[0] = local_address_towards(host)
                if GLOO_BACKEND not in dist.Backend.backend_list:
                    dist.Backend.register_backend(GLOO_BACKEND, _gloo_backend, extended_api=True, devices=["cpu"])
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("c10d/", group.store),
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
            # A second connection for the watchers: a TCPStore client serialises its calls, and a
            # watcher blocked in wait() must not hold up this rank's own writes.
            watch = dist.PrefixStore("guard/", group.second_connection())
        except BaseException:
            if dist.is_initialized():
                dist.destroy_process_group()
            group.close()
            raise
        return cls(group, watch, backend, timeout_s)

    @property
    def dead(self) -> str:
        """Why the group can no longer run collectives ("" while it can)."""
        return self._closed

    def run(self, what: str, timeout_s: float, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` as call ``k`` of the group on a thread of its own, inside the guard
        (see the module docstring), and return a future of its result. The future is settled by
        ``fn``'s end or, sooner, by the guard's verdict: a peer's failure, the driver's word that
        a peer died, or the deadline. A collective blocked in the library may not return when its
        group is aborted (gloo waits out its own timeout), so the answer does not wait for it:
        the thread is a daemon, left to end with its collective or with the process, and the
        group refuses every later call."""
        if self._closed:
            raise RankGroupClosedError(f"trainer rank {self.rank}: cannot run {what}: the rank group {self._closed}")
        self._calls += 1
        key = f"{self._calls}/"
        future: Future[T] = Future()
        self._current = (what, timeout_s, future)
        done = threading.Event()
        watcher = threading.Thread(
            target=self._watch,
            args=(key, what, max(timeout_s - WATCH_MARGIN_S, 0.5), done),
            name=f"asyncrl-rank-guard-{self._calls}",
            daemon=True,
        )

        def call() -> None:
            try:
                value = fn(*args)
            except BaseException as exc:
                _settle(future, error=self._own_failure(key, what, exc))
            else:
                _settle(future, value=value)
            finally:
                self._release(key, done)

        watcher.start()
        threading.Thread(target=call, name=f"asyncrl-rank-call-{self._calls}", daemon=True).start()
        return future

    def _own_failure(self, key: str, what: str, exc: BaseException) -> BaseException:
        """The error ``fn`` raised, as this call's answer: every peer is told (the first verdict
        stays), the group aborted, and a collective's failure caused by a peer's death typed so."""
        if self._failure is not None:  # the guard's verdict came first (the future holds it)
            return exc
        self._tell_peers(key, RankFailure(self.rank, what, f"{type(exc).__name__}: {first_line(exc)}"))
        self._abort(f"failed during {what}")
        if _peer_went_away(exc):
            error = RankCollectiveError(
                f"trainer rank {self.rank}: a collective failed during {what} "
                f"(a peer died or closed its connection): {first_line(exc)}"
            )
            error.__cause__ = exc
            return error
        return exc

    def abort_call(self, failed_rank: int, reason: str) -> None:
        """The driver saw rank ``failed_rank`` die (it left no record): leave whatever collective
        runs now, naming it."""
        self._fail(RankFailure(failed_rank, "the current call", reason))

    def barrier(self, what: str, timeout_s: float | None = None) -> None:
        """A store-side barrier (no collective): every rank reached ``what``."""
        self.group.barrier(timeout_s=timeout_s, what=what)

    def close(self) -> None:
        """Leave the group: the process group goes (aborted if it failed), then the store. Idempotent."""
        if self._closed != "closed":
            if dist.is_initialized():
                if self._closed:
                    self._abort_pg()
                else:
                    dist.destroy_process_group()
            self._closed = "closed"
            self._watch_store = None  # its connection closes with the last reference
            self.group.close()

    # -- internals ----------------------------------------------------------------------------
    def _watch(self, key: str, what: str, timeout_s: float, done: threading.Event) -> None:
        own = key + str(self.rank)
        store = self._watch_store
        if store is None:  # closed: no call is watched any more
            return
        try:
            store.wait([own], datetime.timedelta(seconds=timeout_s))
            value = store.get(own)
        except dist.DistNetworkError:  # the store is rank 0's: it is gone
            if not done.is_set():
                self._fail(RankFailure(0, what, "the trainer group's store (rank 0) went away"))
            return
        except dist.DistError:  # our deadline passed with no verdict
            if not done.is_set():
                self._fail(RankFailure(self.rank, what, f"deadline of {timeout_s:g} s passed"))
            return
        if value != _DONE:  # a peer failed: even if our part is done, the ranks no longer agree
            self._fail(msgspec.msgpack.decode(value, type=RankFailure))

    def _fail(self, failure: RankFailure) -> None:
        """The guard's verdict on the current call: abort the group, answer the call at once."""
        if self._failure is not None or self._closed == "closed":
            return
        self._failure = failure
        self._abort(f"trainer rank {failure.rank} failed" if failure.rank != self.rank else "deadline passed")
        if self._current is not None:
            what, timeout_s, future = self._current
            if failure.rank == self.rank:
                _settle(
                    future,
                    error=StepDeadlineError(
                        f"trainer rank {self.rank}: {what} did not finish within {timeout_s:g} s; left its collectives"
                    ),
                )
            else:
                _settle(future, error=PeerRankFailedError(self.rank, failure.rank, failure.what, failure.error))

    def _tell_peers(self, key: str, failure: RankFailure) -> None:
        value = msgspec.msgpack.encode(failure)
        try:
            for r in range(self.world_size):
                if r != self.rank:
                    self._guard_store.compare_set(key + str(r), "", value)  # type: ignore[arg-type]  # bytes: stubs say str
        except dist.DistError:
            pass  # the store (rank 0) is gone: the peers lose it too and abort by themselves

    def _release(self, key: str, done: threading.Event) -> None:
        done.set()
        with contextlib.suppress(dist.DistError, AttributeError):
            self._guard_store.compare_set(key + str(self.rank), "", _DONE)  # type: ignore[arg-type]  # bytes: stubs say str

    def _abort(self, reason: str) -> None:
        if not self._closed:
            self._closed = f"failed ({reason})"
            self._abort_pg()

    @staticmethod
    def _abort_pg() -> None:
        """Close the process group's connections without waiting for peers: a blocked collective
        on this rank returns with an error, and gloo peers see the connections close."""
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.distributed_c10d._get_default_group().abort()


def _settle(future: Future[Any], value: object = None, error: BaseException | None = None) -> None:
    """The first of the call's end and the guard's verdict answers; the other is dropped."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


def _peer_went_away(exc: BaseException) -> bool:
    """A collective failed because a peer's connection closed (it died): the peer is the cause."""
    text = str(exc)
    return isinstance(exc, dist.DistNetworkError) or "Connection closed by peer" in text or "Connection reset" in text
