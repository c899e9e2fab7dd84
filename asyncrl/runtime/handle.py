"""``ActorHandle``: the caller's view of an actor. ``await h.method(...)`` is an RPC;
``async for x in h.stream(...)`` consumes a streaming endpoint. A handle stays valid across
restarts: calls made while the actor restarts wait (within their timeout) for the new incarnation.
A handle ``pinned`` to one incarnation sends to that process only: once it is gone, its calls fail
with ``ActorDiedError`` at once, never reaching a replacement that lacks the state they build on.

Typed calls. ``Supervisor.spawn(Squarer, ...)`` returns an ``ActorHandle[Squarer]``, and under mypy
with this package's plugin (``asyncrl.runtime.typing_plugin``) ``h.square`` is a
``RemoteMethod[[x: int], Coroutine[..., float]]``: the endpoint's own parameters, an awaitable of
its return (a stream: its async iterator), checked at every call. At run time the handle is the
same dynamic proxy either way; the type parameter is for the checker only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, cast

from asyncrl.runtime.actor import Actor, EndpointSpec
from asyncrl.runtime.state import ActorState

if TYPE_CHECKING:
    from asyncrl.runtime.record import ActorRecord, ActorStatus

log = logging.getLogger("asyncrl.supervisor")

P = ParamSpec("P")
R = TypeVar("R", covariant=True)
A = TypeVar("A", bound=Actor, covariant=True)


class RemoteMethod(Generic[P, R]):
    """One endpoint of one actor, as its caller sees it: calling it sends the call. ``P`` are the
    endpoint's parameters, ``R`` what a call returns here: an awaitable of the endpoint's result,
    or for a stream its async iterator (the typing plugin fills both in from the actor class)."""

    __slots__ = ("_incarnation", "_record", "_spec", "_timeout_s")

    def __init__(self, record: ActorRecord, spec: EndpointSpec, timeout_s: float, incarnation: int | None = None):
        self._record = record
        self._spec = spec
        self._timeout_s = timeout_s
        self._incarnation = incarnation

    def with_timeout(self, timeout_s: float) -> RemoteMethod[P, R]:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
        return RemoteMethod(self._record, self._spec, timeout_s, self._incarnation)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        # The one place the dynamic call meets its static type: the spec was built from the very
        # method whose signature R was read from (a stream's iterator, else the call's coroutine).
        if self._spec.is_stream:
            return cast(R, self._stream(args, kwargs))
        return cast(R, self._call(args, kwargs))

    async def _call(self, args: tuple, kwargs: dict) -> Any:
        record, timeout_s = self._record, self._timeout_s
        if self._incarnation is not None:  # checked as the call is sent: no await in between
            return await record.client_of(self._incarnation).call(self._spec, args, kwargs, timeout_s)
        client = record.client
        if record.state is ActorState.RUNNING and client is not None:  # a running one has its client
            return await client.call(self._spec, args, kwargs, timeout_s)
        # Starting or restarting: one deadline covers the wait and the call.
        deadline = time.monotonic() + timeout_s
        client = await record.client_within(timeout_s, self._spec.name)
        return await client.call(self._spec, args, kwargs, max(deadline - time.monotonic(), 1e-3))

    async def _stream(self, args: tuple, kwargs: dict) -> AsyncIterator[Any]:
        if self._incarnation is not None:
            client = self._record.client_of(self._incarnation)
        else:
            client = await self._record.client_within(self._timeout_s, self._spec.name)
        async for item in client.stream(self._spec, args, kwargs, self._timeout_s):
            yield item

    def __repr__(self) -> str:
        return f"<remote {self._record.name}.{self._spec.name}>"


class ActorHandle(Generic[A]):
    """Returned by ``Supervisor.spawn``; valid in the supervisor's process. ``A`` is the actor's
    class: each endpoint of it is an attribute of the handle (`RemoteMethod`)."""

    __slots__ = ("_incarnation", "_record", "_specs", "_timeout_s")

    def __init__(
        self,
        record: ActorRecord,
        specs: dict[str, EndpointSpec],
        timeout_s: float | None = None,
        incarnation: int | None = None,
    ):
        self._record = record
        self._specs = specs
        self._timeout_s = timeout_s or record.call_timeout_s
        self._incarnation = incarnation

    @property
    def name(self) -> str:
        return self._record.name

    def info(self) -> ActorStatus:
        """State, pid, restarts and heartbeat age of the actor, as the supervisor sees it now."""
        return self._record.status()

    def kill(self, reason: str, incarnation: int | None = None) -> bool:
        """SIGKILL the actor's running incarnation with its whole process group (children too),
        at once (no graceful stop), recording ``reason``; for an actor on another node its agent
        does it. What follows is what follows any crash: its pending calls fail with
        ``ActorDiedError`` naming ``reason`` and it restarts within ``max_restarts``, else it is
        DEAD. ``incarnation``: kill only that incarnation (the one the caller judged), never a
        replacement. Returns True if a kill was sent; False (and does nothing) if the actor is
        not RUNNING that incarnation: starting, restarting, stopping, dead, stopped, or already
        exiting."""
        record = self._record
        killed = record.kill(f"killed on request: {reason}", incarnation)
        if killed:
            log.warning("actor %s (incarnation %d): killed on request: %s", record.name, record.incarnation, reason)
        return killed

    async def wait_for_incarnation(self, after: int, timeout_s: float) -> ActorStatus:
        """Wait until an incarnation newer than ``after`` runs, the actor is dead or stopped for
        good, or ``timeout_s`` passes, whichever comes first, and return its status then (its
        ``state`` and ``incarnation`` say which). Sends nothing to the actor: a restart that
        takes long is waited for by its state, not misread as a call that timed out."""
        return await self._record.wait_until(
            lambda r: r.state is ActorState.RUNNING and r.incarnation > after, timeout_s
        )

    async def wait_for_state(self, states: Iterable[ActorState], timeout_s: float) -> ActorStatus:
        """Wait until the actor's state is one of ``states``, it is dead or stopped for good (a
        final state it never leaves), or ``timeout_s`` passes, whichever comes first, and return
        its status then. Woken by each change of state; sends nothing to the actor."""
        wanted = frozenset(ActorState(s) for s in states)
        if not wanted:
            raise ValueError("states must name at least one ActorState")
        return await self._record.wait_until(lambda r: r.state in wanted, timeout_s)

    def with_timeout(self, timeout_s: float) -> ActorHandle[A]:
        """The same actor, with ``timeout_s`` as the default deadline of its calls."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {timeout_s!r}")
        return ActorHandle(self._record, self._specs, timeout_s, self._incarnation)

    def pinned(self, incarnation: int) -> ActorHandle[A]:
        """The same actor, its calls sent to ``incarnation`` only (``info().incarnation`` when it
        was judged running). For calls that build on what an earlier call left in that process (a
        receiver set up, then weights received): once that process is gone, each call fails at
        once with ``ActorDiedError`` naming how it ended, instead of waiting for a restart and
        reaching a new process that has none of it."""
        return ActorHandle(self._record, self._specs, self._timeout_s, incarnation)

    def __getattr__(self, attr: str) -> RemoteMethod[..., Any]:
        spec = self._specs.get(attr)
        if spec is None:
            known = ", ".join(sorted(self._specs)) or "none"
            raise AttributeError(
                f"actor {self._record.name!r} ({self._record.cls.__qualname__}) has no endpoint "
                f"{attr!r}; endpoints: {known}"
            )
        return RemoteMethod(self._record, spec, self._timeout_s, self._incarnation)

    def __repr__(self) -> str:
        return f"<ActorHandle {self._record.name} {self._record.state.value}>"
