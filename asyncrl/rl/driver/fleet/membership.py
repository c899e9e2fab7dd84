"""Who is in the driver's weight-sync group, and what became of the samplers that left it.

`Membership` is the fleet's one owner of its members' state: each sampler's `MemberState`, its
incarnation, its data walk and deliveries, its rollout pump, its losses (`Fault`s, and the events
of metrics.jsonl and faults.jsonl), the kill of a lost sampler that is still alive, the wait for
its replacement, and every task the fleet started. Nothing else writes a `Member` or ``dirty``:
the pool (pool.py), the group-wide calls (sync_group.py) and the scaler (scaling.py) ask it
through its methods, and every call to several members is its `call_all` (the calls in calls.py,
the verdicts on them here).

A verdict concerns one incarnation: `lose` is given the incarnation the failed call went to, and
one that is already replaced is not judged by what its predecessor did. A lost sampler that is
still alive is killed (`ActorHandle.kill`, that incarnation only), so it never comes back
half-alive; the supervisor restarts it within its ``max_restarts``, and its return is judged by
the actor's state alone (`ActorHandle.wait_for_incarnation`), never by a call.

Samplers that share a vLLM engine (``--sampler.clients_per_engine``) stand and fall with its host,
whose process the engine is a child of: a lost host loses every client of it (each a loss of its
own), a host gone for good takes its clients along, and a client is formed into the group only
with its host (`formable`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, overload

from asyncrl.errors import ActorDiedError
from asyncrl.rl.checkpoint import SamplerDataState
from asyncrl.rl.config.run import RecoveryConfig
from asyncrl.rl.driver.faults import Fault, append_event
from asyncrl.rl.driver.fleet.calls import Answers, call_all, failure_cause
from asyncrl.rl.driver.fleet.handles import Log, SamplerHandle
from asyncrl.runtime.state import ActorState

T = TypeVar("T")
L = TypeVar("L")

CLOSE_S = 10.0
"""How long `Membership.close` waits for its cancelled tasks to end (they end at once)."""


class MemberState(enum.Enum):
    """Where a sampler stands. CANDIDATE -> JOINED at a successful rebuild; JOINED or CANDIDATE ->
    LOST (`Membership.lose`); LOST -> CANDIDATE when a newer incarnation runs, else -> GONE; any
    but GONE -> DRAINED when the run is scaled down (`Membership.drain`)."""

    CANDIDATE = "candidate"
    """Up and not in the group: joins at the next rebuild (every sampler before the start)."""
    JOINED = "in group"
    """In the group, holding its weights; in async mode its rollouts are pumped."""
    LOST = "lost"
    """Out of the group; the supervisor's restart of it is awaited."""
    GONE = "gone"
    """Lost for good: its restarts used up, stopped, or not back within restart_timeout_s; or it
    never came up (dead before the pool was built)."""
    DRAINED = "drained"
    """Left on request (``asyncrl scale``, scaling.py): out of the group, its process stopped;
    never comes back (a later scale-up starts a new sampler)."""

    @property
    def shown(self) -> str:
        """As progress.json and the driver's errors name it: a candidate is not in the group yet."""
        return MemberState.LOST.value if self is MemberState.CANDIDATE else self.value


@dataclass
class MemberAnswers(Answers[T]):
    """`Answers` of a call to members (`Membership.call_all`), with the members called, in order."""

    members: list[Member] = field(default_factory=list)

    def of_members(self) -> list[tuple[Member, T | BaseException]]:
        """Each member called, with its answer or error."""
        return list(zip(self.members, self.results))


class LeadCall(Generic[L]):
    """The trainer's part of a group-wide call (`Membership.call_all`, ``lead``): ``start`` makes
    it, with the members' calls; ``judge`` is given its answer (or error) before any member is
    judged, and raises to stop the run. Its ``answer`` is kept here for the caller."""

    def __init__(self, name: str, start: Callable[[], Awaitable[L]], judge: Callable[[L | BaseException], None]):
        self.name, self.start, self.judge = name, start, judge
        self.answer: L | BaseException | None = None

    def value(self) -> L:
        """The answer, once it came and was not an error (a `ValueError` otherwise)."""
        answer = self.answer
        if answer is None or isinstance(answer, BaseException):
            raise ValueError(f"{self.name} did not answer: {answer!r}")
        return answer

    @property
    def ok(self) -> bool:
        return self.answer is not None and not isinstance(self.answer, BaseException)


@dataclass(eq=False)
class Member:
    """One sampler of the pool, across its incarnations. Written by `Membership` alone."""

    handle: SamplerHandle
    index: int
    seed: int
    state: MemberState = MemberState.CANDIDATE
    incarnation: int = 0  # of the process that is (or was last) in the group
    min_version: int = 0  # the version that incarnation took when it joined
    pump: asyncio.Task | None = None
    pump_failures: int = 0
    seq: int = 0  # groups delivered by this incarnation
    delivered: int = 0  # over every incarnation
    walk_base: int = 0  # prompts drawn from its walk before this run segment began
    fault: Fault | None = None  # open until a replacement rejoins
    waiter: asyncio.Task | None = None  # the wait for its replacement
    host: Member | None = None  # the sampler whose vLLM engine this one is a client of; None: its own
    batches_requests: bool = False  # its engine batches concurrent calls (from its stats before it joins)

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def in_group(self) -> bool:
        return self.state is MemberState.JOINED


class Membership:
    """The samplers' states, losses and returns (see the module docstring)."""

    def __init__(
        self,
        samplers: list[SamplerHandle],
        seeds: list[int],
        *,
        recovery: RecoveryConfig,
        log: Log = print,
        events_path: str = "",
        hosts: list[int | None] | None = None,
    ):
        """``hosts``: per sampler, the index of the sampler whose vLLM engine it is a client of
        (None: an engine of its own; the default for all)."""
        # A sampler already dead or stopped never came up (its start was lost, its restarts with
        # it: sampler_start.py): GONE from the start, as if lost for good later. It keeps its
        # place (its index, its seed, its data position), which checkpoints and resumes rely on.
        self.members = [
            Member(h, i, seed, state=MemberState.GONE if h.info().state.final else MemberState.CANDIDATE)
            for i, (h, seed) in enumerate(zip(samplers, seeds))
        ]
        for m, host in zip(self.members, hosts or []):
            m.host = self.members[host] if host is not None else None
            if m.host is not None and m.host.state is MemberState.GONE:
                m.state = MemberState.GONE  # its engine never came up
        self.recovery, self.log = recovery, log
        self.events_path = events_path  # faults.jsonl: append-only, kept whole across resumes
        self.changed = asyncio.Event()  # set by every loss, return and ended pump: the driver's waits wake
        self.faults: list[Fault] = []
        self.counters = {"sampler_losses": 0, "sampler_rejoins": 0, "rebuilds": 0}
        self.step = 0  # the driver's step, for the records of a loss
        self.dirty = True  # the group must be formed again before the next sync
        self.recover_s = 0.0  # time in rebuilds since the last take_events()
        self.settled_at = 0.0  # monotonic time of the last rebuild, or of a loss judged for good
        self._tasks: set[asyncio.Task] = set()  # every task the pool started and that has not ended
        self._events: list[dict[str, Any]] = []

    def with_state(self, *states: MemberState) -> list[Member]:
        return [m for m in self.members if m.state in states]

    def formable(self) -> list[Member]:
        """The members a rebuild forms the group of: in it or up to join it, each client of a
        shared engine only with its host."""
        up = self.with_state(MemberState.JOINED, MemberState.CANDIDATE)
        return [m for m in up if m.host is None or m.host in up]

    def clients_of(self, host: Member) -> list[Member]:
        return [m for m in self.members if m.host is host]

    def none_left(self) -> bool:
        """No sampler is in the group or can come back to it."""
        return all(m.state in (MemberState.GONE, MemberState.DRAINED) for m in self.members)

    def add(self, handle: SamplerHandle, seed: int) -> Member:
        """A sampler started by a scale-up: a candidate, which joins at the next rebuild."""
        m = Member(handle, len(self.members), seed, incarnation=handle.info().incarnation)
        self.members.append(m)
        self.event(
            "added", m.name, "started by a scale-up; joins the group at the next sync", incarnation=m.incarnation
        )
        self.changed.set()
        return m

    def begin(self, data: list[SamplerDataState | None]) -> list[tuple[Member, SamplerDataState]]:
        """The run segment begins: each member's data walk continues from ``data`` (its place in
        the last checkpoint; a fresh walk where there is none), and the incarnation running now
        is the one that joins. Returns the positions the members that are up must take."""
        starts = []
        for m in self.members:
            saved = data[m.index] if m.index < len(data) else None
            state = saved if saved is not None else SamplerDataState(m.seed, 0)
            m.walk_base = state.drawn
            if m.state is not MemberState.GONE:  # one that never came up keeps the run's place
                m.incarnation = m.handle.info().incarnation
                starts.append((m, state))
        return starts

    def delivered(self, m: Member) -> int:
        """``m`` delivered one more group: its sequence number in this incarnation's stream."""
        m.seq += 1
        m.delivered += 1
        m.pump_failures = 0
        return m.seq

    def start_pump(self, m: Member, pump: Awaitable[None]) -> None:
        """Run ``pump``, ``m``'s rollout stream; its end wakes the driver's waits."""
        m.pump = self.spawn(pump, f"pump of {m.name}")
        m.pump.add_done_callback(lambda _: self.changed.set())

    def take_ended_pump(self, m: Member) -> asyncio.Task | None:
        """``m``'s pump if it ended (no longer ``m``'s then: the next reconcile starts another)."""
        if m.pump is None or not m.pump.done():
            return None
        task, m.pump = m.pump, None
        return task

    def pump_waited(self, m: Member, retries: int) -> bool:
        """``m``'s stream failed waiting for good weights: True if it is pumped again after the
        next sync (which re-forms the group), False once that happened ``retries`` times in a row."""
        if m.pump_failures >= retries:
            return False
        m.pump_failures += 1
        self.dirty = True
        return True

    def nobody_to_form(self) -> None:
        """No sampler can join the group: the trainer stays alone until a replacement is up."""
        self.dirty = False

    # Without ``whole`` the call is always made (answers, never None).
    @overload
    async def call_all(
        self,
        group: list[Member],
        call: Callable[[SamplerHandle, Member], Awaitable[T]],
        *,
        timeout_s: float,
        what: str,
        whole: Literal[False] = False,
        spare: Callable[[BaseException], bool] | None = None,
    ) -> MemberAnswers[T]: ...
    @overload
    async def call_all(
        self,
        group: list[Member],
        call: Callable[[SamplerHandle, Member], Awaitable[T]],
        *,
        timeout_s: float,
        what: str,
        whole: bool = False,
        lead: LeadCall[Any] | None = None,
        spare: Callable[[BaseException], bool] | None = None,
    ) -> MemberAnswers[T] | None: ...
    async def call_all(
        self,
        group: list[Member],
        call: Callable[[SamplerHandle, Member], Awaitable[T]],
        *,
        timeout_s: float,
        what: str,
        whole: bool = False,
        lead: LeadCall[Any] | None = None,
        spare: Callable[[BaseException], bool] | None = None,
    ) -> MemberAnswers[T] | None:
        """Make ``call(handle, member)`` to every member of ``group`` at once (`calls.call_all`:
        each within ``timeout_s``), to the incarnation that joined, and lose each that failed
        (killed unless it died; the cause names ``what``), except the ones ``spare`` says suffered
        a peer's failure. The members' answers are handed back (`MemberAnswers`).

        A member no longer running the incarnation that joined is lost first, and not called.
        ``whole``: the call is meant for the group as formed: with a member replaced it is not
        made at all (None), and any failure (the lead's too) means the group must be formed again.
        ``lead`` (the trainer's part) is started with the members' calls; its answer is judged
        (`LeadCall.judge`, which raises to stop the run) before any member's."""
        replaced = self.lose_replaced(group)
        if replaced and whole:
            return None
        group = [m for m in group if m not in replaced]
        pinned = [m.incarnation for m in group]

        def died(i: int, error: ActorDiedError) -> None:  # at once: the others may wait out their deadline for it
            self.lose(group[i], failure_cause(what, error), kill=False, incarnation=pinned[i])

        # Pinned: a call whose task starts after its incarnation died (a restart may already be
        # under way) fails as that death, never reaching the replacement, which did not join.
        handles = [m.handle.pinned(i) for m, i in zip(group, pinned)]
        started = asyncio.ensure_future(lead.start()) if lead is not None else None
        got = await call_all(handles, lambda h, i: call(h, group[i]), timeout_s=timeout_s, what=what, died=died)
        answers = MemberAnswers(got.what, got.names, got.results, members=group)
        if lead is not None and started is not None:
            (lead.answer,) = await asyncio.gather(started, return_exceptions=True)
            lead.judge(lead.answer)
        for i in answers.failed():
            error = answers.results[i]
            if spare is not None and isinstance(error, BaseException) and spare(error):
                continue
            self.lose(
                group[i],
                answers.cause(i),
                kill=not isinstance(error, ActorDiedError),
                incarnation=pinned[i],
            )
        if whole and not (answers.ok and (lead is None or lead.ok)):
            self.dirty = True
        return answers

    def drain(self, m: Member, why: str) -> None:
        """Take ``m`` out of the group for good, on request: its rollout stream is cut (the groups
        it was making are not accepted, and its pacing credit goes back to the others), a wait for
        its restart ends, and the next sync re-forms the group without it. Stopping its process is
        the caller's."""
        for task in (m.pump, m.waiter):
            if task is not None:
                task.cancel()
        m.pump = m.waiter = None
        m.fault = None  # a restart no longer awaited: its fault is closed at the next rebuild
        m.state = MemberState.DRAINED
        self.dirty = True
        self.event("drained", m.name, why, incarnation=m.incarnation)
        self.log(f"{m.name} drained at step {self.step}: {why}")
        self.changed.set()

    def lose_replaced(self, group: list[Member]) -> list[Member]:
        """Lose every member of ``group`` that no longer runs the incarnation we know, and return
        them: they are not called (the calls themselves are pinned to the incarnations that joined,
        so one that dies after this check fails as that death)."""
        replaced = []
        for m in group:
            info = m.handle.info()
            if info.state is not ActorState.RUNNING or info.incarnation != m.incarnation:
                self.lose(m, f"died (incarnation {m.incarnation} is gone; the actor is {info.state})", kill=False)
                replaced.append(m)
        return replaced

    def lose(self, m: Member, cause: str, *, kill: bool, incarnation: int | None = None) -> None:
        """Take ``m`` out of the group (its pump stops), kill it if ``kill`` and it still runs that
        incarnation, and wait for the supervisor's replacement. ``incarnation``: the one the failed
        call went to (default: the one we know now)."""
        if incarnation is not None and incarnation != m.incarnation:
            # A verdict on an incarnation that is already replaced (its death was recorded when
            # it was seen; a long group-wide call can outlast the restart): the new one is not
            # judged by what the old one did.
            return
        incarnation = m.incarnation
        if m.state is MemberState.DRAINED:
            return  # a late verdict on a sampler that already left on request
        already = m.fault is not None and m.fault.incarnation == incarnation
        if m.state is not MemberState.GONE:
            m.state = MemberState.LOST
        self.dirty = True
        if m.pump is not None:
            m.pump.cancel()
            m.pump = None
        if kill:
            m.handle.kill(cause, incarnation)  # a no-op if that incarnation is already gone
        if already:
            return
        fault = Fault(m.name, incarnation, cause, self.step, time.time(), time.monotonic())
        self.faults.append(fault)
        m.fault = fault
        self.counters["sampler_losses"] += 1
        self.event("lost", m.name, cause, incarnation=incarnation)
        self.log(f"{m.name} (incarnation {incarnation}) lost at step {self.step}: {cause}")
        if m.waiter is not None:
            m.waiter.cancel()
        m.waiter = self.spawn(self._await_return(m, incarnation), f"return of {m.name}")
        self.changed.set()
        for client in self.clients_of(m):
            if client.state in (MemberState.JOINED, MemberState.CANDIDATE):
                self.lose(client, f"its vLLM engine went with {m.name}, its host ({cause})", kill=True)

    async def _await_return(self, m: Member, lost: int) -> None:
        """Wait (bounded by ``restart_timeout_s``) for the supervisor to run an incarnation of
        ``m`` newer than ``lost``. Judged by the actor's state alone, not by a call: a call can
        fail for reasons that say nothing of the restart (its deadline cut short on a loaded
        machine), which would declare gone a sampler that is back."""
        t = self.recovery.restart_timeout_s
        info = await m.handle.wait_for_incarnation(lost, t)
        if m.state is MemberState.DRAINED:
            return
        if info.state is ActorState.RUNNING and info.incarnation > lost:
            m.state, m.incarnation = MemberState.CANDIDATE, info.incarnation
            self.changed.set()
            return
        self._gone(m)
        why = {
            ActorState.DEAD: "its restarts are used up or its restart failed",
            ActorState.STOPPED: "it was stopped",
        }.get(info.state, f"no new incarnation was running within --run.restart_timeout_s {t:g} s")
        self.log(
            f"{m.name} will not come back: {why} ({info.state}, incarnation {info.incarnation}, "
            f"restarts {info.restarts}/{info.max_restarts})"
        )
        for client in self.clients_of(m):
            if client.state not in (MemberState.GONE, MemberState.DRAINED):
                self._gone(client)
                self.log(f"{client.name} will not come back either: its vLLM engine was {m.name}'s")
        self.changed.set()

    def _gone(self, m: Member) -> None:
        """``m`` is lost for good: nothing of it is awaited any more."""
        for task in (m.pump, m.waiter):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        m.pump = m.waiter = None
        m.state = MemberState.GONE
        self.settled_at = time.monotonic()

    def engine_seen(self, m: Member, *, batches_requests: bool) -> None:
        """What ``m``'s stats said of its engine before it joined: whether it batches concurrent
        calls, which its pump's refills follow (fleet/pumps.py)."""
        m.batches_requests = batches_requests

    def joined(self, group: list[Member], version: int, seconds: float, generation: int) -> None:
        """``group`` formed ``generation`` and took ``version``: its candidates are members now,
        and every open fault is recovered (a replacement's, rejoined too)."""
        self.dirty = False
        self.counters["rebuilds"] += 1
        self.recover_s += seconds
        now = self.settled_at = time.monotonic()
        for m in group:
            if m.state is MemberState.CANDIDATE:
                m.min_version, m.seq = version, 0
                if m.fault is not None:
                    m.fault.rejoined_s = now - m.fault.detected_mono
                    self.counters["sampler_rejoins"] += 1
                    self.event(
                        "rejoined",
                        m.name,
                        f"incarnation {m.incarnation} took v{version}",
                        incarnation=m.incarnation,
                        rejoined_s=m.fault.rejoined_s,
                    )
                    self.log(
                        f"{m.name} is back (incarnation {m.incarnation}) with v{version}, "
                        f"{m.fault.rejoined_s:.1f} s after it was lost"
                    )
                    m.fault = None
            m.state = MemberState.JOINED
        for fault in self.faults:
            if fault.recovered_s is None:
                fault.recovered_s = now - fault.detected_mono
                self.event(
                    "recovered",
                    fault.sampler,
                    f"group whole again at generation {generation}",
                    incarnation=fault.incarnation,
                    recovered_s=fault.recovered_s,
                )
        if generation > 0:
            self.log(
                f"weight-sync group generation {generation}: trainer + "
                f"{', '.join(m.name for m in group)} with v{version} ({seconds:.1f} s)"
            )

    def event(self, kind: str, sampler: str, detail: str, **extra: Any) -> None:
        event = {"event": kind, "sampler": sampler, "step": self.step, "detail": detail, "at": time.time(), **extra}
        self._events.append(event)
        append_event(self.events_path, event)

    def take_events(self) -> tuple[list[dict[str, Any]], float]:
        """The events since the last call, and the seconds spent rebuilding the group since then."""
        events, self._events = self._events, []
        recover, self.recover_s = self.recover_s, 0.0
        return events, recover

    def spawn(self, coro: Awaitable[Any], name: str = "") -> asyncio.Task:
        """Start a task of the pool: `close` cancels it, and its exception is always retrieved,
        by whoever judges it or here, never reported by the loop as "never retrieved" (a pump
        that failed just before its sampler was lost is dropped unread, for one)."""
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()

    async def close(self) -> None:
        """Stop every task of the pool (pumps, waits for a restart), whatever the samplers are
        doing, and wait for them to end (bounded: a cancelled task ends at once)."""
        for m in self.members:
            m.pump = m.waiter = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=CLOSE_S)
            if pending:
                self.log(
                    f"sampler pool: {len(pending)} task(s) still running {CLOSE_S:g} s after being cancelled: "
                    + ", ".join(t.get_name() for t in pending)
                )
