"""The sampler pool's judging, in-process and deterministic: scripted stand-ins for the trainer
and the samplers answer each call after a chosen delay (the end-to-end faults, with real
processes and signals, are in test_fault_tolerance.py).

* A survivor whose collective error comes late (a loaded machine) is not judged frozen when a peer
  died and the trainer failed at once; only the dead sampler is lost.
* A sampler that comes back after a slow restart is taken back, not declared gone; one whose
  restarts are used up is declared gone at once, with the reason.
* No task of the pool leaves an exception unretrieved, and `close` ends them all at once, a wait
  for a restart that never comes included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import signal
import time
from types import SimpleNamespace

import msgspec
import pytest

from actors import Echo
from asyncrl import ActorState, Supervisor
from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError
from asyncrl.comm.weights import SyncStats
from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, remote_error_class, type_path
from asyncrl.rl.config.run import DeadlineConfig, RecoveryConfig, RunConfig
from asyncrl.rl.driver.faults import NoSamplersError, TaskFailedError, WeightsDivergedError, WeightsUncheckableError
from asyncrl.rl.driver.fleet import sync_group
from asyncrl.rl.driver.fleet.calls import call_all
from asyncrl.rl.driver.fleet.membership import Membership, MemberState
from asyncrl.rl.driver.fleet.pool import RolloutFlow, SamplerPool
from asyncrl.rl.driver.fleet.sync_group import SyncPlace
from asyncrl.rl.driver.pacing import Pacer
from asyncrl.rl.driver.queue import RolloutQueue
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.sampler.backend import SamplerSyncStats
from asyncrl.rl.sampler.errors import SamplerTimeoutError, WeightsUnreadableError
from asyncrl.rl.sampler.stats import SamplerStats
from asyncrl.rl.tasks.scoring import TaskFailureError
from asyncrl.runtime.timeouts import timeout

pytestmark = pytest.mark.timeout(60)
SENT = SyncStats(1, 100, 1, 0.01)  # a successful sync's answers
GOT = SamplerSyncStats(seconds=0.01, receive=SENT)


def answering(**fields) -> SamplerStats:
    """A sampler's answer to ``stats``: nothing counted yet, no weight dtype told; ``fields`` replace those."""
    nothing = dict.fromkeys(SamplerStats.__struct_fields__, 0) | dict(name="sampler", backend="hf", device="cpu")
    told = {"loaded_adapters": None, "weight_dtype": "", "serves_evaluations": False, "digestible": True}
    return SamplerStats(**{**nothing, **told, **fields})


class Scripted:
    """Stands in for an `ActorHandle`: each method answers with the next entry of its script,
    ``(delay_s, value or exception)`` (the last entry repeats), after that delay, within the
    call's deadline (else `CallTimeoutError`, as a real call). A `kill` is recorded in ``kills``
    and changes nothing (the process it would kill is not there)."""

    def __init__(self, name: str, **script: list[tuple[float, object]]):
        self.name = name
        self.script = {k: list(v) for k, v in script.items()}
        self.state, self.incarnation, self.restarts, self.max_restarts = "running", 1, 0, 3
        self.node = 0  # the cluster node it runs on
        self.calls: list[str] = []
        self.kills: list[tuple[str, int | None]] = []  # (reason, incarnation) of each kill asked for
        self.items: asyncio.Queue = asyncio.Queue()  # what a rollouts stream yields next
        self.streams: list[int] = []  # the max_groups of each rollouts stream asked for
        self._changed = asyncio.Event()

    def info(self) -> SimpleNamespace:
        return SimpleNamespace(
            state=ActorState(self.state),
            incarnation=self.incarnation,
            restarts=self.restarts,
            max_restarts=self.max_restarts,
            node=self.node,
        )

    def kill(self, reason: str, incarnation: int | None = None) -> bool:
        self.kills.append((reason, incarnation))
        return False

    def set_state(self, state: str, incarnation: int | None = None) -> None:
        self.state = state
        self.incarnation = self.incarnation if incarnation is None else incarnation
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_incarnation(self, after: int, timeout_s: float) -> SimpleNamespace:
        deadline = time.monotonic() + timeout_s
        while not ((self.state == "running" and self.incarnation > after) or self.state in ("dead", "stopped")):
            try:
                await asyncio.wait_for(self._changed.wait(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                break
        return self.info()

    def pinned(self, incarnation: int) -> Scripted:
        return self  # its script plays whichever incarnation is called

    def with_timeout(self, timeout_s: float) -> SimpleNamespace:
        return SimpleNamespace(**{method: self._method(method, timeout_s) for method in self.script})

    def _method(self, method: str, timeout_s: float):
        if method == "rollouts":

            async def stream(max_groups: int = 0):  # as `ActorClient.stream`: the next item, or the error of a death
                self.calls.append(method)
                self.streams.append(max_groups)
                for _ in iter(int, 1) if not max_groups else range(max_groups):  # as the sampler: 0 is endless
                    async with timeout(timeout_s):  # not wait_for, which on 3.11 can swallow the pump's cancel
                        item = await self.items.get()
                    if isinstance(item, BaseException):
                        raise item
                    yield item

            return stream

        async def call(*args, **kwargs):
            self.calls.append(method)
            delay, outcome = self._next(method)
            if delay > timeout_s:
                await asyncio.sleep(timeout_s)
                raise CallTimeoutError(self.name, method, timeout_s)
            await asyncio.sleep(delay)
            if isinstance(outcome, ActorDiedError):
                self.set_state("restarting")  # as the supervisor shows it once the death is seen
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return call

    def _next(self, method: str) -> tuple[float, object]:
        script = self.script[method]
        return script.pop(0) if len(script) > 1 else script[0]


def remote(actor: str, method: str, cls: type, message: str) -> RemoteError:
    """What a call whose endpoint raised ``cls`` raises in the caller (as `ActorClient` builds it)."""
    return remote_error_class(cls.__name__, type_path(cls))(actor, method, cls.__name__, message)


def collective_error(actor: str, method: str) -> RemoteError:
    return remote(
        actor, method, CollectiveError, "group 'weights/g0' rank 1/3 (gloo): broadcast from rank 0 failed, a peer died"
    )


def run_config(restart_timeout_s: float = 30.0) -> RunConfig:
    deadlines = DeadlineConfig(
        sync_timeout_s=2.0,
        rendezvous_timeout_s=2.0,
        generate_timeout_s=5.0,
        queue_timeout_s=10.0,
        train_timeout_s=5.0,
        checkpoint_timeout_s=5.0,
        eval_timeout_s=5.0,
    )
    return RunConfig(
        mode="async",
        deadlines=deadlines,
        recovery=RecoveryConfig(restart_timeout_s=restart_timeout_s, sampler_max_restarts=3),
    )


def pool_of(
    trainer, samplers, queue: RolloutQueue, run: RunConfig, *, seeds=None, log=print, hosts=None, **flow
) -> SamplerPool:
    """The pool of a run on this host over gloo, built from its parts as the driver builds it
    (``hosts``: the samplers' engine hosts, `Membership`'s)."""
    membership = Membership(samplers, seeds or [0] * len(samplers), recovery=run.recovery, log=log, hosts=hosts)
    return SamplerPool(
        trainer, membership, RolloutFlow(queue, **flow), run=run, place=SyncPlace("127.0.0.1", "gloo"), log=log
    )


def make_pool(trainer, samplers, logs: list[str], hosts=None, **run) -> SamplerPool:
    pool = pool_of(trainer, samplers, RolloutQueue(8, 4), run_config(**run), log=logs.append, hosts=hosts)
    for m in pool.members:  # as after a successful start: in the group, incarnation 1
        m.state, m.incarnation = MemberState.JOINED, 1
    pool.sync_group.generation, pool.membership.dirty = 0, False
    return pool


def trainer_script(first_send: object) -> Scripted:
    return Scripted(
        "trainer",
        send_weights=[(0.0, first_send), (0.0, SENT)],
        sync_listen=[(0.0, 1234)],
        sync_join=[(0.0, "gloo")],
        setup_sender=[(0.0, 1)],
    )


async def test_a_survivor_whose_collective_error_comes_late_is_not_judged_frozen(monkeypatch):
    # The grace is short here so that the survivor's answer (1 s) comes well after it ended, as on
    # a loaded machine, yet well within the survivor's own deadline (sync_timeout_s 2 s + grace).
    monkeypatch.setattr(sync_group, "SYNC_GRACE_S", 0.5)
    trainer = trainer_script(collective_error("trainer", "send_weights"))  # a peer died: the trainer fails at once
    dead = Scripted("sampler0", receive_weights=[(0.0, ActorDiedError("sampler0", "killed by SIGKILL"))])
    slow = Scripted(
        "sampler1",
        receive_weights=[(1.0, collective_error("sampler1", "receive_weights")), (0.0, GOT)],
        stats=[(0.0, answering())],
        sync_join=[(0.0, "gloo")],
        setup_receiver=[(0.0, 1)],
    )
    logs: list[str] = []
    pool = make_pool(trainer, [dead, slow], logs)
    try:
        await pool.sync(1)
    finally:
        await pool.close()
    assert [f.sampler for f in pool.faults] == ["sampler0"], logs
    assert pool.counters["sampler_losses"] == 1 and "died" in pool.faults[0].cause
    assert [m.in_group for m in pool.members] == [False, True], logs
    assert pool.generation == 1 and slow.calls.count("receive_weights") == 2, logs  # failed; the rebuilt group's


async def test_a_death_is_one_loss_even_when_the_restart_ends_before_the_sync(monkeypatch):
    # sampler0 dies during a sync and is back (incarnation 2) before the survivor's answer ends
    # the sync: the sync's verdict on incarnation 1 must not count as a loss of incarnation 2.
    monkeypatch.setattr(sync_group, "SYNC_GRACE_S", 0.5)
    trainer = trainer_script(collective_error("trainer", "send_weights"))
    ok = dict(
        stats=[(0.0, answering())],
        sync_join=[(0.0, "gloo")],
        setup_receiver=[(0.0, 1)],
        restore_data_state=[(0.0, None)],
    )
    dies = Scripted(
        "sampler0", receive_weights=[(0.0, ActorDiedError("sampler0", "killed by SIGKILL")), (0.0, GOT)], **ok
    )
    slow = Scripted(
        "sampler1", receive_weights=[(1.0, collective_error("sampler1", "receive_weights")), (0.0, GOT)], **ok
    )
    logs: list[str] = []
    pool = make_pool(trainer, [dies, slow], logs)

    async def restart() -> None:
        while dies.state == "running":
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        dies.set_state("running", incarnation=2)

    restarter = asyncio.ensure_future(restart())
    try:
        await pool.sync(1)
    finally:
        await pool.close()
        await restarter
    assert pool.counters == {"sampler_losses": 1, "sampler_rejoins": 1, "rebuilds": 1}, logs
    assert [m.in_group for m in pool.members] == [True, True] and pool.members[0].incarnation == 2, logs


async def test_a_frozen_sampler_is_judged_by_its_own_deadline(monkeypatch):
    monkeypatch.setattr(sync_group, "SYNC_GRACE_S", 0.5)
    trainer = trainer_script(remote("trainer", "send_weights", CollectiveTimeoutError, "all_reduce timed out"))
    frozen = Scripted("sampler0", receive_weights=[(60.0, GOT)])
    steady = Scripted(
        "sampler1",
        receive_weights=[(0.1, collective_error("sampler1", "receive_weights")), (0.0, GOT)],
        stats=[(0.0, answering())],
        sync_join=[(0.0, "gloo")],
        setup_receiver=[(0.0, 1)],
    )
    logs: list[str] = []
    pool = make_pool(trainer, [frozen, steady], logs)
    start = time.monotonic()
    try:
        await pool.sync(1)
    finally:
        await pool.close()
    assert time.monotonic() - start < 2.0 + 0.5 + 2.0
    (fault,) = pool.faults
    assert fault.sampler == "sampler0" and fault.cause == "no answer during the weight sync of v1 within 2.5 s", fault
    assert frozen.kills == [(fault.cause, 1)] and not steady.kills  # the incarnation judged, only it
    assert [m.in_group for m in pool.members] == [False, True], logs


async def test_a_sampler_back_after_a_slow_restart_is_taken_back_and_a_dead_one_is_gone():
    sampler = Scripted("sampler0", stats=[(0.0, answering())])
    other = Scripted("sampler1", stats=[(0.0, answering())])
    logs: list[str] = []
    pool = make_pool(Scripted("trainer"), [sampler, other], logs, restart_timeout_s=5.0)
    try:
        sampler.set_state("restarting")
        pool.membership.lose(pool.members[0], "died (killed by SIGKILL)", kill=False)
        await asyncio.sleep(1.0)  # a restart that takes a while
        sampler.set_state("running", incarnation=2)
        await asyncio.wait_for(pool.members[0].waiter, 5)
        assert pool.members[0].state is MemberState.CANDIDATE and pool.members[0].incarnation == 2, logs

        other.restarts = other.max_restarts
        other.set_state("dead")
        start = time.monotonic()
        pool.membership.lose(pool.members[1], "died (killed by SIGKILL)", kill=False)
        await asyncio.wait_for(pool.members[1].waiter, 5)
        assert pool.members[1].state is MemberState.GONE and time.monotonic() - start < 1
        assert "sampler1 will not come back: its restarts are used up" in logs[-1], logs
    finally:
        await pool.close()


async def test_close_ends_every_task_and_no_exception_is_left_unretrieved():
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    try:
        streams = Scripted("sampler0", rollouts=[])
        waits = Scripted("sampler1")
        logs: list[str] = []
        pool = make_pool(Scripted("trainer"), [streams, waits], logs)
        m = pool.members[0]
        pool._start_pump(m)
        for _ in range(5):
            await asyncio.sleep(0)  # the pump waits for its first group
        # The sampler dies: its stream ends with the error, and in the same moment another call
        # that saw the death loses it, cancelling the pump. The cancel comes too late (the
        # stream's wait_for already has its item) and the pump ends with the error, unread.
        streams.items.put_nowait(ActorDiedError("sampler0", "killed by SIGKILL"))
        streams.set_state("restarting")
        pool.membership.lose(m, "died (killed by SIGKILL)", kill=False)
        await asyncio.sleep(0.1)
        waits.set_state("restarting")  # and a restart that never comes: close must not wait for it
        pool.membership.lose(pool.members[1], "died (killed by SIGKILL)", kill=False)
        start = time.monotonic()
        await pool.close()
        assert time.monotonic() - start < 1
        assert not [t for t in asyncio.all_tasks() if not t.done() and "SamplerPool" in repr(t.get_coro())]
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert not reported, [c.get("message") for c in reported]


async def test_a_failed_rollout_stream_is_judged_by_the_remote_error_type():
    samplers = [Scripted(f"sampler{i}") for i in range(3)]
    logs: list[str] = []
    pool = make_pool(Scripted("trainer"), samplers, logs)
    task_fails, waited, named = pool.members
    try:
        with pytest.raises(TaskFailedError, match="sampler0: 9 of 10 score calls raised"):  # the task's code: stop
            pool._pump_failed(
                task_fails, remote("sampler0", "rollouts", TaskFailureError, "9 of 10 score calls raised")
            )
        pool._pump_failed(waited, remote("sampler1", "rollouts", SamplerTimeoutError, "no good weights within 1 s"))
        assert waited.pump_failures == 1 and waited.in_group and pool.membership.dirty  # pumped after the next sync
        # a user's own class of the same name is not ours: the sampler's stream failed, it is lost
        pool._pump_failed(named, RemoteError("sampler2", "rollouts", "TaskFailureError", "a user's class"))
        assert not named.in_group and [f.sampler for f in pool.faults] == ["sampler2"], logs
    finally:
        await pool.close()


async def test_wait_for_incarnation_follows_a_real_restart():
    async with Supervisor() as sup:
        h = await sup.spawn(Echo, name="echo", max_restarts=1)
        os.kill(h.info().pid, signal.SIGKILL)
        status = await h.wait_for_incarnation(1, 60)
        assert status.state == "running" and status.incarnation == 2
        status = await h.wait_for_incarnation(2, 0.2)  # nothing happens: returns at the deadline
        assert status.state == "running" and status.incarnation == 2
        os.kill(h.info().pid, signal.SIGKILL)
        status = await h.wait_for_incarnation(2, 60)  # restarts used up: dead, at once
        assert status.state == "dead"


class _Frame:
    """What `ActorClient` reads of a received zmq frame."""

    def __init__(self, data: bytes):
        self.buffer = memoryview(data)
        self.bytes = data


async def test_a_stream_cancelled_as_its_next_item_arrives_stops(tmp_path):
    """A pump is an `ActorClient.stream` consumer. Cancelled (`SamplerPool.close` at the end of a
    run) in the moment its next rollout group arrives, it must stop there: with `wait_for` (Python
    3.11) the cancel was swallowed and the pump went on reading and putting groups into a queue
    nobody took from any more, blocked for minutes; the run never ended."""
    import msgspec
    import zmq

    from asyncrl.runtime import wire
    from asyncrl.runtime.actor import endpoints_of
    from asyncrl.runtime.client import ActorClient

    ctx = zmq.Context()
    client = ActorClient(ctx, "echo", f"ipc://{tmp_path}/nobody.sock", 1 << 20)  # nothing answers: we feed it
    try:
        got: list[int] = []

        async def pump() -> None:
            async for item in client.stream(endpoints_of(Echo)["count"], (5,), {}, 30.0):
                got.append(item)

        task = asyncio.ensure_future(pump())
        for _ in range(3):
            await asyncio.sleep(0)
        (call_id,) = client._pending
        item = wire.StreamItem(call_id, msgspec.Raw(msgspec.msgpack.encode(1)))
        client._on_message([_Frame(msgspec.msgpack.encode(item))])
        await asyncio.sleep(0)  # the item is on its way to the consumer...
        task.cancel()  # ...when it is told to stop
        await asyncio.wait({task}, timeout=2)
        assert task.cancelled(), f"the consumer went on after its cancel (got {got})"
    finally:
        client.close()
        ctx.destroy(0)


async def test_the_start_goes_on_without_a_sampler_that_never_came_up_or_died_before_it_joined():
    ok = dict(
        stats=[(0.0, answering())], sync_join=[(0.0, "gloo")], setup_receiver=[(0.0, 1)], receive_weights=[(0.0, GOT)]
    )
    never = Scripted("sampler0", **ok)
    never.set_state("dead")  # its start was lost, its restarts with it (fleet/sampler_start.py)
    died = Scripted("sampler1", restore_data_state=[(0.0, ActorDiedError("sampler1", "killed by SIGKILL"))], **ok)
    up = Scripted("sampler2", restore_data_state=[(0.0, None)], **ok)
    logs: list[str] = []
    pool = pool_of(
        trainer_script(SENT), [never, died, up], RolloutQueue(8, 4), run_config(), seeds=[0, 1, 2], log=logs.append
    )
    try:
        await pool.start(0, [])
    finally:
        await pool.close()
    assert [m.state for m in pool.members] == [MemberState.GONE, MemberState.LOST, MemberState.JOINED], logs
    assert never.calls == [] and pool.progress().samplers["sampler0"] == "gone"
    (fault,) = pool.faults
    assert fault.sampler == "sampler1" and "during taking its data position" in fault.cause, fault
    assert pool.generation == 0 and up.calls.count("receive_weights") == 1, logs


async def test_the_start_stops_when_every_sampler_is_gone():
    never = Scripted("sampler0")
    never.set_state("dead")
    pool = pool_of(trainer_script(SENT), [never], RolloutQueue(8, 4), run_config())
    try:
        with pytest.raises(NoSamplersError, match="no sampler could join the weight-sync group at the start"):
            await pool.start(0, [])
    finally:
        await pool.close()


def rollout(version: int, i: int) -> RolloutGroup:
    return RolloutGroup(
        prompt_id=i,
        prompt_ids=[1, 2],
        completion_ids=[[3], [4]],
        behaviour_logprobs=[[-0.5], [-0.7]],
        rewards=[0.0, 1.0],
        version=version,
        sampler="sampler0",
    )


async def test_a_sampler_back_after_a_sync_without_it_is_given_credit_for_the_next_batch():
    """Issue 30's 12-minute stall, step by step with the real pool, pacer and queue: one sampler
    (16 groups a step, batches of 8, max_staleness 1) is lost after step 39 took its batch, with
    6 groups of its next batch delivered; the sync of v39 finds the group empty; the sampler is
    back and rejoins with v39 while the driver waits for step 40's batch. The pacer was left at
    v38, so after one batch of 8 (14 queued) it had room for 2 groups only, asked for 8, and
    nothing moved again: paced_in_flight 0, queue_depth 14, the sampler in the group, idle."""
    ok = dict(
        stats=[(0.0, answering())],
        sync_join=[(0.0, "gloo")],
        setup_receiver=[(0.0, 1)],
        restore_data_state=[(0.0, None)],
        receive_weights=[(0.0, GOT)],
        rollouts=[],
    )
    sampler = Scripted("sampler0", **ok)
    config = dataclasses.replace(run_config(), groups_per_step=16, max_staleness=1)
    queue = RolloutQueue(32, 1)
    pacer = Pacer(queue, 16, 1, version=38, next_step=40)  # step 39 took its batch (trained at v38)
    logs: list[str] = []
    pool = pool_of(trainer_script(SENT), [sampler], queue, config, log=logs.append, pacer=pacer, batch_groups=8)
    m = pool.members[0]
    m.state, m.incarnation, m.min_version = MemberState.JOINED, 1, 38
    pool.sync_group.generation, pool.membership.dirty = 0, False
    try:
        for i in range(6):  # what incarnation 1 delivered of its last batch before it was killed
            assert await queue.put(rollout(38, i), timeout_s=1.0)
        sampler.set_state("restarting")
        pool.membership.lose(m, "died (killed by SIGKILL)", kill=False)
        await pool.sync(39)  # the trainer alone
        sampler.set_state("running", incarnation=2)
        await asyncio.wait_for(m.waiter, 5)
        for i in range(40):
            sampler.items.put_nowait(rollout(39, 100 + i))
        batch = await asyncio.wait_for(pool.next_batch(16, 39), 5.0)
    finally:
        await pool.close()
    assert not [line for line in logs if "still running" in line], logs
    assert len(batch) == 16 and m.in_group and m.incarnation == 2, logs
    assert pacer.version == 39, pacer.version  # the rejoined sampler holds v39: groups begun now train at step 41
    assert sampler.streams[:2] == [8, 8], sampler.streams  # whole batches: the room was counted from v39


async def test_call_all_awaits_every_answer_and_names_who_failed_during_what():
    answers_now = Scripted("sampler0", stats=[(0.0, answering(generating=2))])
    frozen = Scripted("sampler1", stats=[(30.0, answering())])
    dies = Scripted("sampler2", stats=[(0.0, ActorDiedError("sampler2", "killed by SIGKILL"))])
    started, deaths = time.monotonic(), []
    answers = await call_all(
        [answers_now, frozen, dies],
        lambda h, _: h.stats(),
        timeout_s=0.5,
        what="the probe",
        died=lambda i, error: deaths.append((i, time.monotonic() - started)),
    )
    assert answers.results[0] == answering(generating=2) and answers.failed() == [1, 2] and not answers.ok
    assert answers.cause(1) == "no answer during the probe within 0.5 s", answers.results
    assert answers.cause(2) == "died during the probe (killed by SIGKILL)", answers.results
    assert [i for i, _ in deaths] == [2] and deaths[0][1] < 0.4, deaths  # told at once, not after the frozen one
    assert answers.summary().startswith("sampler1: ") and "sampler2: " in answers.summary()


async def test_membership_call_all_pins_the_incarnations_and_loses_the_failed_in_one_place():
    ok = Scripted("sampler0", receive_weights=[(0.0, GOT)])
    frozen = Scripted("sampler1", receive_weights=[(30.0, GOT)])
    victim = Scripted("sampler2", receive_weights=[(0.0, collective_error("sampler2", "receive_weights"))])
    replaced = Scripted("sampler3", receive_weights=[(0.0, GOT)])
    logs: list[str] = []
    pool = make_pool(trainer_script(SENT), [ok, frozen, victim, replaced], logs)
    members = pool.membership
    replaced.set_state("running", incarnation=2)  # restarted since it joined: its calls would reach a stranger
    try:
        assert (
            await members.call_all(
                members.members,
                lambda h, _: h.receive_weights(1),
                timeout_s=0.5,
                what="the weight sync of v1",
                whole=True,
            )
            is None
        )
        assert ok.calls == [] and members.members[3].state is MemberState.LOST, logs  # the group is not whole
        answers = await members.call_all(
            [m for m in members.members if m.in_group],
            lambda h, _: h.receive_weights(1),
            timeout_s=0.5,
            what="the weight sync of v1",
            spare=sync_group.suffered_from_peer,
        )
    finally:
        await pool.close()
    assert [m.name for m, _ in answers.of_members()] == ["sampler0", "sampler1", "sampler2"]
    # sampler3's loss was judged on incarnation 1; incarnation 2 is a candidate of the next rebuild
    assert [m.state for m in members.members] == [
        MemberState.JOINED,
        MemberState.LOST,
        MemberState.JOINED,
        MemberState.CANDIDATE,
    ], logs
    (frozen_fault,) = [f for f in pool.faults if f.sampler == "sampler1"]
    assert frozen_fault.cause == "no answer during the weight sync of v1 within 0.5 s", pool.faults
    assert frozen.kills == [(frozen_fault.cause, 1)] and victim.kills == [] and replaced.kills == [], logs


# --- samplers that share a vLLM engine (--sampler.clients_per_engine) ----------------------------


class Told(Scripted):
    """A `Scripted` stand-in that writes each call it takes, and its end, in a log shared with others."""

    def __init__(self, name: str, told: list, **script):
        super().__init__(name, **script)
        self.told = told

    def _method(self, method: str, timeout_s: float):
        inner = super()._method(method, timeout_s)

        async def call(*args, **kwargs):
            self.told.append((self.name, method, "called", args))
            result = await inner(*args, **kwargs)
            self.told.append((self.name, method, "answered", args))
            return result

        return call


async def test_only_an_engine_s_host_is_a_rank_and_its_client_is_told_once_the_sync_is_done():
    """sampler1 is a client of sampler0's engine: the group is the trainer and sampler0 (world size
    2, sampler0 rank 1), sampler1 neither joins nor sets up a receiver (its stand-in has neither:
    a call would fail it), and it is asked for the version only once the trainer and its host
    have answered the sync."""
    told: list = []
    trainer = Told(
        "trainer", told, sync_listen=[(0.0, 1234)], sync_join=[(0.0, "gloo")], setup_sender=[(0.0, 1)],
        send_weights=[(0.2, SENT)],
    )  # fmt: skip
    host = Told(
        "sampler0", told, stats=[(0.0, answering())], sync_join=[(0.0, "gloo")], setup_receiver=[(0.0, 1)],
        receive_weights=[(0.2, GOT)],
    )  # fmt: skip
    client = Told("sampler1", told, stats=[(0.0, answering())], receive_weights=[(0.0, SamplerSyncStats())])
    logs: list[str] = []
    pool = pool_of(trainer, [host, client], RolloutQueue(8, 4), run_config(), log=logs.append, hosts=[None, 0])
    for m in pool.members:  # up, as after their start: candidates of the first rebuild
        m.incarnation = 1
    try:
        await pool.sync_group.rebuild(0)
        await pool.sync(1)
    finally:
        await pool.close()
    assert [m.state for m in pool.members] == [MemberState.JOINED, MemberState.JOINED] and not pool.faults, logs
    (address, rank), (host_address, host_rank) = [a for n, m, e, a in told if m == "sync_join" and e == "called"]
    assert address.world_size == host_address.world_size == 2 and (rank, host_rank) == (0, 1)
    assert client.calls == ["stats", "receive_weights", "receive_weights"], client.calls  # v0, v1: no join
    for version in (0, 1):
        order = [(n, e) for n, m, e, a in told if m in ("send_weights", "receive_weights") and a == (version,)]
        assert order.index(("sampler1", "called")) > order.index(("sampler0", "answered")), order
        assert order.index(("sampler1", "called")) > order.index(("trainer", "answered")), order
    assert len(pool.sync_group.last[1]) == 2  # the step's sync metrics count the client's answer too


async def test_a_lost_host_loses_its_clients_and_one_gone_for_good_takes_them_along():
    """Sampler0 hosts the engine of sampler1 and sampler2: its loss loses both (each a loss of its
    own, killed, the host named), and while it is away a client back from its restart is not
    formed into the group; once sampler0 will not come back, neither will they. Sampler3, an
    engine of its own, is untouched throughout."""
    samplers = [Scripted(f"sampler{i}", stats=[(0.0, answering())]) for i in range(4)]
    logs: list[str] = []
    pool = make_pool(Scripted("trainer"), samplers, logs, hosts=[None, 0, 0, None], restart_timeout_s=5.0)
    members = pool.membership
    try:
        samplers[0].set_state("restarting")
        members.lose(members.members[0], "died (killed by SIGKILL)", kill=False)
        assert [m.state for m in members.members] == [MemberState.LOST] * 3 + [MemberState.JOINED], logs
        assert [f.sampler for f in pool.faults] == ["sampler0", "sampler1", "sampler2"]
        assert pool.faults[1].cause == "its vLLM engine went with sampler0, its host (died (killed by SIGKILL))"
        assert samplers[1].kills == [(pool.faults[1].cause, 1)] and samplers[0].kills == []
        samplers[1].set_state("running", incarnation=2)  # back, and waiting for an engine
        await asyncio.wait_for(members.members[1].waiter, 5)
        assert members.members[1].state is MemberState.CANDIDATE
        assert [m.name for m in members.formable()] == ["sampler3"]  # not without its host
        samplers[0].restarts = samplers[0].max_restarts
        samplers[0].set_state("dead")
        await asyncio.wait_for(members.members[0].waiter, 5)
    finally:
        await pool.close()
    assert [m.state for m in members.members] == [MemberState.GONE] * 3 + [MemberState.JOINED], logs
    assert "sampler1 will not come back either: its vLLM engine was sampler0's" in logs, logs
    assert "sampler2 will not come back either: its vLLM engine was sampler0's" in logs, logs


# --- several paced streams of one sampler (--sampler.streams) ------------------------------------


class Engine(Scripted):
    """A sampler whose every rollouts batch begins under the version it holds then and takes the
    next of ``durations`` (cycled) before its groups come, so a batch begun later often ends
    first, as batches of unequal lengths do in a GPU engine."""

    def __init__(self, name: str, durations: list[float]):
        super().__init__(name, rollouts=[])
        self.version, self.durations, self.made = 0, list(durations), 0

    def _method(self, method: str, timeout_s: float):
        if method != "rollouts":
            return super()._method(method, timeout_s)

        async def stream(max_groups: int = 0):
            self.streams.append(max_groups)
            version, seconds = self.version, self.durations[len(self.streams) % len(self.durations)]
            await asyncio.sleep(seconds)
            for _ in range(max_groups):
                self.made += 1
                # begun under `version`, done under the one it holds now (a sampler's in-flight syncs)
                yield msgspec.structs.replace(rollout(version, self.made), delivered_version=self.version)

        return stream


def paced_pool(sampler, *, n: int, max_staleness: int, batch: int, streams: int) -> tuple[SamplerPool, Pacer]:
    config = dataclasses.replace(run_config(), groups_per_step=n, max_staleness=max_staleness)
    queue = RolloutQueue(n * (max_staleness + 1), max_staleness)
    pacer = Pacer(queue, n, max_staleness, version=0, next_step=1)
    pool = pool_of(Scripted("trainer"), [sampler], queue, config, pacer=pacer, batch_groups=batch, streams=streams)
    m = pool.members[0]
    m.state, m.incarnation = MemberState.JOINED, 1
    pool.sync_group.generation, pool.membership.dirty = 0, False
    return pool, pacer


@pytest.mark.parametrize("max_staleness", [1, 2])
async def test_a_gpu_sampler_keeps_as_many_batches_in_flight_as_the_staleness_leaves_room_for(max_staleness):
    from asyncrl.rl.config.sampler import SamplerConfig

    streams = SamplerConfig().paced_streams("cuda", 16, max_staleness)  # the default step, one sampler
    sampler = Scripted("sampler0", rollouts=[])  # its streams wait for groups that never come
    pool, pacer = paced_pool(sampler, n=16, max_staleness=max_staleness, batch=16, streams=streams)
    try:
        await pool._reconcile(0)  # starts the pump
        for _ in range(100):  # the pump asks for each batch's credit in turn: a few steps of the loop each
            await asyncio.sleep(0)
        # Both batches begin at once with max_staleness 2 (room 16 x 3 - 16 for the batch of step 1).
        assert sampler.streams == [16] * max_staleness and pacer.streams == max_staleness
        assert pacer.in_flight == 16 * max_staleness and pacer.take_peaks() == (max_staleness, 16 * max_staleness)
    finally:
        await pool.close()
    assert pacer.in_flight == 0 and pacer.streams == 0  # the close gave every grant back


@pytest.mark.parametrize("streams", [2, 4])
async def test_one_sampler_s_streams_lose_no_group_to_staleness(streams):
    """The pacer's invariant with several streams: one sampler, no losses, every group trained.
    Every other batch takes 10x longer, so a batch begun after a sync often ends before the one
    begun under the older weights and is queued first (groups queue in the order they are done).
    None expires: staleness counts from when a group was done, and the pacer let begin only what
    the steps to come take. (With 4 streams, 36 groups once expired until the pacer heard of a
    taken batch in the same step of the loop as the queue gave it out: a stream waking on the
    emptied queue in between was granted credit counted against the step before.)"""
    sampler = Engine("sampler0", durations=[0.002, 0.02])
    pool, pacer = paced_pool(sampler, n=4, max_staleness=2, batch=2, streams=streams)
    peak = 0
    try:
        for step in range(1, 31):
            batch = await asyncio.wait_for(pool.next_batch(4, step - 1), 5.0)
            assert all(step - 1 - g.finished_version <= 2 for g in batch)
            peak = max(peak, pacer.take_peaks()[0])
            await asyncio.sleep(0.005)  # the train step
            sampler.version = step  # the sync
            pool._synced(step)
    finally:
        await pool.close()
    assert peak == streams  # several batches were in flight at once
    assert pool.queue.stats().dropped_stale == 0, pool.queue.stats()


class Lingering(Scripted):
    """A sampler whose rollouts streams end only once ``close_streams`` is set, after their last
    group: a real stream's end is a message of its own, which may come well after that group."""

    def __init__(self, name: str):
        super().__init__(name, rollouts=[])
        self.close_streams = asyncio.Event()

    def _method(self, method: str, timeout_s: float):
        groups = super()._method(method, timeout_s)
        if method != "rollouts":
            return groups

        async def stream(max_groups: int = 0):
            async for group in groups(max_groups):
                yield group
            await self.close_streams.wait()

        return stream


async def test_a_batch_whose_groups_all_came_is_not_in_flight_while_its_stream_closes():
    """The window counts the groups not yet delivered, so the next batch begins as the last group
    of one comes; the batch that delivered it no longer counts as in flight (the CI once saw three
    paced batches of two streams, when a stream's end came late)."""
    sampler = Lingering("sampler0")
    pool, pacer = paced_pool(sampler, n=4, max_staleness=2, batch=1, streams=2)
    try:
        await pool._reconcile(0)
        for _ in range(100):  # the pump asks for each batch's credit in turn: a few steps of the loop each
            await asyncio.sleep(0)
        assert sampler.streams == [1, 1] and pacer.streams == 2 and pacer.in_flight == 2
        sampler.items.put_nowait(rollout(0, 1))  # the first batch's only group; its stream stays open
        for _ in range(100):
            await asyncio.sleep(0)
        assert sampler.streams == [1, 1, 1] and len(pool.queue) == 1  # the next batch began at once
        assert pacer.streams == 2 and pacer.in_flight == 2 and pacer.take_peaks() == (2, 2)
        sampler.close_streams.set()
        for _ in range(100):
            await asyncio.sleep(0)
        assert pacer.streams == 2 and pacer.in_flight == 2  # the closed stream had nothing left to give back
    finally:
        await pool.close()
    assert pacer.in_flight == 0 and pacer.streams == 0  # the close gave every grant back


async def test_a_failed_stream_cancels_its_siblings_and_every_grant_is_given_back():
    sampler = Scripted("sampler0", rollouts=[])
    pool, pacer = paced_pool(sampler, n=8, max_staleness=2, batch=4, streams=3)
    m = pool.members[0]
    try:
        await pool._reconcile(0)
        for _ in range(100):  # the pump asks for each batch's credit in turn: a few steps of the loop each
            await asyncio.sleep(0)
        assert pacer.streams == 3 and pacer.in_flight == 12
        sampler.items.put_nowait(rollout(0, 1))  # the first stream delivers one group
        sampler.items.put_nowait(ActorDiedError("sampler0", "killed by SIGKILL"))  # and the next dies
        await asyncio.wait({m.pump}, timeout=5.0)
        assert m.pump.done() and isinstance(m.pump.exception(), ActorDiedError)
        assert pacer.streams == 0 and pacer.in_flight == 0 and len(pool.queue) == 1  # nothing held back
        pool._reap_pumps()  # the failure judged as a single stream's was: the sampler is lost
        assert not m.in_group and "died (killed by SIGKILL)" in pool.faults[0].cause
    finally:
        await pool.close()


async def test_a_sampler_whose_weights_cannot_be_read_stops_the_weight_check_and_is_not_restarted():
    """``--run.check_weights`` with a sampler that has no digest of its weights (a vLLM engine whose
    loader keeps them in another form): a restart would be refused the same way, so the run stops
    at the first check with one line naming the fix, and the sampler is not killed."""
    refused = "sampler sampler0: no digest of the vLLM model's weights: they are not held as the sent tensors (why)"
    sampler = Scripted(
        "sampler0", weights_digest=[(0.0, remote("sampler0", "weights_digest", WeightsUnreadableError, refused))]
    )
    other = Scripted("sampler1", weights_digest=[(0.0, "abc")])
    logs: list[str] = []
    pool = make_pool(Scripted("trainer", weights_digest=[(0.0, "abc")]), [sampler, other], logs)
    try:
        with pytest.raises(WeightsUncheckableError) as stopped:
            await pool.verify_weights()
        assert str(stopped.value).startswith("--run.check_weights: ") and "\n" not in str(stopped.value)
        assert "sampler0: no digest" in str(stopped.value) and "(why)" in str(stopped.value)
        assert str(stopped.value).endswith(
            "drop --run.check_weights (every sync's own checks still run) or use --sampler.backend hf"
        )
        assert sampler.kills == [] and pool.members[0].state is MemberState.JOINED, logs
        sampler.script["weights_digest"] = [(0.0, "abd")]  # a digest that differs is still the divergence it was
        with pytest.raises(WeightsDivergedError, match="sampler sampler0 holds weights abd"):
            await pool.verify_weights()
    finally:
        await pool.close()
