"""The weight-sync group's group-wide calls, and the verdicts on their outcomes.

`SyncGroup` forms the group (the trainer as rank 0, the members still up, the replacements that
are up) at the next rendezvous generation (one `SyncAddress` for all, each its own rank) and sends
it weights. Each member's `sync_join` closes each survivor's old (perhaps aborted) communicator and
creates one for the new membership; nothing else about the survivors is touched, and their
rollouts keep flowing.

Samplers that share a vLLM engine (``--sampler.clients_per_engine``): only the engine's host is a
rank of the group, receiving into the one copy of the weights for all; once a sync is done on every
rank, each other client is told (its own ``receive_weights``: where its requests stood at the
load, read from the engine). A client failing that is lost, and the group formed again.

Every group-wide call is one `Membership.call_all` with the trainer as its lead, and each
member's outcome is judged: the trainer's death or silence stops the run
(`SyncGroup._judge_trainer`); a sampler that died, fell silent, or failed by itself is lost; one
that failed with a data-plane error raised by a peer's failure (`PEER_FAILURE_ERRORS`) suffered
it, and stays. A member's answer is awaited until its own deadline plus a grace, never less, so a
survivor whose error comes late on a loaded machine is not taken for a frozen one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from asyncrl.comm.address import SyncAddress
from asyncrl.comm.errors import PEER_FAILURE_ERRORS
from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, first_line
from asyncrl.rl.checkpoint import SamplerDataState
from asyncrl.rl.config.run import DeadlineConfig
from asyncrl.rl.driver.faults import PhaseTimeoutError, RunStoppedError, TrainerLostError, trainer_phase
from asyncrl.rl.driver.fleet.handles import Log, SamplerHandle
from asyncrl.rl.driver.fleet.membership import LeadCall, Member, Membership, MemberState
from asyncrl.rl.driver.fleet.trainer_ranks import TrainerRanks

if TYPE_CHECKING:
    from asyncrl.comm.sync_stats import SyncStats
    from asyncrl.rl.sampler.backend import SamplerSyncStats

T = TypeVar("T")
L = TypeVar("L")

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


def delta_wanted(setting: str, trainer_node: int, sampler_nodes: list[int]) -> bool:
    """``--run.sync_delta``: 'on', 'off', or 'auto', which is on where a sampler sits on another
    host than the trainer: there the bytes cross a network link, which is what a delta saves;
    within a host (NVLink, PCIe, CUDA IPC, loopback) its compare and patch passes cost about what
    the bytes they save would."""
    if setting == "auto":
        return any(node != trainer_node for node in sampler_nodes)
    return setting == "on"


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


@dataclass(frozen=True)
class SyncPlace:
    """Where the weight-sync group meets and over what: the same for every generation."""

    host: str
    """Where trainer rank 0 hosts the group's store: its node's address, which every sampler reaches."""
    backend: str
    """The communicator every member makes (`SyncAddress.backend`)."""


class SyncGroup:
    """The group-wide calls of the weight-sync group (see the module docstring)."""

    def __init__(
        self,
        trainer: TrainerRanks,
        membership: Membership,
        deadlines: DeadlineConfig,
        place: SyncPlace,
        *,
        log: Log = print,
        delta: str = "off",
    ):
        self.trainer, self.membership, self.deadlines, self.place = trainer, membership, deadlines, place
        self.log = log
        self.delta = delta
        """``--run.sync_delta``; each membership's choice is `delta_wanted`'s."""
        self.generation = -1
        self.wire_dtype = ""
        """What the trainer sends in: the samplers' weight dtype when they agree (`wire_dtype`)."""
        self.last: tuple[SyncStats, list[SamplerSyncStats]] | None = None
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
            group = members.formable()
            if not group:
                members.nobody_to_form()
                return  # the trainer alone: nobody to sync until a replacement is up
            if not await self._probe(group):
                continue
            self.generation += 1
            if await self._form(group) and await self._setup(group) and await self.send(version, group):
                members.joined(group, version, time.monotonic() - started, self.generation)
                return
        raise RunStoppedError(
            f"the weight-sync group could not be rebuilt in {attempts} attempts (generation {self.generation})"
        )

    async def send(self, version: int, group: list[Member]) -> bool:
        """One sync. Every member ends its side within ``sync_timeout_s`` (a sampler's wait for a
        pause included), with success or a typed error, so each is waited for until then plus
        ``SYNC_GRACE_S``: one that has not answered by that time (frozen) is lost; one that answers
        late with a collective error, after a peer died (the trainer may have failed at once),
        is a survivor, not a suspect. The clients of shared engines are told after their hosts."""
        what = f"the weight sync of v{version}"
        wait_s = self.deadlines.sync_timeout_s + SYNC_GRACE_S
        answers = await self._group_call(
            _ranks(group),
            lambda trainer: trainer.send_weights(version),
            lambda h, _: h.receive_weights(version),
            what,
            "sync_timeout_s",
            self.deadlines.sync_timeout_s,
            SYNC_GRACE_S,
        )
        clients = [m for m in group if m.host is not None]
        if answers is None or not clients:
            self.last = answers
            return answers is not None
        after = f"{what}, told after its engine's host"
        told = await self.membership.call_all(
            clients, lambda h, _: h.receive_weights(version), timeout_s=wait_s, what=after, whole=True
        )
        if told is None or not told.ok:
            why = told.summary() if told is not None else "a client was replaced"
            self.log(f"{after} failed (generation {self.generation}): {why}")
            return False
        self.last = (answers[0], answers[1] + told.values())
        return True

    async def _prepare_replacement(self, m: Member) -> None:
        """A restarted sampler continues its predecessor's data walk, with a fresh sampling RNG."""
        state = SamplerDataState(m.seed, m.walk_base + m.delivered, generator_seed=(m.seed << 16) + m.incarnation)
        await self.membership.call_all(
            [m],
            lambda h, _: h.restore_data_state(state),
            timeout_s=self.deadlines.rendezvous_timeout_s,
            what="its preparation to rejoin",
        )

    async def _probe(self, group: list[Member]) -> bool:
        """A frozen member would hold every other one in the rendezvous until its deadline, so
        each must show a sign of life first; one that does not is lost (and killed)."""
        answers = await self.membership.call_all(
            group,
            lambda h, _: h.stats(),
            timeout_s=PROBE_S,
            whole=True,
            what="the sign of life asked before the rebuild of the group",
        )
        if answers is None or not answers.ok:
            return False
        self.wire_dtype = wire_dtype(
            [r.weight_dtype if not isinstance(r, BaseException) else "" for r in answers.results]
        )
        for m, stats in answers.of_members():
            if not isinstance(stats, BaseException):
                self.membership.engine_seen(m, batches_requests=stats.batches_requests)
        return True

    async def _form(self, group: list[Member]) -> bool:
        """Every join at once under one deadline (the rendezvous contract); True if all joined."""
        t = self.deadlines.rendezvous_timeout_s
        port = await trainer_phase(
            "the weight-sync rendezvous",
            "rendezvous_timeout_s",
            t,
            self.trainer.with_timeout(t).sync_listen(self.place.host),
        )
        ranks = _ranks(group)
        address = SyncAddress(
            host=self.place.host,
            port=port,
            world_size=1 + len(ranks),
            generation=self.generation,
            backend=self.place.backend,
            timeout_s=t,
        )
        rank = {m: r for r, m in enumerate(ranks, start=1)}  # the trainer's is 0
        answers = await self._group_call(
            ranks,
            lambda trainer: trainer.sync_join(address, 0),
            lambda h, m: h.sync_join(address, rank[m]),
            "joining the weight-sync group",
            "rendezvous_timeout_s",
            t,
            JOIN_GRACE_S,
        )
        return answers is not None

    async def _setup(self, group: list[Member]) -> bool:
        """Agree on the weight layout (each side bounded by ``sync_timeout_s``); True if all did."""
        t = self.deadlines.sync_timeout_s
        delta = delta_wanted(self.delta, _node(self.trainer), [_node(m.handle) for m in group])
        answers = await self._group_call(
            _ranks(group),
            lambda trainer: trainer.setup_sender(t, wire_dtype=self.wire_dtype, delta=delta),
            lambda h, _: h.setup_receiver(t),
            "agreeing on the weight layout",
            "sync_timeout_s",
            t,
            JOIN_GRACE_S,
        )
        return answers is not None

    async def _group_call(
        self,
        group: list[Member],
        trainer_call: Callable[[TrainerRanks], Awaitable[L]],
        member_call: Callable[[SamplerHandle, Member], Awaitable[T]],
        what: str,
        knob: str,
        timeout_s: float,
        grace_s: float,
    ) -> tuple[L, list[T]] | None:
        """``trainer_call`` made to the trainer and ``member_call`` to every member at once, each
        waited for until its own deadline (``--run.<knob>``) plus ``grace_s``: one that has not
        answered by then (frozen) is lost; one that answers late with a collective error, after a
        peer died (the trainer may have failed at once), is a survivor, not a suspect. The
        trainer's answer and the members', or None if any failed or a member was replaced before
        the call (the group must be formed again)."""
        wait_s = timeout_s + grace_s
        lead = LeadCall(
            self.trainer.name,
            lambda: trainer_call(self.trainer.with_timeout(wait_s)),
            lambda result: self._judge_trainer(result, what, knob, timeout_s),
        )
        answers = await self.membership.call_all(
            group, member_call, timeout_s=wait_s, what=what, whole=True, lead=lead, spare=suffered_from_peer
        )
        if answers is None:
            return None
        if not answers.ok or isinstance(lead.answer, BaseException):
            failed = [f"{lead.name}: {first_line(lead.answer)}"] if isinstance(lead.answer, BaseException) else []
            failed += [answers.summary()] if not answers.ok else []
            self.log(f"{what} failed (generation {self.generation}): {'; '.join(failed)}")
            return None
        return lead.value(), answers.values()

    def _judge_trainer(self, result: object, what: str, knob: str, timeout_s: float) -> None:
        """The trainer's outcome of a group-wide call: its death, its silence or its own failure
        stops the run; an error it suffered from a peer only means that the group must be rebuilt."""
        if isinstance(result, ActorDiedError):
            raise TrainerLostError(f"the trainer died during {what} ({result.reason})")
        if isinstance(result, CallTimeoutError):
            raise PhaseTimeoutError(f"{what}: the trainer did not answer within --run.{knob} {timeout_s:g} s")
        if isinstance(result, BaseException) and not suffered_from_peer(result):
            raise RunStoppedError(f"the trainer failed during {what}: {first_line(result)}") from result


def _ranks(group: list[Member]) -> list[Member]:
    """The members of ``group`` that are ranks of the weight-sync group: all but the clients of
    shared engines, whose hosts receive for them."""
    return [m for m in group if m.host is None]


def _node(handle: SamplerHandle | TrainerRanks) -> int:
    """The node an actor runs on (0 for a handle that cannot say: a test's stand-in)."""
    info = getattr(handle, "info", None)
    return getattr(info(), "node", 0) if callable(info) else 0
