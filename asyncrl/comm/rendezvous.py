"""Rendezvous plane: a small fixed group of processes that meet on a torch `TCPStore`.

In the spirit of vLLM's StatelessProcessGroup: the group owns its store and never touches
`torch.distributed`'s global default group, so a process can hold several groups, and a group can
be dropped and rebuilt (new generation) without restarting anyone.

Contract, which keeps every wait bounded:

* Rank 0 hosts the store on an explicit address. It binds the listening socket itself
  (`reserve_listener`), so a port in use fails at once, port 0 picks a free one, and the address
  is known before anyone is told to join.
* All members are asked to join *concurrently* (`join_all` in the driver starts every join and
  waits for all under one deadline). A member that is never started therefore shows up as a
  `RendezvousTimeoutError` naming its rank on every other member, never as a hang.
* Every key lives under ``asyncrl/<name>/g<generation>/``, so a rebuilt group (next generation)
  can never read a key a previous one left behind, even on the same store address.
* Objects are msgspec-encoded (never pickled) and decoded to the type the caller names.
* Calls are collective: every member makes the same sequence of `barrier` / `broadcast_obj` /
  `all_gather_obj` calls; each call gets its own sequence number, hence its own keys. The store is
  for set-up metadata (a few small objects per membership), not for per-step traffic.
* One verdict per call. The first member whose deadline passes writes a tombstone into the key of
  every member still missing (`compare_set`: a member that arrived meanwhile keeps its key). That
  wakes every other waiter at once, and all of them, the late member included when it finally
  comes, read the same keys and so name the same missing ranks. Members' deadlines differ (each
  starts its own clock; a loaded machine adds seconds), so without this the first to give up
  could be rank 0, whose store goes with it, and the others would see the store vanish instead
  of learning who was missing. For the same reason rank 0, after a verdict, waits (at most
  `VERDICT_GRACE_S`) until every member that arrived has read it before its store can go.
"""

from __future__ import annotations

import asyncio
import datetime
import errno
import os
import socket
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar, overload

import msgspec
import torch.distributed as dist

from asyncrl.comm.address import check_name, check_rank, check_timeout
from asyncrl.comm.errors import RendezvousError, RendezvousTimeoutError
from asyncrl.runtime.net import reachable_address

T = TypeVar("T")

VERDICT_GRACE_S = 5.0
"""After a verdict, how long rank 0 keeps its store up for the members that arrived to read it."""
_ABSENT = b"\x00asyncrl:absent"
"""The tombstone of a member declared missing. Never a member's value: b"\x00" alone is a whole
msgpack object, so no msgpack encoding of one object has more bytes after it (and a barrier's
marker is b"\x01"). Values are never empty either: `compare_set` takes "" to mean "no key yet"."""


class _Hello(msgspec.Struct, array_like=True, frozen=True):
    """What each member announces on joining; checked by every other member."""

    rank: int
    world_size: int
    pid: int
    host: str


def reserve_listener(host: str, port: int = 0) -> socket.socket:
    """Bind and listen on ``(host, port)`` for rank 0's store. Port 0 lets the OS pick one; read it
    back with ``sock.getsockname()[1]``. A port in use raises `RendezvousError` at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RendezvousError(f"cannot host the rendezvous store on {host}:{port}: port in use") from exc
        raise RendezvousError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from exc
    return sock


def local_address_towards(host: str) -> str:
    """The local address that reaches ``host``; members announce it and bind data sockets there."""
    try:
        return reachable_address(host)
    except OSError as exc:
        raise RendezvousError(f"no route to the rendezvous host: {exc}") from exc


class StoreGroup:
    """A member of a rendezvous group. Build with `StoreGroup.create`; close with `close()`."""

    def __init__(
        self,
        *,
        store: dist.Store,
        name: str,
        generation: int,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        timeout_s: float,
        hosts: list[str],
    ):
        self.store = store  # a PrefixStore: keys below are relative to this group and generation
        self.name = name
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.member_hosts = hosts  # member r's own reachable address, as announced on joining
        self.key_prefix = ""  # where ``store``'s keys live in the raw store (`second_connection`)
        self._seq = 0
        self._closed = False

    @property
    def label(self) -> str:
        """``name/g<generation>``: unique per membership; communicators are named after it."""
        return f"{self.name}/g{self.generation}"

    # -- joining -----------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 60.0,
        *,
        name: str = "weights",
        generation: int = 0,
        listener: socket.socket | None = None,
    ) -> StoreGroup:
        """Join the group whose store rank 0 hosts at ``host:port``; return once all
        ``world_size`` members have joined and agree on the world size.

        Rank 0 hosts the store, on ``listener`` if given (see `reserve_listener`), else on a socket
        it binds to ``host:port`` itself. Blocks for at most about ``timeout_s``; raises
        `RendezvousTimeoutError` naming the ranks that never arrived."""
        check_rank(rank, world_size)
        check_timeout(timeout_s)
        check_name(name)
        deadline = time.monotonic() + timeout_s  # one deadline for connecting and for meeting
        raw, port = _open_store(host, port, rank, timeout_s, listener)
        prefix = f"asyncrl/{name}/g{generation}/"
        store = dist.PrefixStore(prefix, raw)
        my_host = local_address_towards(host)
        label = f"{name}/g{generation}"
        claims = store.add(f"claim/{rank}", 1)
        if claims != 1:
            raise RendezvousError(f"group {label!r}: rank {rank} was claimed by another member too")
        meeting = _Meeting(store, label, rank, world_size)
        hello = msgspec.msgpack.encode(_Hello(rank, world_size, os.getpid(), my_host))
        values = meeting.gather("hello", hello, deadline, timeout_s, "joining")
        hellos = [msgspec.msgpack.decode(v, type=_Hello) for v in values]
        for peer in hellos:
            if peer.world_size != world_size:
                raise RendezvousError(
                    f"group {label!r}: rank {peer.rank} (pid {peer.pid} on {peer.host}) joined with "
                    f"world size {peer.world_size}, rank {rank} with {world_size}"
                )
        group = cls(
            store=store,
            name=name,
            generation=generation,
            rank=rank,
            world_size=world_size,
            host=host,
            port=port,
            timeout_s=timeout_s,
            hosts=[h.host for h in hellos],
        )
        group.key_prefix = prefix
        return group

    # -- collective helpers on the store -----------------------------------------------------
    def barrier(self, timeout_s: float | None = None, what: str = "barrier") -> None:
        """Return once every member reached the same barrier; name the ranks that did not."""
        self._meeting().gather(self._next_key("barrier"), b"\x01", *self._deadline(timeout_s), what)

    # Without ``type`` the value is decoded as msgpack gives it (Any); with it, as that type.
    @overload
    def broadcast_obj(
        self, obj: Any = None, src: int = 0, *, type: type[T], timeout_s: float | None = None, what: str = ...
    ) -> T: ...
    @overload
    def broadcast_obj(
        self, obj: Any = None, src: int = 0, type: Any = Any, timeout_s: float | None = None, what: str = ...
    ) -> Any: ...
    def broadcast_obj(
        self,
        obj: Any = None,
        src: int = 0,
        type: Any = Any,
        timeout_s: float | None = None,
        what: str = "broadcast_obj",
    ) -> Any:
        """Rank ``src`` passes ``obj``; every member returns it, decoded as ``type``."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"src {src} is not a rank of a world of size {self.world_size}")
        value = msgspec.msgpack.encode(obj) if self.rank == src else None
        value = self._meeting().broadcast(
            self._next_key("bcast"), value, src, *self._deadline(timeout_s), f"{what} from rank {src}"
        )
        return msgspec.msgpack.decode(value, type=type)

    @overload
    def all_gather_obj(
        self, obj: Any, *, type: type[T], timeout_s: float | None = None, what: str = ...
    ) -> list[T]: ...
    @overload
    def all_gather_obj(
        self, obj: Any, type: Any = Any, timeout_s: float | None = None, what: str = ...
    ) -> list[Any]: ...
    def all_gather_obj(
        self, obj: Any, type: Any = Any, timeout_s: float | None = None, what: str = "all_gather_obj"
    ) -> list[Any]:
        """Every member passes one object; every member returns the list, indexed by rank."""
        values = self._meeting().gather(
            self._next_key("gather"), msgspec.msgpack.encode(obj), *self._deadline(timeout_s), what
        )
        return [msgspec.msgpack.decode(v, type=type) for v in values]

    def subgroup(self, tag: str, ranks: list[int]) -> StoreGroup:
        """The members ``ranks`` (this one among them) as a group of their own, ranked in that order,
        on keys of their own in this group's store: for a communicator of a subset (`tiered.py`). No
        meeting: every member of the subset calls this with the same arguments."""
        if self.rank not in ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"group {self.label!r}: rank {self.rank} is not once in the subgroup {ranks}")
        sub = StoreGroup(
            store=dist.PrefixStore(f"sub/{tag}/", self.store),
            name=f"{self.name}-{tag}",
            generation=self.generation,
            rank=ranks.index(self.rank),
            world_size=len(ranks),
            host=self.host,
            port=self.port,
            timeout_s=self.timeout_s,
            hosts=[self.member_hosts[r] for r in ranks],
        )
        sub.key_prefix = f"{self.key_prefix}sub/{tag}/"
        return sub

    @property
    def calls(self) -> int:
        """Store-side calls this member made in the group so far: the same on every member
        between two of them (every member makes the same calls, in the same order)."""
        return self._seq

    def second_connection(self, timeout_s: float | None = None) -> dist.Store:
        """Another connection to this group's store, under the same keys: for a thread that
        waits on it while this member's other calls use the first (a connection serves one call
        at a time)."""
        if self._closed:
            raise RendezvousError(f"group {self.label!r}: rank {self.rank} already closed its store")
        timeout = datetime.timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        try:
            raw = dist.TCPStore(self.host, self.port, None, False, timeout)
        except dist.DistError as exc:
            raise RendezvousError(f"group {self.label!r}: could not connect to the store again: {exc}") from exc
        return dist.PrefixStore(self.key_prefix, raw)

    def close(self) -> None:
        """Drop this member's store handle (rank 0's also stops the store server). Idempotent."""
        if not self._closed:
            self._closed = True
            self.store = None  # type: ignore[assignment]  # the last reference closes the socket

    def __enter__(self) -> StoreGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<StoreGroup {self.label} rank={self.rank}/{self.world_size} store={self.host}:{self.port}>"

    # -- internals ----------------------------------------------------------------------------
    def _next_key(self, kind: str) -> str:
        if self._closed:
            raise RendezvousError(f"group {self.label!r}: rank {self.rank} already closed its store")
        self._seq += 1
        return f"{kind}/{self._seq}"

    def _deadline(self, timeout_s: float | None) -> tuple[float, float]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        return time.monotonic() + timeout_s, timeout_s

    def _meeting(self) -> _Meeting:
        return _Meeting(self.store, self.label, self.rank, self.world_size)


class _Meeting:
    """One member's side of the store-side calls of one group: each call is a set of keys, one per
    member who must arrive (``<tag>/<rank>``, or the source's key of a broadcast), waited for
    under a deadline, with one verdict for everyone if the deadline passes (see the module doc)."""

    def __init__(self, store: dist.Store, label: str, rank: int, world_size: int):
        self.store, self.label, self.rank, self.world_size = store, label, rank, world_size

    def gather(self, tag: str, value: bytes, end: float, timeout_s: float, what: str) -> list[bytes]:
        """Put this member's ``value`` under ``tag`` and return every member's, by rank, once all
        are there (``end``: the deadline, on `time.monotonic`; ``timeout_s``: for the message)."""
        keys = [f"{tag}/{r}" for r in range(self.world_size)]
        self._arrive(keys[self.rank], value, timeout_s, what)
        return self._wait(tag, keys, list(range(self.world_size)), end, timeout_s, what)

    def broadcast(self, tag: str, value: bytes | None, src: int, end: float, timeout_s: float, what: str) -> bytes:
        """``value`` from rank ``src`` (which passes it; the others pass None)."""
        if value is not None:
            self._arrive(tag, value, timeout_s, what)
        return self._wait(tag, [tag], [src], end, timeout_s, what)[0]

    def _arrive(self, key: str, value: bytes, timeout_s: float, what: str) -> None:
        """Set our key unless a verdict already declared us missing: then we are too late, and
        say so at once (everyone else has given up on us) instead of waiting out our deadline."""
        try:
            current = self.store.compare_set(key, "", value)  # type: ignore[arg-type]  # stub says str; bytes taken
        except dist.DistError as exc:
            raise self._lost(what, exc) from exc
        if current == _ABSENT:
            raise RendezvousTimeoutError(self.label, what, [self.rank], timeout_s)

    def _wait(
        self, tag: str, keys: list[str], ranks: list[int], end: float, timeout_s: float, what: str
    ) -> list[bytes]:
        """Every key's value once all exist; else `RendezvousTimeoutError` naming the ranks the
        verdict declared missing, the same ranks on every member."""
        try:
            self.store.wait(keys, datetime.timedelta(seconds=max(end - time.monotonic(), 0.001)))
        except dist.DistNetworkError as exc:
            raise self._lost(what, exc) from exc
        except dist.DistError:  # our deadline passed first: declare whoever is still missing
            try:
                for key in keys:
                    # One that arrived meanwhile keeps its key. (torch's stub says str; the binding takes bytes.)
                    self.store.compare_set(key, "", _ABSENT)  # type: ignore[arg-type]
            except dist.DistError as exc:
                raise self._lost(what, exc) from exc
        try:
            values = self.store.multi_get(keys)
        except dist.DistError as exc:
            raise self._lost(what, exc) from exc
        missing = [r for r, v in zip(ranks, values) if v == _ABSENT]
        if missing:
            self._settle(tag, missing, timeout_s)
            raise RendezvousTimeoutError(self.label, what, missing, timeout_s)
        return values

    def _settle(self, tag: str, missing: list[int], timeout_s: float) -> None:
        """After a verdict: say we read it; rank 0 (the store's host, whose store ends with it)
        waits, bounded, until everyone expected here has read it too."""
        try:
            self.store.set(f"{tag}/read/{self.rank}", b"")  # type: ignore[arg-type]  # stub says str; bytes taken
            if self.rank == 0:
                readers = [f"{tag}/read/{r}" for r in range(1, self.world_size) if r not in missing]
                if readers:
                    self.store.wait(readers, datetime.timedelta(seconds=min(VERDICT_GRACE_S, timeout_s)))
        except dist.DistError:
            pass  # a reader that never comes (gone, or not in this call) only costs the grace

    def _lost(self, what: str, exc: BaseException) -> RendezvousError:
        return RendezvousError(f"group {self.label!r}: lost the store while waiting for {what}: {exc}")


async def join_all(joins: Sequence[Awaitable[T]], timeout_s: float, what: str = "join the group") -> list[T]:
    """Run every member's join concurrently and wait for all, under one deadline.

    This is the driver's half of the rendezvous contract: members must be started together, so
    that none waits on a peer nobody started. Raises `RendezvousError` listing every member that
    failed (by position in ``joins``) if any did; a member still pending at the deadline counts as
    failed with a timeout."""
    tasks = [asyncio.ensure_future(j) for j in joins]
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    failures = []
    for index, task in enumerate(tasks):
        if task in pending:
            failures.append(f"member {index}: no answer within {timeout_s:g} s")
        elif task.exception() is not None:
            failures.append(f"member {index}: {task.exception()}")
    if failures:
        raise RendezvousError(f"{len(failures)} of {len(tasks)} members failed to {what}:\n  " + "\n  ".join(failures))
    return [task.result() for task in tasks]


def _open_store(
    host: str, port: int, rank: int, timeout_s: float, listener: socket.socket | None
) -> tuple[dist.Store, int]:
    """Rank 0 hosts the store (returning the port it really listens on); others connect."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        listener = listener if listener is not None else reserve_listener(host, port)
        port = listener.getsockname()[1]
        # TCPStore takes the listening socket over (and closes it with the store).
        store = dist.TCPStore(
            host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach()
        )
        return store, port
    try:
        return dist.TCPStore(host, port, None, False, timeout), port
    except dist.DistError as exc:
        raise RendezvousTimeoutError(f"{host}:{port}", "the store that rank 0 hosts", [0], timeout_s) from exc
