"""A sampler's rollout pump: the task that streams its groups into the driver's `RolloutQueue`.

`Pumps.run` is one sampler's pump (`SamplerPool` starts one per sampler in the group,
`Membership` holds its task).
Each group a stream delivers is checked to come from the incarnation that joined, no older than
the version it took; it gets its ``uid`` (``sampler/incarnation/sequence``, after the run
segment's prefix); the teacher and the reward model score it (driver/teacher.py); a group of
equal rewards is left out (uniform.py); the rest is queued, a put waiting while the queue is full.

In async mode with a pacer, a pump keeps up to ``--sampler.streams`` batches' worth of its
sampler's groups in flight (its window): it asks the pacer for credit for a batch of at most
``batch_groups`` prompts and streams that batch. The groups of a batch end at their own time (a
sampler whose engine batches concurrent calls yields each problem's group as it ends), so a batch
held by its longest group holds only the credit of what it has not delivered. When the next batch
begins depends on the engine:

* one that batches concurrent calls (vLLM; `Member.batches_requests`, from the sampler's stats)
  gets a batch of whatever the window has room for, as soon as it has room for one group: each
  group that ends is replaced at once, so the engine's batch stays full while a long group
  decodes, as continuous batching keeps it within one call;
* any other gets whole batches, each once the window has room for all of it (it generates a batch
  per call: a batch of one would run alone).

Waiting for a whole batch's room, a vLLM sampler's batch thinned out behind its longest group
every batch, as a synchronous step's does, and at long tails async gained little over sync on one
GPU (benchmarks/README.md, "Long generations"). Groups are queued in the order they arrive: none
waits behind a longer one. Without a pacer, one endless stream; in sync mode, ``max_groups`` groups.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import aclosing
from dataclasses import dataclass

import msgspec

from asyncrl.errors import ActorDiedError
from asyncrl.rl.config.run import DeadlineConfig
from asyncrl.rl.driver.fleet.decoding import UNWATCHED_S, while_decoding
from asyncrl.rl.driver.fleet.membership import Member, Membership
from asyncrl.rl.driver.pacing import Pacer
from asyncrl.rl.driver.queue import RolloutQueue, _Wakeup
from asyncrl.rl.driver.teacher import RewardModel, Teacher
from asyncrl.rl.driver.uniform import UniformGroups
from asyncrl.rl.rollout import RolloutGroup


@dataclass(frozen=True)
class RolloutFlow:
    """How the samplers' groups reach the queue (the pumps', pumps.py): paced or not, in batches of
    how many prompts over how many streams, their ids after which prefix, scored by which models."""

    queue: RolloutQueue
    pacer: Pacer | None = None
    """Async mode: the credit each batch of a stream asks for (pacing.py); None: unpaced."""
    batch_groups: int = 0
    """The prompts of one paced batch (the samplers' ``prompts_per_batch``)."""
    streams: int = 1
    """Paced batches in flight per sampler (``--sampler.streams``)."""
    uid_prefix: str = ""
    """Put before every group id: the run segment's (``resume1/``, ...)."""
    teacher: Teacher | None = None
    """Scores every group before it is queued (driver/teacher.py)."""
    reward_model: RewardModel | None = None
    """Adds its score to every group's rewards before it is queued."""


class Pumps:
    """The rollout pumps of a run's samplers (see the module docstring); `run` is one pump. Its
    groups go where ``flow`` says, each put waiting at most what ``deadlines`` allow; groups of one
    reward are left out by ``uniform``."""

    def __init__(self, membership: Membership, flow: RolloutFlow, deadlines: DeadlineConfig, uniform: UniformGroups):
        self.membership, self.queue, self.deadlines, self.uniform = membership, flow.queue, deadlines, uniform
        # Put before every group id: the run segment ("resume1/", ...), since a resumed run's
        # samplers number their groups from incarnation 1, sequence 1 again.
        self.uid_prefix = flow.uid_prefix
        # Async mode with a pacer: each pump keeps up to ``streams`` batches of ``batch_groups``
        # prompts (the sampler's prompts_per_batch) in flight, each begun with the pacer's credit;
        # without: one endless stream.
        self.pacer, self.batch_groups, self.streams = flow.pacer, flow.batch_groups, max(1, flow.streams)
        self.teacher, self.reward_model = flow.teacher, flow.reward_model  # the reward model's score is in the reward

    async def run(self, m: Member, max_groups: int, accepted: list[int] | None = None) -> None:
        """Stream one sampler's groups into the queue (a put waits while the queue is full):
        ``max_groups`` of them, or with ``max_groups`` 0 until stopped, paced when there is a pacer
        (`_paced_streams`)."""
        if self.membership.lose_replaced([m]):
            return
        if max_groups or self.pacer is None:
            await self._stream(m, max_groups, accepted)
        else:
            await self._paced_streams(m, self.pacer)

    async def _paced_streams(self, m: Member, pacer: Pacer) -> None:
        """Paced streams of ``m``, one batch each, begun while the groups they have not
        delivered leave room in the window (``streams * batch_groups``): room for one group
        where ``m``'s engine batches concurrent calls (the batch then takes that room, up to
        ``batch_groups``), for a whole batch otherwise. The first stream to fail ends the pump
        with its error, the others cancelled (their credit given back)."""
        window = self.streams * self.batch_groups
        least = 1 if m.batches_requests else self.batch_groups  # the room a batch begins with
        open_credit: list[list[int]] = []  # each live stream's credit not yet used
        failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        streams: set[asyncio.Task] = set()
        a_stream_ended = _Wakeup()

        def ended(task: asyncio.Task) -> None:
            streams.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None and not failed.done():
                failed.set_result(error)
            a_stream_ended.notify_all()

        try:
            while not failed.done():
                room = window - sum(c[0] for c in open_credit)
                if room < least:
                    # No await between the check and the wait's registering: a delivery (the
                    # pacer's change) or a stream's end in between would otherwise go unseen.
                    await pacer.changed.wait(self._put_timeout_s(), a_stream_ended)
                    continue
                credit = await self._credit(m, pacer, failed, min(room, self.batch_groups), least)
                if credit is None:
                    break
                open_credit.append(credit)
                task = self.membership.spawn(self._paced_stream(m, pacer, credit, open_credit), f"stream of {m.name}")
                streams.add(task)
                task.add_done_callback(ended)
        finally:
            for stream in list(streams):
                stream.cancel()
            if streams:
                await asyncio.wait(streams)  # their finally blocks give the credit back at once
        raise failed.result()

    async def _credit(
        self, m: Member, pacer: Pacer, failed: asyncio.Future, groups: int, least: int
    ) -> list[int] | None:
        """The pacer's credit for one more batch of ``m``: at most ``groups``, at least ``least``
        where the pacer has it (`Pacer.grant`), as a one-item list its stream counts down; None
        when a stream failed first (nothing taken then)."""
        asking = asyncio.ensure_future(pacer.acquire(groups, self._put_timeout_s(), m.name, least=least))
        try:
            await self._either(asking, failed)
        except BaseException:  # cancelled: nothing granted may stay counted in flight
            await _withdraw(asking, pacer)
            raise
        if failed.done():
            await _withdraw(asking, pacer)  # a sibling failed first: the pump ends
            return None
        return [asking.result()]  # PacingTimeoutError: no credit in time, the pump ends with it

    @staticmethod
    async def _either(wait: Awaitable[object], failed: asyncio.Future) -> None:
        """Until ``wait`` ends or ``failed`` is set (``wait`` is not cancelled for the latter)."""
        task = asyncio.ensure_future(wait)
        await asyncio.wait((task, failed), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _paced_stream(self, m: Member, pacer: Pacer, credit: list[int], open_credit: list[list[int]]) -> None:
        try:
            await self._stream(m, credit[0], None, credit)
        finally:
            open_credit.remove(credit)
            pacer.give_back(credit[0])  # what the stream did not deliver (it failed, or was cut)

    async def _stream(
        self, m: Member, max_groups: int, accepted: list[int] | None, credit: list[int] | None = None
    ) -> None:
        """One ``rollouts(max_groups)`` stream into the queue; each group delivered uses one of
        ``credit`` (the pacer's grant)."""
        handle = m.handle.pinned(m.incarnation)
        stream = handle.with_timeout(UNWATCHED_S).rollouts(max_groups)
        groups = while_decoding(handle, stream, timeout_s=self.deadlines.generate_timeout_s, what="rollouts")
        async with aclosing(groups):  # whatever ends the pump's reading ends the stream on the sampler
            async for group in groups:
                try:
                    await self._deliver(m, group, accepted)
                finally:
                    if credit is not None:
                        credit[0] -= 1
                        if self.pacer is not None:  # where the credit came from
                            self.pacer.delivered(last=credit[0] == 0)

    async def _deliver(self, m: Member, group: RolloutGroup, accepted: list[int] | None) -> None:
        """One group of ``m``'s stream: named, scored, and queued (or left out: one reward)."""
        incarnation = m.handle.info().incarnation
        if incarnation != m.incarnation or group.version < m.min_version:
            raise ActorDiedError(
                m.name, f"incarnation {m.incarnation} was replaced by {incarnation} outside the group"
            )  # its groups were never synced: drop them
        seq = self.membership.delivered(m)
        group = msgspec.structs.replace(group, uid=f"{self.uid_prefix}{m.name}/{m.incarnation}/{seq}")
        if self.teacher is not None:
            group = await self.teacher.annotate(group)
        if self.reward_model is not None:
            group = await self.reward_model.annotate(group)
        if self.uniform.leave_out(group):
            pass  # no learning signal: the sampler makes another in its place
        elif await self.queue.put(group, timeout_s=self._put_timeout_s()) and accepted is not None:
            accepted[0] += 1

    def _put_timeout_s(self) -> float:
        """The longest a live driver leaves the queue full, or its pumps without credit: a train
        step, a sync, a checkpoint, an evaluation."""
        d = self.deadlines
        return d.queue_timeout_s + d.train_timeout_s + d.sync_timeout_s + d.checkpoint_timeout_s + d.eval_timeout_s


async def _withdraw(asking: asyncio.Future[int], pacer: Pacer) -> None:
    """Stop asking for credit, and give back what was granted meanwhile."""
    if not asking.done():
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
    elif not asking.cancelled() and asking.exception() is None:
        pacer.give_back(asking.result())
