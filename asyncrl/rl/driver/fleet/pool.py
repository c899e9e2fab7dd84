"""Sampler loss and return: the driver's weight-sync group, kept whole while samplers come and go.

`SamplerPool` is the GRPO driver's view of its samplers: the driver's calls (a batch, a sync, a
weight check, the data positions for a checkpoint) and the tasks that stream each member's
rollouts into the `RolloutQueue`. It is built of three parts: `Membership` (membership.py: the one
owner of each sampler's state, its losses and returns, the pool's tasks, and `call_all`, every
call to several samplers), `SyncGroup` (sync_group.py: the group-wide calls that form the
group and send it weights, and the verdicts on the trainer's part in them) and `Pumps`
(pumps.py: a member's rollout streams into the queue, paced or not); the pool starts a pump,
judges the one that failed, and recovers.

A sampler is *lost* when its process dies, when it stops answering (no group within
``generate_timeout_s``, no answer to a sync), or when it fails a call in a way that leaves its
state unknown; a lost sampler that is still alive is killed, so it never comes back half-alive,
and the supervisor restarts it within its ``max_restarts``. Recovery happens at the next point
where the driver waits (for a batch, or before a sync): the group is formed again at the next
rendezvous generation from the trainer, the members still up and the replacements that are up,
and the current weights are sent to every member of the new group.

Invariants:

* A sampler's rollouts are pumped only while it is in the group, and only after it took part in
  a successful sync of that group: a replacement (a fresh process whose own weights are the
  initial ones) never delivers a group generated before it holds the run's current weights. Its
  groups are checked to come from the incarnation that joined, no older than the version it took.
* Every delivered group gets ``uid = sampler/incarnation/sequence``, unique in the run: a stream
  never repeats an item, a lost sampler's stream is never read again, and each incarnation
  numbers afresh. Groups arrive whole (one message per group), so a group in the queue is never
  half from a lost sampler; the ones it delivered before it was lost stay (tagged, valid).
* A sync completes on every member or fails on every member (the votes of `comm/sync_vote.py`), so
  when `sync` returns, every sampler in the group holds the same version as the trainer.
* Every call to a sampler goes to the incarnation that joined (`Membership.call_all` calls
  through handles pinned to it: one that died meanwhile fails as that death, never reaching its
  replacement), and its verdict falls on that incarnation only.
* In async mode a sampler's pump runs ``--sampler.streams`` paced streams at once, and queues
  their groups in the order the pacer granted their credit (pumps.py): the pacer's
  promise that one sampler's groups all train in time holds for any number of streams.
* Every wait is bounded by one of the run's phase deadlines; a trainer that dies or overruns
  stops the run with a `RunStoppedError` naming the phase, never a hang.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import msgspec

from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, first_line
from asyncrl.rl.checkpoint import SamplerDataState
from asyncrl.rl.config.run import RunConfig
from asyncrl.rl.driver.faults import (
    Fault,
    NoSamplersError,
    PhaseTimeoutError,
    RunStoppedError,
    TaskFailedError,
    WeightsDivergedError,
    WeightsUncheckableError,
    trainer_phase,
)
from asyncrl.rl.driver.fleet.calls import call_all
from asyncrl.rl.driver.fleet.handles import Log
from asyncrl.rl.driver.fleet.membership import Member, Membership, MemberState
from asyncrl.rl.driver.fleet.pumps import Pumps, RolloutFlow
from asyncrl.rl.driver.fleet.sync_group import SyncGroup, SyncPlace
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks
from asyncrl.rl.driver.pacing import PacingTimeoutError
from asyncrl.rl.driver.queue import QueueClosedError, QueueTimeoutError
from asyncrl.rl.driver.uniform import UniformGroups
from asyncrl.rl.observe.sync_metrics import SyncPhases, sync_record
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.sampler.errors import SamplerTimeoutError, WeightsUnreadableError
from asyncrl.rl.tasks.scoring import TaskFailureError
from asyncrl.runtime.timeouts import timeout

PUMP_RETRIES = 3
"""Consecutive stream failures of a live sampler (waiting for weights) before it counts as lost."""


class PoolProgress(msgspec.Struct, kw_only=True, frozen=True):
    """The pool now (`SamplerPool.progress`), for progress.json and ``asyncrl status``."""

    generation: int
    """The weight-sync group's rendezvous generation (0 after the start; -1 before)."""
    faults: dict[str, int]
    """``sampler_losses``, ``sampler_rejoins`` and ``rebuilds``: the pool's of this run segment;
    the driver's progress puts the run's in their place (a resumed run's carried in)."""
    samplers: dict[str, str]
    """Each sampler's place: ``in group``, ``lost``, ``gone`` or ``drained``."""

    def to_dict(self) -> dict[str, Any]:
        """Flat, the fault counters between the generation and the samplers, as the keys always were."""
        return {"generation": self.generation, **self.faults, "samplers": dict(self.samplers)}


class SamplerPool:
    """The samplers of a run: membership, pumps and recovery (see the module docstring). Built
    from its parts: the trainer, the `Membership` of the samplers, where their groups go
    (``flow``) and where the weight-sync group meets (``place``)."""

    def __init__(
        self,
        trainer: TrainerRanks,
        membership: Membership,
        flow: RolloutFlow,
        *,
        run: RunConfig,
        place: SyncPlace,
        log: Log = print,
    ):
        self.trainer, self.queue, self.run, self.log = trainer, flow.queue, run, log
        self.pacer = flow.pacer
        self.membership = membership
        self.sync_group = SyncGroup(trainer, self.membership, run.deadlines, place, log=log, delta=run.sync_delta)
        self.async_mode = run.mode == "async"
        self.reward_model = flow.reward_model  # its counts go in the step's record (take_events)
        # A teacher scores every group before it is queued (driver/teacher.py); a group of equal
        # rewards still teaches then (the teacher's per-token term), so none is left out.
        self.uniform = UniformGroups(run.groups_per_step if run.skip_uniform_groups and flow.teacher is None else 0)
        self.pumps = Pumps(self.membership, flow, run.deadlines, self.uniform)

    @property
    def members(self) -> list[Member]:
        return self.membership.members

    @property
    def faults(self) -> list[Fault]:
        """Every sampler loss of this run segment, in order."""
        return self.membership.faults

    @property
    def counters(self) -> dict[str, int]:
        """``sampler_losses``, ``sampler_rejoins`` and ``rebuilds`` of this run segment."""
        return self.membership.counters

    @property
    def generation(self) -> int:
        """The weight-sync group's rendezvous generation (0 after the start)."""
        return self.sync_group.generation

    def begin_step(self, step: int) -> None:
        """What happens to the samplers from now on is recorded as happening at ``step``."""
        self.membership.step = step

    # --- the driver's calls ---------------------------------------------------------------------

    async def start(self, version: int, data: list[SamplerDataState | None]) -> None:
        """Set each sampler's data walk, form the group and send ``version``. A sampler lost
        before it joined (it died since its start, it failed to take its data position) is lost as
        any other: the run goes on without it while it restarts (`next_batch` takes it back).
        Raises `NoSamplersError` only when every sampler is gone for good."""
        positions = dict(self.membership.begin(data))
        await self.membership.call_all(
            list(positions),
            lambda h, m: h.restore_data_state(positions[m]),
            timeout_s=self.run.deadlines.rendezvous_timeout_s,
            what="taking its data position",
        )
        await self.sync_group.rebuild(version)
        if self.membership.none_left():
            causes = "; ".join(f"{f.sampler}: {f.cause}" for f in self.faults[-3:])
            raise NoSamplersError(
                "no sampler could join the weight-sync group at the start" + (f" ({causes})" if causes else "")
            )

    async def next_batch(self, n: int, version: int) -> list[RolloutGroup]:
        """The step's batch from the queue; recovers from sampler losses while it waits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.run.deadlines.queue_timeout_s
        while True:
            await self._reconcile(version)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._stalled(n, version)
            get = asyncio.ensure_future(self._take_batch(n, version, remaining))
            wake = asyncio.ensure_future(self.membership.changed.wait())
            try:
                await asyncio.wait({get, wake}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                wake.cancel()
                if not get.done():
                    get.cancel()  # takes nothing from the queue (RolloutQueue's invariant)
                await asyncio.wait({get})
            if not get.cancelled():
                try:
                    batch = get.result()
                except QueueTimeoutError:
                    raise self._stalled(n, version) from None
                return batch

    async def _take_batch(self, n: int, version: int, timeout_s: float) -> list[RolloutGroup]:
        """The batch, and the pacer told in the same step of the loop: told only when `next_batch`
        resumed, a pump waking on the emptied queue in between counted the room with the step
        before and was granted groups no step could train (4 of 16 expired, tests/test_recovery_pool.py)."""
        batch = await self.queue.get_batch(n, current_version=version, timeout_s=timeout_s)
        if self.pacer is not None:
            self.pacer.batch_taken(version)
        self.uniform.batch_taken()
        return batch

    async def generate(self, n: int, version: int) -> None:
        """Sync mode: have the samplers in the group generate ``n`` fresh groups with the current
        weights (a sampler lost half-way is made up for by the others or its replacement)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.run.deadlines.queue_timeout_s
        fresh = [0]
        while fresh[0] < n:
            await self._reconcile(version)
            live = self.membership.with_state(MemberState.JOINED)
            if not live:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise self._stalled(n, version)
                await _wait_event(self.membership.changed, remaining)
                continue
            per = math.ceil((n - fresh[0]) / len(live))
            pumps = {m: self.membership.spawn(self.pumps.run(m, per, fresh)) for m in live}
            await asyncio.wait(pumps.values())
            for m, task in pumps.items():
                error = task.exception()
                if error is not None:
                    self._pump_failed(m, error)

    async def sync(self, version: int) -> SyncPhases:
        """Send ``version`` to every sampler in the group, rebuilding it first or after a
        failure as needed; returns the step's ``sync_*`` metrics (``sync_s``: the seconds it
        took here; the phases of the sync that succeeded: `sync_record`)."""
        start = time.monotonic()
        self._reap_pumps()
        self.sync_group.last = None
        joined = self.membership.with_state(MemberState.JOINED)
        candidates = self.membership.with_state(MemberState.CANDIDATE)
        if not joined and not candidates:
            # The trainer alone: a replacement takes the weights when it joins. The pacer is told
            # all the same: left at the older version, it would hold back every group the
            # rejoined sampler could make for the next step (the 12-minute stall of issue 30).
            self._synced(version)
            return sync_record(0.0, None, [])
        if self.membership.dirty or candidates or not await self.sync_group.send(version, joined):
            await self.sync_group.rebuild(version)
        self._synced(version)
        last: tuple[Any, list[Any]] = self.sync_group.last or (None, [])
        trainer, samplers = last
        return sync_record(time.monotonic() - start, trainer, samplers)

    async def verify_weights(self) -> dict[str, str]:
        """Digest of the weights on the trainer and on every sampler in the group; raises
        `WeightsDivergedError` unless they are all the same."""
        t = self.run.deadlines.sync_timeout_s
        trainer = await trainer_phase(
            "the weight check", "sync_timeout_s", t, self.trainer.with_timeout(t).weights_digest()
        )
        answers = await self.membership.call_all(
            self.membership.with_state(MemberState.JOINED),
            lambda h, _: h.weights_digest(),
            timeout_s=t,
            what="the weight check",
            spare=lambda exc: isinstance(exc, WeightsUnreadableError),  # no fault of the sampler's
        )
        digests = {"trainer": trainer}
        for m, result in answers.of_members():
            if isinstance(result, WeightsUnreadableError):  # a restart would be refused the same way
                raise WeightsUncheckableError(
                    f"--run.check_weights: {first_line(result)}; drop --run.check_weights (every sync's "
                    "own checks still run) or use --sampler.backend hf"
                )
            if isinstance(result, BaseException):
                continue  # lost: the next sync re-forms the group without it
            if result != trainer:
                raise WeightsDivergedError(
                    f"sampler {m.name} holds weights {result[:12]} after the sync of "
                    f"generation {self.generation}; the trainer holds {trainer[:12]}"
                )
            digests[m.name] = result
        return digests

    async def data_states(self) -> list[SamplerDataState]:
        """Each sampler's data position for a checkpoint (computed for one that is not up)."""
        answers = await self.membership.call_all(
            [m for m in self.members if m.in_group],
            lambda h, _: h.data_state(),
            timeout_s=self.run.deadlines.rendezvous_timeout_s,
            what="reading its data position",
        )
        got = {m: r for m, r in answers.of_members() if not isinstance(r, BaseException)}
        states = []
        for m in self.members:
            state = got.get(m)
            if state is None or state.drawn < 0:  # not up: after the prompts it delivered
                state = SamplerDataState(m.seed, m.walk_base + m.delivered)
            states.append(state)
        return states

    def take_events(self) -> dict[str, Any]:
        """What happened to the samplers since the last call, for the step's metrics record."""
        events, recover = self.membership.take_events()
        return {
            "generation": self.generation,
            "samplers_in_group": len(self.membership.with_state(MemberState.JOINED)),
            "sampler_losses": sum(e["event"] == "lost" for e in events),
            "sampler_rejoins": sum(e["event"] == "rejoined" for e in events),
            "recover_s": recover,
            **({"events": events} if events else {}),
            **(self.reward_model.take_counts() if self.reward_model is not None else {}),
        }

    def settled_at(self) -> float | None:
        """When (``time.monotonic``) the group last became settled: formed again, or a lost
        sampler declared gone; None while a lost sampler's restart is awaited."""
        return None if self.membership.with_state(MemberState.LOST) else self.membership.settled_at

    async def describe(self, timeout_s: float) -> str:
        """Each sampler's state in words, with what a sampler in the group is generating now
        (its own counters, each asked within ``timeout_s``): for the line of a stalled run."""
        joined = self.membership.with_state(MemberState.JOINED)
        stats = await call_all(
            [m.handle for m in joined], lambda h, _: h.stats(), timeout_s=timeout_s, what="a stall's description"
        )
        answers = dict(zip(joined, stats.results))
        parts = []
        for m in self.members:
            part = f"{m.name} {m.state.shown}"
            if m in answers:
                got = answers[m]
                part += (
                    f", generating {got.generating}"
                    if not isinstance(got, BaseException)
                    else f", no answer to stats within {timeout_s:g} s ({first_line(got)})"
                )
            parts.append(part)
        return "; ".join(parts)

    def progress(self) -> PoolProgress:
        return PoolProgress(
            generation=self.generation,
            faults=dict(self.counters),
            samplers={m.name: m.state.shown for m in self.members},
        )

    async def close(self) -> None:
        """Stop every task of the pool (pumps, waits for a restart) and wait for them to end."""
        await self.membership.close()

    # --- recovery ------------------------------------------------------------------------------

    def _start_pump(self, m: Member) -> None:
        self.membership.start_pump(m, self.pumps.run(m, 0))

    def _reap_pumps(self) -> None:
        for m in self.members:
            task = self.membership.take_ended_pump(m) if m.in_group else None
            error = task.exception() if task is not None and not task.cancelled() else None
            if error is not None:
                self._pump_failed(m, error)

    def _pump_failed(self, m: Member, exc: BaseException) -> None:
        if isinstance(exc, (QueueTimeoutError, QueueClosedError, PacingTimeoutError)):
            raise RunStoppedError(f"the driver stopped taking rollouts from {m.name}: {exc}") from exc
        if isinstance(exc, RunStoppedError):  # the scorer's (driver/teacher.py), not the sampler's
            raise exc
        if isinstance(exc, RemoteError) and isinstance(exc, TaskFailureError):
            # The task's own code fails (too many scores raise, say): a restarted sampler would
            # run the same code on the same data, so the run stops, naming the task's error.
            raise TaskFailedError(f"{m.name}: {exc.remote_message}") from exc
        lose = self.membership.lose
        if isinstance(exc, ActorDiedError):
            lose(m, f"died ({exc.reason})", kill=False)
        elif isinstance(exc, CallTimeoutError):
            lose(
                m,
                f"no rollout group and no token decoded within --run.generate_timeout_s "
                f"{self.run.deadlines.generate_timeout_s:g} s",
                kill=True,
            )
        elif (
            isinstance(exc, RemoteError)
            and isinstance(exc, SamplerTimeoutError)
            and self.membership.pump_waited(m, PUMP_RETRIES)
        ):
            pass  # it waited too long for good weights: pumped again after the next sync
        else:
            lose(m, f"its rollout stream failed: {first_line(exc)}", kill=True)

    async def _reconcile(self, version: int) -> None:
        """Bring the group up to date: reap failed pumps, rebuild if anyone left or came back,
        and pump every member that has no pump."""
        self.membership.changed.clear()  # before looking: whatever happens from here on wakes the next wait
        self._reap_pumps()
        if self.membership.none_left():
            raise NoSamplersError(
                "every sampler is lost and has used up its restarts (--run.sampler_max_restarts "
                f"{self.run.recovery.sampler_max_restarts}): " + "; ".join(f.cause for f in self.faults[-3:])
            )
        if self.membership.dirty or self.membership.with_state(MemberState.CANDIDATE):
            await self.sync_group.rebuild(version)
            self._synced(version)
        if self.async_mode:
            for m in self.members:
                if m.in_group and m.pump is None:
                    self._start_pump(m)

    def _synced(self, version: int) -> None:
        """Whoever is in the group now holds ``version`` (a rebuild sends it too), and whoever
        joins later takes the version current then: the pacer may count on it."""
        if self.pacer is not None:
            self.pacer.synced(version)

    def _stalled(self, n: int, version: int) -> PhaseTimeoutError:
        states = ", ".join(
            f"{m.name}: {m.state.shown} ({m.handle.info().state}, {m.delivered} groups delivered)" for m in self.members
        )
        return PhaseTimeoutError(
            f"waiting for a batch of {n} groups at v{version}: not there within "
            f"--run.queue_timeout_s {self.run.deadlines.queue_timeout_s:g} s "
            f"({len(self.queue)} queued; {states})"
        )


async def _wait_event(event: asyncio.Event, timeout_s: float) -> None:
    try:
        async with timeout(timeout_s):  # wait_for on 3.11 can swallow a cancel
            await event.wait()
    except TimeoutError:
        pass
