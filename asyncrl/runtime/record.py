"""What the supervisor knows of one actor: ``ActorRecord`` (mutable, internal) and the
``ActorStatus`` snapshot it hands out. A record's state moves
``STARTING -> RUNNING -> (RESTARTING -> RUNNING)* -> DEAD | STOPPED``; ``set_state`` wakes every
call waiting through a start or restart."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from asyncrl.errors import ActorDiedError, CallTimeoutError
from asyncrl.runtime.state import ActorState
from asyncrl.runtime.timeouts import timeout

if TYPE_CHECKING:
    from asyncrl.runtime.client import ActorClient
    from asyncrl.runtime.process import ActorProcess
    from asyncrl.runtime.start_watch import StartWatch
    from asyncrl.runtime.transport import LoopSocket


class ActorStatus(msgspec.Struct, frozen=True):
    name: str
    state: ActorState
    """A string enum: encodes as, prints as and compares equal to its value (``"running"``)."""
    pid: int | None
    incarnation: int
    restarts: int
    max_restarts: int
    devices: list[str]
    last_heartbeat_age_s: float | None
    error: str | None = None
    node: int = 0


@dataclasses.dataclass(eq=False)
class ActorRecord:
    name: str
    index: int
    cls: type
    class_ref: tuple[str, str, str]
    init_payload: tuple[msgspec.Raw, list]
    devices: list[str]
    env: dict[str, str]
    max_restarts: int
    call_timeout_s: float
    node: int = 0
    state: ActorState = ActorState.STARTING
    incarnation: int = 0
    restarts: int = 0
    proc: ActorProcess | None = None
    client: ActorClient | None = None
    routing_id: bytes | None = None
    channel: LoopSocket | None = None
    ready: asyncio.Future | None = None
    starting: StartWatch | None = None
    """While an incarnation starts: its phases, deadline and heartbeats (`Incarnations.start`)."""
    last_heartbeat: float = 0.0
    last_words: str = ""
    last_death: tuple[int, str] = (0, "")
    """The incarnation that ended last, and how (`Incarnations._watch`)."""
    kill_reason: str = ""
    error: BaseException | None = None
    stopping: bool = False
    devices_released: bool = False
    _changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def set_state(self, state: ActorState) -> None:
        self.state = state
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def status(self) -> ActorStatus:
        running = self.state is ActorState.RUNNING
        return ActorStatus(
            name=self.name,
            state=self.state,
            pid=self.proc.pid if self.proc is not None and self.proc.alive else None,
            incarnation=self.incarnation,
            restarts=self.restarts,
            max_restarts=self.max_restarts,
            devices=list(self.devices),
            last_heartbeat_age_s=round(time.monotonic() - self.last_heartbeat, 3) if running else None,
            error=str(self.error) if self.error is not None else None,
            node=self.node,
        )

    def kill(self, cause: str, incarnation: int | None = None) -> bool:
        """SIGKILL the running incarnation's process group (for an actor on another node, its
        agent does) with ``cause`` recorded as why it died; its exit is then handled as any crash
        is (pending calls fail with ``ActorDiedError`` naming ``cause``; a restart within
        ``max_restarts``, else DEAD). ``incarnation``: kill only that one.

        Returns False and does nothing unless the actor is RUNNING that incarnation, its process
        is alive, and no kill of it is already under way (which keeps its own cause)."""
        proc = self.proc
        if (
            self.state is not ActorState.RUNNING
            or self.stopping
            or proc is None
            or not proc.alive
            or self.kill_reason
            or (incarnation is not None and incarnation != self.incarnation)
        ):
            return False
        self.kill_reason = cause
        proc.kill_now()
        return True

    async def wait_until(self, done: Callable[[ActorRecord], bool], timeout_s: float) -> ActorStatus:
        """The status once ``done(self)`` holds, the actor is in a final state (DEAD, STOPPED), or
        ``timeout_s`` has passed, whichever comes first. Woken by each change of state, never by
        polling; sends nothing to the actor."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            changed = self._changed  # replaced at every change of state: taken before looking
            if done(self) or self.state.final:
                return self.status()
            left = deadline - loop.time()
            if left <= 0:
                return self.status()
            with contextlib.suppress(TimeoutError):
                async with timeout(left):  # unlike wait_for on 3.11, never swallows a cancel
                    await changed.wait()

    def client_of(self, incarnation: int) -> ActorClient:
        """The client of ``incarnation`` while it runs; else `ActorDiedError` naming how it ended."""
        if self.incarnation == incarnation and self.state is ActorState.RUNNING and self.client is not None:
            return self.client
        ended, how = self.last_death
        if ended == incarnation:
            reason = how
        elif self.incarnation == incarnation:  # it never ran, or it is stopping
            reason = f"incarnation {incarnation} is {self.state.value}"
        else:
            reason = f"incarnation {incarnation} is not the one running (incarnation {self.incarnation} is)"
        raise ActorDiedError(self.name, reason)

    async def client_within(self, timeout_s: float, method: str) -> ActorClient:
        """The client of the running incarnation, waiting (bounded) through a start or restart."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.state is ActorState.RUNNING and self.client is not None:  # a running one has its client
                return self.client
            if self.state.final:
                raise self.error or ActorDiedError(self.name, self.state.value)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CallTimeoutError(self.name, f"{method}() (the actor is still {self.state.value})", timeout_s)
            with contextlib.suppress(TimeoutError):
                async with timeout(left):  # wait_for on 3.11 can swallow a cancel, and this loops
                    await self._changed.wait()
