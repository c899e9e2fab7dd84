"""Sampler loss and return: the driver's weight-sync group, kept whole while samplers come and go.

`SamplerPool` is the GRPO driver's view of its samplers. It owns which samplers are in the
current weight-sync group (with the trainer as rank 0), the tasks that stream their rollouts into
the `RolloutQueue`, and recovery. A sampler is *lost* when its process dies, when it stops
answering (no group within ``generate_timeout_s``, no answer to a sync), or when it fails a call
in a way that leaves its state unknown; a lost sampler that is still alive is SIGKILLed, so it
never comes back half-alive, and the supervisor restarts it within its ``max_restarts``.

Recovery, at the next point where the driver waits (for a batch, or before a sync): the group is
formed again at the next rendezvous generation from the trainer, the members still up, and the
replacements that are up. `SyncMember.sync_join` closes each survivor's old (perhaps aborted)
communicator and creates one for the new membership; nothing else about them is touched, and
their rollouts keep flowing. The current weights are then sent to every member of the new group.

Invariants:

* A sampler's rollouts are pumped only while it is in the group, and only after it took part in
  a successful sync of that group: a replacement (a fresh process whose own weights are the
  initial ones) never delivers a group generated before it holds the run's current weights. Its
  groups are checked to come from the incarnation that joined, no older than the version it took.
* Every delivered group gets ``uid = sampler/incarnation/sequence``, unique in the run: a stream
  never repeats an item, a lost sampler's stream is never read again, and each incarnation
  numbers afresh. Groups arrive whole (one message per group), so a group in the queue is never
  half from a lost sampler; the ones it delivered before it was lost stay (tagged, valid).
* A sync completes on every member or fails on every member (the vote in `comm/weights.py`), so
  when `sync` returns, every sampler in the group holds the same version as the trainer.
* Every wait is bounded by one of the run's phase deadlines; a trainer that dies or overruns
  stops the run with a `RunStoppedError` naming the phase, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from asyncrl.errors import ActorDiedError, AsyncrlError, CallTimeoutError, RemoteError
from asyncrl.rl.checkpoint import SamplerDataState
from asyncrl.rl.rollout import QueueClosedError, QueueTimeoutError, RolloutGroup, RolloutQueue
from asyncrl.runtime.timeouts import timeout

T = TypeVar("T")

_COMM_ERRORS = {"CollectiveError", "CollectiveTimeoutError", "CommunicatorClosedError", "WeightSyncError",
                "LayoutMismatchError", "RendezvousError", "RendezvousTimeoutError"}
"""Remote errors that a member suffers from a peer's failure: it is a victim, not the cause."""
SYNC_GRACE_S = 5.0
"""How long past its own deadline a member's answer to a group-wide call may come (a loaded
machine delays a reply by seconds). Each member bounds its side of a sync by ``sync_timeout_s``,
the wait for a pause included, and fails it with a typed error, a peer's failure included; only a
member that has not answered this much later is judged frozen."""
CLOSE_S = 10.0
"""How long `SamplerPool.close` waits for its cancelled tasks to end (they end at once)."""
PUMP_RETRIES = 3
"""Consecutive stream failures of a live sampler (waiting for weights) before it counts as lost."""
PROBE_S = 5.0
"""Before a rebuild, how long a member may take to answer a trivial call (a live actor answers
in milliseconds: its event loop is free while it generates on a worker thread)."""


class RunStoppedError(AsyncrlError):
    """The run cannot go on; the message names the cause (and the checkpoint to resume from)."""


class TrainerLostError(RunStoppedError):
    """The trainer died or stopped answering; the run stops (resume it from a checkpoint)."""


class PhaseTimeoutError(RunStoppedError, TimeoutError):
    """A phase on the trainer's side, or the wait for a batch, overran its deadline."""


class NoSamplersError(RunStoppedError):
    """Every sampler is lost for good (its restarts used up)."""


class WeightsDivergedError(RunStoppedError):
    """``--run.check_weights``: a member's weights differ from the trainer's after a sync."""


async def trainer_phase(phase: str, knob: str, timeout_s: float, call: Awaitable[T]) -> T:
    """Await a trainer call, turning its death or its silence into a `RunStoppedError`."""
    try:
        return await call
    except ActorDiedError as exc:
        raise TrainerLostError(f"the trainer died during {phase} ({exc.reason})") from exc
    except CallTimeoutError as exc:
        raise PhaseTimeoutError(f"{phase}: the trainer did not answer within --run.{knob} {timeout_s:g} s") from exc


@dataclass
class Fault:
    """One sampler loss: when it was detected, and how long until the run was whole again."""

    sampler: str
    incarnation: int
    cause: str
    step: int
    detected_at: float  # time.time()
    detected_mono: float = field(default=0.0, repr=False)
    recovered_s: float | None = None
    """Detection -> the survivors in a rebuilt group with the current weights."""
    rejoined_s: float | None = None
    """Detection -> its replacement in the group with the current weights (None: never came back)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "detected_mono"}


@dataclass(eq=False)
class _Member:
    handle: Any
    index: int
    seed: int
    joined: bool = False
    candidate: bool = True  # up and not in the group: joins at the next rebuild
    incarnation: int = 0  # of the process that is (or was last) in the group
    min_version: int = 0  # the version that incarnation took when it joined
    pump: asyncio.Task | None = None
    pump_failures: int = 0
    seq: int = 0  # groups delivered by this incarnation
    delivered: int = 0  # over every incarnation
    walk_base: int = 0  # prompts drawn from its walk before this run segment began
    fault: Fault | None = None  # open until a replacement rejoins
    waiter: asyncio.Task | None = None
    gone: bool = False  # lost for good

    @property
    def name(self) -> str:
        return self.handle.name


class SamplerPool:
    """The samplers of a run: membership, pumps and recovery (see the module docstring)."""

    uid_prefix = ""
    """Put before every group id; the driver sets it to the run segment ("resume1/", ...), since
    a resumed run's samplers number their groups from incarnation 1, sequence 1 again."""

    def __init__(self, trainer: Any, samplers: list[Any], queue: RolloutQueue, *, run: Any, seeds: list[int],
                 host: str, backend: str, log=print, events_path: str = ""):
        self.trainer, self.queue, self.run, self.host, self.backend, self.log = trainer, queue, run, host, backend, log
        self.events_path = events_path  # faults.jsonl: append-only, kept whole across resumes
        self.members = [_Member(h, i, seed) for i, (h, seed) in enumerate(zip(samplers, seeds))]
        self.async_mode = run.mode == "async"
        self.generation = -1
        self.changed = asyncio.Event()
        self.faults: list[Fault] = []
        self.step = 0
        self.counters = {"sampler_losses": 0, "sampler_rejoins": 0, "rebuilds": 0}
        self._dirty = True
        self._tasks: set[asyncio.Task] = set()  # every task the pool started and that has not ended
        self._events: list[dict[str, Any]] = []
        self._recover_s = 0.0  # time in rebuilds since the last take_events()

    # --- the driver's calls ---------------------------------------------------------------------

    async def start(self, version: int, data: list[SamplerDataState | None]) -> None:
        """Set each sampler's data walk, form the group and send ``version``; start the pumps."""
        for m in self.members:
            state = data[m.index] if m.index < len(data) and data[m.index] is not None else SamplerDataState(m.seed, 0)
            m.walk_base, m.incarnation = state.drawn, m.handle.info().incarnation
            await m.handle.with_timeout(self.run.rendezvous_timeout_s).restore_data_state(state)
        await self._rebuild(version)
        if not any(m.joined for m in self.members):
            raise NoSamplersError("no sampler could join the weight-sync group at the start")

    async def next_batch(self, n: int, version: int) -> list[RolloutGroup]:
        """The step's batch from the queue; recovers from sampler losses while it waits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.run.queue_timeout_s
        while True:
            await self._reconcile(version)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._stalled(n, version)
            get = asyncio.ensure_future(self.queue.get_batch(n, current_version=version, timeout_s=remaining))
            wake = asyncio.ensure_future(self.changed.wait())
            try:
                await asyncio.wait({get, wake}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
                if not get.done():
                    get.cancel()  # takes nothing from the queue (RolloutQueue's invariant)
                await asyncio.wait({get})
            if not get.cancelled():
                try:
                    return get.result()
                except QueueTimeoutError:
                    raise self._stalled(n, version) from None

    async def generate(self, n: int, version: int) -> None:
        """Sync mode: have the samplers in the group generate ``n`` fresh groups with the current
        weights (a sampler lost half-way is made up for by the others or its replacement)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.run.queue_timeout_s
        fresh = [0]
        while fresh[0] < n:
            await self._reconcile(version)
            live = [m for m in self.members if m.joined]
            if not live:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise self._stalled(n, version)
                await _wait_event(self.changed, remaining)
                continue
            per = math.ceil((n - fresh[0]) / len(live))
            pumps = {m: self._spawn(self._pump(m, per, fresh)) for m in live}
            await asyncio.wait(pumps.values())
            for m, task in pumps.items():
                if task.exception() is not None:
                    self._pump_failed(m, task.exception())

    async def sync(self, version: int) -> float:
        """Send ``version`` to every sampler in the group, rebuilding it first or after a
        failure as needed; returns the seconds it took."""
        start = time.monotonic()
        self._reap_pumps()
        joined = [m for m in self.members if m.joined]
        if not joined and not any(m.candidate for m in self.members):
            return 0.0  # the trainer alone: a replacement takes the current weights when it joins
        if self._dirty or any(m.candidate for m in self.members) or not await self._send(version, joined):
            await self._rebuild(version)
        return time.monotonic() - start

    async def verify_weights(self) -> dict[str, str]:
        """Digest of the weights on the trainer and on every sampler in the group; raises
        `WeightsDivergedError` unless they are all the same."""
        t = self.run.sync_timeout_s
        trainer = await trainer_phase("the weight check", "sync_timeout_s", t,
                                      self.trainer.with_timeout(t).weights_digest())
        self._pinned([m for m in self.members if m.joined])
        joined = [m for m in self.members if m.joined]
        pinned = [m.incarnation for m in joined]
        results = await asyncio.gather(*(m.handle.with_timeout(t).weights_digest() for m in joined),
                                       return_exceptions=True)
        digests = {"trainer": trainer}
        for m, incarnation, result in zip(joined, pinned, results):
            if isinstance(result, BaseException):
                self._lose(m, f"weight check failed: {_first_line(result)}",
                           kill=not isinstance(result, ActorDiedError), incarnation=incarnation)
            elif result != trainer:
                raise WeightsDivergedError(f"sampler {m.name} holds weights {result[:12]} after the sync of "
                                           f"generation {self.generation}; the trainer holds {trainer[:12]}")
            else:
                digests[m.name] = result
        return digests

    async def data_states(self) -> list[SamplerDataState]:
        """Each sampler's data position for a checkpoint (computed for one that is not up)."""
        states = []
        for m in self.members:
            state = None
            if m.joined and self._pinned([m]):
                incarnation = m.incarnation
                try:
                    state = await m.handle.with_timeout(self.run.rendezvous_timeout_s).data_state()
                except (ActorDiedError, CallTimeoutError, RemoteError) as exc:
                    self._lose(m, f"data_state failed: {_first_line(exc)}", kill=not isinstance(exc, ActorDiedError),
                               incarnation=incarnation)
            if state is None or state.drawn < 0:  # not up: after the prompts it delivered
                state = SamplerDataState(m.seed, m.walk_base + m.delivered)
            states.append(state)
        return states

    def take_events(self) -> dict[str, Any]:
        """What happened to the samplers since the last call, for the step's metrics record."""
        events, self._events = self._events, []
        recover, self._recover_s = self._recover_s, 0.0
        return {"generation": self.generation, "samplers_in_group": sum(m.joined for m in self.members),
                "sampler_losses": sum(e["event"] == "lost" for e in events),
                "sampler_rejoins": sum(e["event"] == "rejoined" for e in events),
                "recover_s": recover, **({"events": events} if events else {})}

    def progress(self) -> dict[str, Any]:
        return {"generation": self.generation, **self.counters,
                "samplers": {m.name: ("in group" if m.joined else "gone" if m.gone else "lost")
                             for m in self.members}}

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
                self.log(f"sampler pool: {len(pending)} task(s) still running {CLOSE_S:g} s after being cancelled: "
                         + ", ".join(t.get_name() for t in pending))

    def _spawn(self, coro: Awaitable[Any], name: str = "") -> asyncio.Task:
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

    # --- pumps ----------------------------------------------------------------------------------

    async def _pump(self, m: _Member, max_groups: int, accepted: list[int] | None = None) -> None:
        """Stream one sampler's groups into the queue (a put waits while the queue is full)."""
        run = self.run
        # The longest a live driver leaves the queue full: a train step, a sync, a checkpoint, an eval.
        put_s = (run.queue_timeout_s + run.train_timeout_s + run.sync_timeout_s + run.checkpoint_timeout_s
                 + run.eval_timeout_s)
        if not self._pinned([m]):
            return
        async for group in m.handle.with_timeout(run.generate_timeout_s).rollouts(max_groups):
            incarnation = m.handle.info().incarnation
            if incarnation != m.incarnation or group.version < m.min_version:
                raise ActorDiedError(m.name, f"incarnation {m.incarnation} was replaced by {incarnation} "
                                     "outside the group")  # its groups were never synced: drop them
            m.seq += 1
            m.delivered += 1
            m.pump_failures = 0
            group = msgspec.structs.replace(group, uid=f"{self.uid_prefix}{m.name}/{m.incarnation}/{m.seq}")
            if await self.queue.put(group, timeout_s=put_s) and accepted is not None:
                accepted[0] += 1

    def _start_pump(self, m: _Member) -> None:
        m.pump = self._spawn(self._pump(m, 0), f"pump of {m.name}")
        m.pump.add_done_callback(lambda _: self.changed.set())

    def _reap_pumps(self) -> None:
        for m in self.members:
            if m.joined and m.pump is not None and m.pump.done():
                task, m.pump = m.pump, None
                if not task.cancelled() and task.exception() is not None:
                    self._pump_failed(m, task.exception())

    def _pump_failed(self, m: _Member, exc: BaseException) -> None:
        if isinstance(exc, (QueueTimeoutError, QueueClosedError)):
            raise RunStoppedError(f"the driver stopped taking rollouts from {m.name}: {exc}") from exc
        if isinstance(exc, ActorDiedError):
            self._lose(m, f"died ({exc.reason})", kill=False)
        elif isinstance(exc, CallTimeoutError):
            self._lose(m, f"no rollout group within --run.generate_timeout_s {self.run.generate_timeout_s:g} s",
                       kill=True)
        elif (isinstance(exc, RemoteError) and exc.remote_type == "SamplerTimeoutError"
              and m.pump_failures < PUMP_RETRIES):
            m.pump_failures += 1  # it waited too long for good weights: pumped again after the next sync
            self._dirty = True
        else:
            self._lose(m, f"its rollout stream failed: {_first_line(exc)}", kill=True)

    # --- membership -----------------------------------------------------------------------------

    def _pinned(self, group: list[_Member]) -> bool:
        """True if every member still runs the incarnation we know. Checked right before a call
        is sent, with no await in between: a handle sends a call to whatever incarnation runs, and
        one made during a restart waits for the next, which never joined this group."""
        ok = True
        for m in group:
            info = m.handle.info()
            if info.state != "running" or info.incarnation != m.incarnation:
                self._lose(m, f"died (incarnation {m.incarnation} is gone; the actor is {info.state})", kill=False)
                ok = False
        return ok

    async def _reconcile(self, version: int) -> None:
        """Bring the group up to date: reap failed pumps, rebuild if anyone left or came back,
        and pump every member that has no pump."""
        self.changed.clear()  # before looking: whatever happens from here on wakes the next wait
        self._reap_pumps()
        if all(m.gone for m in self.members):
            raise NoSamplersError("every sampler is lost and has used up its restarts (--run.sampler_max_restarts "
                                  f"{self.run.sampler_max_restarts}): " + "; ".join(f.cause for f in self.faults[-3:]))
        if self._dirty or any(m.candidate for m in self.members):
            await self._rebuild(version)
        if self.async_mode:
            for m in self.members:
                if m.joined and m.pump is None:
                    self._start_pump(m)

    async def _rebuild(self, version: int) -> None:
        """Form the next generation from the trainer, the members still in the group and the
        replacements that are up, and send them ``version``. Each failed attempt loses at least
        one sampler (or finds none to lose and tries once more), so this ends."""
        started = time.monotonic()
        for _ in range(2 * len(self.members) + 2):
            for m in self.members:
                if m.candidate and m.fault is not None:
                    await self._prepare_replacement(m)
            group = [m for m in self.members if m.joined or m.candidate]
            if not group:
                self._dirty = False
                return  # the trainer alone: nobody to sync until a replacement is up
            if not await self._probe(group):
                continue
            self.generation += 1
            if await self._form(group) and await self._setup(group) and await self._send(version, group):
                self._joined(group, version, time.monotonic() - started)
                return
        raise RunStoppedError(f"the weight-sync group could not be rebuilt in {2 * len(self.members) + 2} attempts "
                              f"(generation {self.generation})")

    async def _prepare_replacement(self, m: _Member) -> None:
        """A restarted sampler continues its predecessor's data walk, with a fresh sampling RNG."""
        if not self._pinned([m]):
            return
        state = SamplerDataState(m.seed, m.walk_base + m.delivered, generator_seed=(m.seed << 16) + m.incarnation)
        incarnation = m.incarnation
        try:
            await m.handle.with_timeout(self.run.rendezvous_timeout_s).restore_data_state(state)
        except (ActorDiedError, CallTimeoutError, RemoteError) as exc:
            self._lose(m, f"failed to prepare for rejoining: {_first_line(exc)}",
                       kill=not isinstance(exc, ActorDiedError), incarnation=incarnation)

    async def _probe(self, group: list[_Member]) -> bool:
        """A frozen member would hold every other one in the rendezvous until its deadline, so
        each must show a sign of life first; one that does not is lost (and killed)."""
        if not self._pinned(group):
            return False
        pinned = [m.incarnation for m in group]
        results = await asyncio.gather(*(m.handle.with_timeout(PROBE_S).stats() for m in group), return_exceptions=True)
        for m, incarnation, result in zip(group, pinned, results):
            if isinstance(result, BaseException):
                self._lose(m, f"no sign of life before the rebuild of the group: {_first_line(result)}",
                           kill=not isinstance(result, ActorDiedError), incarnation=incarnation)
        return not any(isinstance(r, BaseException) for r in results)

    async def _form(self, group: list[_Member]) -> bool:
        """Every join at once under one deadline (the rendezvous contract); True if all joined."""
        t = self.run.rendezvous_timeout_s
        port = await trainer_phase("the weight-sync rendezvous", "rendezvous_timeout_s", t,
                                   self.trainer.with_timeout(t).sync_listen(self.host))
        if not self._pinned(group):
            return False
        pinned = [m.incarnation for m in group]
        world = 1 + len(group)
        members = [self.trainer, *(m.handle for m in group)]
        joins = [asyncio.ensure_future(h.with_timeout(t + 10).sync_join(self.host, port, rank, world, self.generation,
                                                                        self.backend, t, "weights"))
                 for rank, h in enumerate(members)]
        self._notice_deaths(group, joins[1:], "joining the weight-sync group")
        results = await asyncio.gather(*joins, return_exceptions=True)
        return self._judge("joining the weight-sync group", "rendezvous_timeout_s", t, group, pinned, results)

    def _notice_deaths(self, group: list[_Member], calls: list[asyncio.Future], what: str) -> None:
        """Record a member's death the moment its call fails with it, not when the group-wide
        call ends: the others (the trainer) may wait out their deadline for the dead one first."""
        for m, call in zip(group, calls):
            def died(call: asyncio.Future, m: _Member = m, incarnation: int = m.incarnation) -> None:
                if not call.cancelled() and isinstance(call.exception(), ActorDiedError):
                    self._lose(m, f"died during {what} ({call.exception().reason})", kill=False,
                               incarnation=incarnation)
            call.add_done_callback(died)

    async def _setup(self, group: list[_Member]) -> bool:
        t = self.run.sync_timeout_s
        if not self._pinned(group):
            return False
        pinned = [m.incarnation for m in group]
        results = await asyncio.gather(self.trainer.with_timeout(t + 10).setup_sender(t),
                                       *(m.handle.with_timeout(t + 10).setup_receiver(t) for m in group),
                                       return_exceptions=True)
        return self._judge("agreeing on the weight layout", "sync_timeout_s", t, group, pinned, results)

    async def _send(self, version: int, group: list[_Member]) -> bool:
        """One sync. Every member ends its side within ``sync_timeout_s`` (a sampler's wait for a
        pause included), with success or a typed error, so each is waited for until then plus
        ``SYNC_GRACE_S``: one that has not answered by that time (frozen) is lost; one that answers
        late with a collective error, after a peer died (the trainer may have failed at once),
        is a survivor, not a suspect."""
        t = self.run.sync_timeout_s
        if not self._pinned(group):
            return False
        pinned = [m.incarnation for m in group]
        sender = asyncio.ensure_future(self.trainer.with_timeout(t + SYNC_GRACE_S).send_weights(version))
        receivers = [asyncio.ensure_future(m.handle.with_timeout(t + SYNC_GRACE_S).receive_weights(version))
                     for m in group]
        self._notice_deaths(group, receivers, f"the weight sync of v{version}")
        results = await asyncio.gather(sender, *receivers, return_exceptions=True)
        return self._judge(f"the weight sync of v{version}", "sync_timeout_s", t, group, pinned, results)

    def _judge(self, what: str, knob: str, timeout_s: float, group: list[_Member], pinned: list[int],
               results: list[Any]) -> bool:
        """Sort the members' outcomes of one group-wide call (made to the incarnations ``pinned``):
        the trainer's death or silence stops the run; a sampler's loses it; errors a member
        suffered from a peer only mean that the group must be rebuilt. True if every member
        succeeded."""
        trainer, samplers = results[0], results[1:]
        if isinstance(trainer, ActorDiedError):
            raise TrainerLostError(f"the trainer died during {what} ({trainer.reason})")
        if isinstance(trainer, CallTimeoutError):
            raise PhaseTimeoutError(f"{what}: the trainer did not answer within --run.{knob} {timeout_s:g} s")
        if isinstance(trainer, BaseException) and not _suffered(trainer):
            raise RunStoppedError(f"the trainer failed during {what}: {_first_line(trainer)}") from trainer
        ok = not isinstance(trainer, BaseException)
        for m, incarnation, result in zip(group, pinned, samplers):
            if not isinstance(result, BaseException):
                continue
            ok = False
            if isinstance(result, ActorDiedError):
                self._lose(m, f"died during {what} ({result.reason})", kill=False, incarnation=incarnation)
            elif isinstance(result, CallTimeoutError):
                self._lose(m, f"no answer during {what} within {result.timeout_s:g} s", kill=True,
                           incarnation=incarnation)
            elif not _suffered(result):
                self._lose(m, f"failed during {what}: {_first_line(result)}", kill=True, incarnation=incarnation)
        if not ok:
            self._dirty = True
            self.log(f"{what} failed (generation {self.generation}): " + "; ".join(
                f"{name}: {_first_line(r)}" for name, r in zip(["trainer", *(m.name for m in group)], results)
                if isinstance(r, BaseException)))
        return ok

    def _joined(self, group: list[_Member], version: int, seconds: float) -> None:
        self._dirty = False
        self.counters["rebuilds"] += 1
        self._recover_s += seconds
        now = time.monotonic()
        for m in group:
            m.joined = True
            if m.candidate:
                m.candidate = False
                m.min_version, m.seq = version, 0
                if m.fault is not None:
                    m.fault.rejoined_s = now - m.fault.detected_mono
                    self.counters["sampler_rejoins"] += 1
                    self._event("rejoined", m.name, f"incarnation {m.incarnation} took v{version}",
                                incarnation=m.incarnation, rejoined_s=m.fault.rejoined_s)
                    self.log(f"{m.name} is back (incarnation {m.incarnation}) with v{version}, "
                             f"{m.fault.rejoined_s:.1f} s after it was lost")
                    m.fault = None
        for fault in self.faults:
            if fault.recovered_s is None:
                fault.recovered_s = now - fault.detected_mono
                self._event("recovered", fault.sampler, f"group whole again at generation {self.generation}",
                            incarnation=fault.incarnation, recovered_s=fault.recovered_s)
        if self.generation > 0:
            self.log(f"weight-sync group generation {self.generation}: trainer + "
                     f"{', '.join(m.name for m in group)} with v{version} ({seconds:.1f} s)")

    def _lose(self, m: _Member, cause: str, *, kill: bool, incarnation: int | None = None) -> None:
        """Take ``m`` out of the group (its pump stops), SIGKILL it if it is still alive, and
        wait for the supervisor's replacement. ``incarnation``: the one the failed call went to
        (default: the one we know now)."""
        if incarnation is not None and incarnation != m.incarnation:
            # A verdict on an incarnation that is already replaced (its death was recorded when
            # it was seen; a long group-wide call can outlast the restart): the new one is not
            # judged by what the old one did.
            return
        info = m.handle.info()
        incarnation = m.incarnation
        already = m.fault is not None and m.fault.incarnation == incarnation
        m.joined = m.candidate = False
        self._dirty = True
        if m.pump is not None:
            m.pump.cancel()
            m.pump = None
        if kill and info.incarnation == incarnation and info.pid is not None:
            _kill(m.handle, info)
        if already:
            return
        fault = Fault(m.name, incarnation, cause, self.step, time.time(), time.monotonic())
        self.faults.append(fault)
        m.fault = fault
        self.counters["sampler_losses"] += 1
        self._event("lost", m.name, cause, incarnation=incarnation)
        self.log(f"{m.name} (incarnation {incarnation}) lost at step {self.step}: {cause}")
        if m.waiter is not None:
            m.waiter.cancel()
        m.waiter = self._spawn(self._await_return(m, incarnation), f"return of {m.name}")
        self.changed.set()

    async def _await_return(self, m: _Member, lost: int) -> None:
        """Wait (bounded by ``restart_timeout_s``) for the supervisor to run an incarnation of
        ``m`` newer than ``lost``. Judged by the actor's state alone, not by a call: a call can
        fail for reasons that say nothing of the restart (its deadline cut short on a loaded
        machine), which would declare gone a sampler that is back."""
        t = self.run.restart_timeout_s
        info = await m.handle.wait_for_incarnation(lost, t)
        if info.state == "running" and info.incarnation > lost:
            m.candidate, m.incarnation = True, info.incarnation
            self.changed.set()
            return
        m.gone = True
        why = {"dead": "its restarts are used up or its restart failed", "stopped": "it was stopped"}.get(
            info.state, f"no new incarnation was running within --run.restart_timeout_s {t:g} s")
        self.log(f"{m.name} will not come back: {why} ({info.state}, incarnation {info.incarnation}, "
                 f"restarts {info.restarts}/{info.max_restarts})")
        self.changed.set()

    def _event(self, kind: str, sampler: str, detail: str, **extra: Any) -> None:
        event = {"event": kind, "sampler": sampler, "step": self.step, "detail": detail, "at": time.time(), **extra}
        self._events.append(event)
        append_event(self.events_path, event)

    def _stalled(self, n: int, version: int) -> PhaseTimeoutError:
        states = ", ".join(f"{m.name}: {'in group' if m.joined else 'gone' if m.gone else 'lost'} "
                           f"({m.handle.info().state}, {m.delivered} groups delivered)" for m in self.members)
        return PhaseTimeoutError(f"waiting for a batch of {n} groups at v{version}: not there within "
                                 f"--run.queue_timeout_s {self.run.queue_timeout_s:g} s ({len(self.queue)} queued; "
                                 f"{states})")


def append_event(path: str, event: dict[str, Any]) -> None:
    """One line of faults.jsonl (unlike metrics.jsonl, never cut back on resume: it is the record
    of what went wrong, across every segment of a run)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def _suffered(exc: BaseException) -> bool:
    return isinstance(exc, RemoteError) and exc.remote_type in _COMM_ERRORS


def _kill(handle: Any, info: Any) -> None:
    """SIGKILL a lost actor's process so it cannot come back half-alive; the supervisor then
    restarts it (within its max_restarts). Only processes of this host can be signalled."""
    if info.node != 0:
        return  # the supervisor's heartbeat check kills a frozen remote actor; see docs/fault_tolerance.md
    try:
        os.kill(info.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    try:
        async with timeout(timeout_s):  # wait_for on 3.11 can swallow a cancel
            await event.wait()
    except TimeoutError:
        pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0][:300] if text else type(exc).__name__)
