"""The weight-sync group's group-wide calls, and the verdicts on their outcomes.

`SyncGroup` forms the group (the trainer as rank 0, the members still up, the replacements that
are up) at the next rendezvous generation and sends it weights. `SyncMember.sync_join` closes
each survivor's old (perhaps aborted) communicator and creates one for the new membership;
nothing else about the survivors is touched, and their rollouts keep flowing.

After a group-wide call each member's outcome is judged (`SyncGroup._judge`): the trainer's death
or silence stops the run; a sampler that died, fell silent, or failed by itself is lost; one that
failed with a data-plane error raised by a peer's failure (`PEER_FAILURE_ERRORS`) suffered it, and
stays. A member's answer is awaited until its own deadline plus a grace, never less, so a
survivor whose error comes late on a loaded machine is not taken for a frozen one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from asyncrl.comm.errors import PEER_FAILURE_ERRORS
from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, first_line
from asyncrl.rl.checkpoint import SamplerDataState
from asyncrl.rl.config.run import DeadlineConfig
from asyncrl.rl.driver.faults import PhaseTimeoutError, RunStoppedError, TrainerLostError, trainer_phase
from asyncrl.rl.driver.membership import Member, MemberState, Membership

SYNC_GRACE_S = 5.0
"""How long past its own deadline a member's answer to a group-wide call may come (a loaded
machine delays a reply by seconds). Each member bounds its side of a sync by ``sync_timeout_s``,
the wait for a pause included, and fails it with a typed error, a peer's failure included; only a
member that has not answered this much later is judged frozen."""
JOIN_GRACE_S = 10.0
"""The same for joining the group and agreeing on the layout (each bounded by its own deadline)."""
PROBE_S = 5.0
"""Before a rebuild, how long a member may take to answer a trivial call (a live actor answers
in milliseconds: its event loop is free while it generates on a worker thread)."""
WIRE_DTYPES = frozenset({"bfloat16", "float16", "float32"})
"""The dtypes a sync may be sent in, by name (a sampler reports its own)."""


def suffered_from_peer(exc: BaseException) -> bool:
    """True if ``exc`` is a remote data-plane error that a member raises when a peer fails: the
    member is a victim of the failure, not its cause."""
    return isinstance(exc, RemoteError) and isinstance(exc, PEER_FAILURE_ERRORS)


def wire_dtype(sampler_dtypes: list[str]) -> str:
    """The dtype a sync is sent in: the one every sampler holds its weights in (a bf16 vLLM engine
    takes an fp32 trainer's weights as bf16: half the bytes on the wire, cast while packing, the
    same values the engine's own cast would give), "" (the trainer's dtypes) when they differ or
    one cannot say."""
    kinds = set(sampler_dtypes)
    return kinds.pop() if len(kinds) == 1 and kinds <= WIRE_DTYPES else ""


class SyncGroup:
    """The group-wide calls of the weight-sync group (see the module docstring)."""

    def __init__(self, trainer: Any, membership: Membership, deadlines: DeadlineConfig, *, host: str, backend: str,
                 log=print):
        self.trainer, self.membership, self.deadlines = trainer, membership, deadlines
        self.host, self.backend, self.log = host, backend, log
        self.generation = -1
        self.wire_dtype = ""
        """What the trainer sends in: the samplers' weight dtype when they agree (`wire_dtype`)."""
        self.last: tuple[Any, list[Any]] | None = None
        """The last successful sync's answers: the trainer's `SyncStats` and each member's
        `SamplerSyncStats` (``rl/observe/sync_metrics.py`` puts them in the step's record)."""

    async def rebuild(self, version: int) -> None:
        """Form the next generation from the trainer, the members still in the group and the
        replacements that are up, and send them ``version``. Each failed attempt loses at least
        one sampler (or finds none to lose and tries once more), so this ends."""
        members = self.membership
        started = time.monotonic()
        attempts = 2 * len(members.members) + 2
        for _ in range(attempts):
            for m in members.members:  # each looked at when its turn comes: a state may change meanwhile
                if m.state is MemberState.CANDIDATE and m.fault is not None:
                    await self._prepare_replacement(m)
            group = members.with_state(MemberState.JOINED, MemberState.CANDIDATE)
            if not group:
                members.dirty = False
                return  # the trainer alone: nobody to sync until a replacement is up
            if not await self._probe(group):
                continue
            self.generation += 1
            if await self._form(group) and await self._setup(group) and await self.send(version, group):
                members.joined(group, version, time.monotonic() - started, self.generation)
                return
        raise RunStoppedError(f"the weight-sync group could not be rebuilt in {attempts} attempts "
                              f"(generation {self.generation})")

    async def send(self, version: int, group: list[Member]) -> bool:
        """One sync. Every member ends its side within ``sync_timeout_s`` (a sampler's wait for a
        pause included), with success or a typed error, so each is waited for until then plus
        ``SYNC_GRACE_S``: one that has not answered by that time (frozen) is lost; one that answers
        late with a collective error, after a peer died (the trainer may have failed at once),
        is a survivor, not a suspect."""
        t = self.deadlines.sync_timeout_s
        if self.membership.lose_replaced(group):
            return False
        pinned = [m.incarnation for m in group]
        sender = asyncio.ensure_future(self.trainer.with_timeout(t + SYNC_GRACE_S).send_weights(version))
        receivers = [asyncio.ensure_future(m.handle.with_timeout(t + SYNC_GRACE_S).receive_weights(version))
                     for m in group]
        self._notice_deaths(group, receivers, f"the weight sync of v{version}")
        results = await asyncio.gather(sender, *receivers, return_exceptions=True)
        ok = self._judge(f"the weight sync of v{version}", "sync_timeout_s", t, group, pinned, results)
        if ok:
            self.last = (results[0], list(results[1:]))
        return ok

    async def _prepare_replacement(self, m: Member) -> None:
        """A restarted sampler continues its predecessor's data walk, with a fresh sampling RNG."""
        if self.membership.lose_replaced([m]):
            return
        state = SamplerDataState(m.seed, m.walk_base + m.delivered, generator_seed=(m.seed << 16) + m.incarnation)
        incarnation = m.incarnation
        try:
            await m.handle.with_timeout(self.deadlines.rendezvous_timeout_s).restore_data_state(state)
        except (ActorDiedError, CallTimeoutError, RemoteError) as exc:
            self.membership.lose(m, f"failed to prepare for rejoining: {first_line(exc)}",
                                 kill=not isinstance(exc, ActorDiedError), incarnation=incarnation)

    async def _probe(self, group: list[Member]) -> bool:
        """A frozen member would hold every other one in the rendezvous until its deadline, so
        each must show a sign of life first; one that does not is lost (and killed)."""
        if self.membership.lose_replaced(group):
            return False
        pinned = [m.incarnation for m in group]
        results = await asyncio.gather(*(m.handle.with_timeout(PROBE_S).stats() for m in group), return_exceptions=True)
        for m, incarnation, result in zip(group, pinned, results):
            if isinstance(result, BaseException):
                self.membership.lose(m, f"no sign of life before the rebuild of the group: {first_line(result)}",
                                     kill=not isinstance(result, ActorDiedError), incarnation=incarnation)
        if any(isinstance(r, BaseException) for r in results):
            return False
        self.wire_dtype = wire_dtype([r.get("weight_dtype", "") if isinstance(r, dict) else "" for r in results])
        return True

    async def _form(self, group: list[Member]) -> bool:
        """Every join at once under one deadline (the rendezvous contract); True if all joined."""
        t = self.deadlines.rendezvous_timeout_s
        port = await trainer_phase("the weight-sync rendezvous", "rendezvous_timeout_s", t,
                                   self.trainer.with_timeout(t).sync_listen(self.host))
        if self.membership.lose_replaced(group):
            return False
        pinned = [m.incarnation for m in group]
        world = 1 + len(group)
        members = [self.trainer, *(m.handle for m in group)]
        joins = [asyncio.ensure_future(h.with_timeout(t + JOIN_GRACE_S).sync_join(
                     self.host, port, rank, world, self.generation, self.backend, t, "weights"))
                 for rank, h in enumerate(members)]
        self._notice_deaths(group, joins[1:], "joining the weight-sync group")
        results = await asyncio.gather(*joins, return_exceptions=True)
        return self._judge("joining the weight-sync group", "rendezvous_timeout_s", t, group, pinned, results)

    async def _setup(self, group: list[Member]) -> bool:
        """Agree on the weight layout (each side bounded by ``sync_timeout_s``); True if all did."""
        t = self.deadlines.sync_timeout_s
        if self.membership.lose_replaced(group):
            return False
        pinned = [m.incarnation for m in group]
        results = await asyncio.gather(self.trainer.with_timeout(t + JOIN_GRACE_S).setup_sender(
                                           t, wire_dtype=self.wire_dtype),
                                       *(m.handle.with_timeout(t + JOIN_GRACE_S).setup_receiver(t) for m in group),
                                       return_exceptions=True)
        return self._judge("agreeing on the weight layout", "sync_timeout_s", t, group, pinned, results)

    def _notice_deaths(self, group: list[Member], calls: list[asyncio.Future], what: str) -> None:
        """Record a member's death the moment its call fails with it, not when the group-wide
        call ends: the others (the trainer) may wait out their deadline for the dead one first."""
        for m, call in zip(group, calls):
            def died(call: asyncio.Future, m: Member = m, incarnation: int = m.incarnation) -> None:
                if not call.cancelled() and isinstance(call.exception(), ActorDiedError):
                    self.membership.lose(m, f"died during {what} ({call.exception().reason})", kill=False,
                                         incarnation=incarnation)
            call.add_done_callback(died)

    def _judge(self, what: str, knob: str, timeout_s: float, group: list[Member], pinned: list[int],
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
        if isinstance(trainer, BaseException) and not suffered_from_peer(trainer):
            raise RunStoppedError(f"the trainer failed during {what}: {first_line(trainer)}") from trainer
        ok = not isinstance(trainer, BaseException)
        lose = self.membership.lose
        for m, incarnation, result in zip(group, pinned, samplers):
            if not isinstance(result, BaseException):
                continue
            ok = False
            if isinstance(result, ActorDiedError):
                lose(m, f"died during {what} ({result.reason})", kill=False, incarnation=incarnation)
            elif isinstance(result, CallTimeoutError):
                lose(m, f"no answer during {what} within {result.timeout_s:g} s", kill=True, incarnation=incarnation)
            elif not suffered_from_peer(result):
                lose(m, f"failed during {what}: {first_line(result)}", kill=True, incarnation=incarnation)
        if not ok:
            self.membership.dirty = True
            self.log(f"{what} failed (generation {self.generation}): " + "; ".join(
                f"{name}: {first_line(r)}" for name, r in zip(["trainer", *(m.name for m in group)], results)
                if isinstance(r, BaseException)))
        return ok
