"""A sampler's rollout pump: the task that streams its groups into the driver's `RolloutQueue`.

`Pumps.run` is one sampler's pump (`SamplerPool` starts one per sampler in the group,
`Membership` holds its task).
Each group a stream delivers is checked to come from the incarnation that joined, no older than
the version it took; it gets its ``uid`` (``sampler/incarnation/sequence``, after the run
segment's prefix); the teacher and the reward model score it (driver/teacher.py); a group of
equal rewards is left out (uniform.py); the rest is queued, a put waiting while the queue is full.

In async mode with a pacer, a pump runs ``--sampler.streams`` paced streams at once, each asking
the pacer for credit for one batch of ``batch_groups`` prompts, again and again, and they queue
their groups in the order the pacer granted their credit (`_turn`): the pacer's promise that one
sampler's groups all train in time holds for any number of streams (pacing.py). Without a pacer,
one endless stream; in sync mode, ``max_groups`` groups.
"""

from __future__ import annotations

import asyncio

import msgspec

from asyncrl.errors import ActorDiedError
from asyncrl.rl.config.run import DeadlineConfig
from asyncrl.rl.driver.fleet.membership import Member, Membership
from asyncrl.rl.driver.pacing import Pacer, PacingTimeoutError
from asyncrl.rl.driver.queue import RolloutQueue
from asyncrl.rl.driver.teacher import RewardModel, Teacher
from asyncrl.rl.driver.uniform import UniformGroups
from asyncrl.runtime.timeouts import timeout


class Pumps:
    """The rollout pumps of a run's samplers (see the module docstring); `run` is one pump."""

    def __init__(
        self,
        membership: Membership,
        queue: RolloutQueue,
        deadlines: DeadlineConfig,
        uniform: UniformGroups,
        *,
        pacer: Pacer | None,
        batch_groups: int,
        streams: int,
        teacher: Teacher | None,
        reward_model: RewardModel | None,
        uid_prefix: str,
    ):
        self.membership, self.queue, self.deadlines, self.uniform = membership, queue, deadlines, uniform
        # Put before every group id: the run segment ("resume1/", ...), since a resumed run's
        # samplers number their groups from incarnation 1, sequence 1 again.
        self.uid_prefix = uid_prefix
        # Async mode with a pacer: each pump runs ``streams`` paced streams at once, each asking
        # it for credit, then streaming one batch of ``batch_groups`` prompts (the sampler's
        # prompts_per_batch), again and again; without: one endless stream.
        self.pacer, self.batch_groups, self.streams = pacer, batch_groups, max(1, streams)
        self.teacher, self.reward_model = teacher, reward_model  # the reward model's score is in the reward

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
        """``self.streams`` paced streams of ``m`` at once, so its engine holds that many batches
        (a GPU engine makes more sequences at once at little extra cost a step). Each loops: credit
        for a batch, the batch's stream, the unused credit back. They queue their groups in grant
        order (`_turn`), so one sampler's groups all train in time (pacing.py). The first to fail
        ends the pump with its error, its siblings cancelled (their credit given back)."""
        turn = [_ended()]  # the latest grant's end: the next grant queues after it
        streams = [
            self.membership.spawn(self._paced_stream(m, pacer, turn), f"paced stream of {m.name}")
            for _ in range(self.streams)
        ]
        try:
            done, _ = await asyncio.wait(streams, return_when=asyncio.FIRST_COMPLETED)  # each ends only by an error
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.wait(streams)  # their finally blocks give the credit back at once
        error = next(iter(done)).exception()  # a sibling's own failure is retrieved by `Membership.spawn`
        if error is None:
            raise RuntimeError("a paced stream returned: it ends only by an error")
        raise error

    async def _paced_stream(self, m: Member, pacer: Pacer, turn: list[asyncio.Event]) -> None:
        while True:
            credit = [await pacer.acquire(self.batch_groups, self._put_timeout_s(), m.name)]
            before, turn[0] = turn[0], asyncio.Event()  # no await since the grant: grant order
            mine = turn[0]
            try:
                await self._stream(m, credit[0], None, credit, before)
            finally:
                mine.set()
                pacer.give_back(credit[0])  # what the stream did not deliver (it failed, or was cut)

    async def _stream(
        self,
        m: Member,
        max_groups: int,
        accepted: list[int] | None,
        credit: list[int] | None = None,
        turn: asyncio.Event | None = None,
    ) -> None:
        """One ``rollouts(max_groups)`` stream into the queue; each group delivered uses one of
        ``credit`` (the pacer's grant), and is queued only once ``turn`` is set (the grant before
        this one ended)."""
        put_s = self._put_timeout_s()
        handle = m.handle.pinned(m.incarnation).with_timeout(self.deadlines.generate_timeout_s)
        async for group in handle.rollouts(max_groups):
            incarnation = m.handle.info().incarnation
            if incarnation != m.incarnation or group.version < m.min_version:
                raise ActorDiedError(
                    m.name, f"incarnation {m.incarnation} was replaced by {incarnation} outside the group"
                )  # its groups were never synced: drop them
            seq = self.membership.delivered(m)
            group = msgspec.structs.replace(group, uid=f"{self.uid_prefix}{m.name}/{m.incarnation}/{seq}")
            try:
                if self.teacher is not None:
                    group = await self.teacher.annotate(group)
                if self.reward_model is not None:
                    group = await self.reward_model.annotate(group)
                if turn is not None and not turn.is_set():
                    await self._turn(m, turn, put_s)
                if self.uniform.leave_out(group):
                    pass  # no learning signal: the sampler makes another in its place
                elif await self.queue.put(group, timeout_s=put_s) and accepted is not None:
                    accepted[0] += 1
            finally:
                if credit is not None:
                    credit[0] -= 1
                    if self.pacer is not None:  # where the credit came from
                        self.pacer.delivered()

    async def _turn(self, m: Member, before: asyncio.Event, timeout_s: float) -> None:
        """Wait for ``m``'s earlier paced stream to end. A group queued ahead of an earlier grant's
        would push that grant's groups past the steps the pacer counted them in, and they could
        expire. The earlier stream's own deadlines (a group within generate_timeout_s, a put
        within ``timeout_s``) end it first; this one is the backstop."""
        try:
            async with timeout(timeout_s):
                await before.wait()
        except TimeoutError:
            raise PacingTimeoutError(
                f"{m.name}: a paced stream waited {timeout_s:g} s for the one begun before it to deliver"
            ) from None

    def _put_timeout_s(self) -> float:
        """The longest a live driver leaves the queue full, or its pumps without credit: a train
        step, a sync, a checkpoint, an evaluation."""
        d = self.deadlines
        return d.queue_timeout_s + d.train_timeout_s + d.sync_timeout_s + d.checkpoint_timeout_s + d.eval_timeout_s


def _ended() -> asyncio.Event:
    done = asyncio.Event()
    done.set()
    return done
