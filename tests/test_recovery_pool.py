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
import gc
import os
import signal
import time
from types import SimpleNamespace

import pytest

from asyncrl import ActorState, Supervisor
from asyncrl.comm.errors import CollectiveError, CollectiveTimeoutError
from asyncrl.comm.weights import SyncStats
from asyncrl.errors import ActorDiedError, CallTimeoutError, RemoteError, remote_error_class, type_path
from asyncrl.rl.config.run import DeadlineConfig, RecoveryConfig, RunConfig
from asyncrl.rl.driver import sync_group
from asyncrl.rl.driver.faults import NoSamplersError, TaskFailedError
from asyncrl.rl.driver.membership import MemberState
from asyncrl.rl.driver.pool import SamplerPool
from asyncrl.rl.driver.queue import RolloutQueue
from asyncrl.rl.sampler.backend import SamplerSyncStats
from asyncrl.rl.sampler.errors import SamplerTimeoutError
from asyncrl.rl.tasks.scoring import TaskFailureError

from actors import Echo

pytestmark = pytest.mark.timeout(60)
SENT = SyncStats(1, 100, 1, 0.01)  # a successful sync's answers
GOT = SamplerSyncStats(seconds=0.01, receive=SENT)


class Scripted:
    """Stands in for an `ActorHandle`: each method answers with the next entry of its script,
    ``(delay_s, value or exception)`` (the last entry repeats), after that delay, within the
    call's deadline (else `CallTimeoutError`, as a real call). A `kill` is recorded in ``kills``
    and changes nothing (the process it would kill is not there)."""

    def __init__(self, name: str, **script: list[tuple[float, object]]):
        self.name = name
        self.script = {k: list(v) for k, v in script.items()}
        self.state, self.incarnation, self.restarts, self.max_restarts = "running", 1, 0, 3
        self.calls: list[str] = []
        self.kills: list[tuple[str, int | None]] = []  # (reason, incarnation) of each kill asked for
        self.items: asyncio.Queue = asyncio.Queue()  # what a rollouts stream yields next
        self._changed = asyncio.Event()

    def info(self) -> SimpleNamespace:
        return SimpleNamespace(state=ActorState(self.state), incarnation=self.incarnation,
                               restarts=self.restarts, max_restarts=self.max_restarts)

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

    def with_timeout(self, timeout_s: float) -> SimpleNamespace:
        return SimpleNamespace(**{method: self._method(method, timeout_s) for method in self.script})

    def _method(self, method: str, timeout_s: float):
        if method == "rollouts":
            async def stream(*args):  # as `ActorClient.stream`: the next item, or the error of a death
                self.calls.append(method)
                while True:
                    item = await asyncio.wait_for(self.items.get(), timeout_s)
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
    return remote(actor, method, CollectiveError,
                  "group 'weights/g0' rank 1/3 (gloo): broadcast from rank 0 failed, a peer died")


def run_config(restart_timeout_s: float = 30.0) -> RunConfig:
    deadlines = DeadlineConfig(sync_timeout_s=2.0, rendezvous_timeout_s=2.0, generate_timeout_s=5.0,
                               queue_timeout_s=10.0, train_timeout_s=5.0, checkpoint_timeout_s=5.0, eval_timeout_s=5.0)
    return RunConfig(mode="async", deadlines=deadlines,
                     recovery=RecoveryConfig(restart_timeout_s=restart_timeout_s, sampler_max_restarts=3))


def make_pool(trainer, samplers, logs: list[str], **run) -> SamplerPool:
    pool = SamplerPool(trainer, samplers, RolloutQueue(8, 4), run=run_config(**run), seeds=[0] * len(samplers),
                       host="127.0.0.1", backend="gloo", log=logs.append)
    for m in pool.members:  # as after a successful start: in the group, incarnation 1
        m.state, m.incarnation = MemberState.JOINED, 1
    pool.sync_group.generation, pool.membership.dirty = 0, False
    return pool


def trainer_script(first_send: object) -> Scripted:
    return Scripted("trainer", send_weights=[(0.0, first_send), (0.0, SENT)], sync_listen=[(0.0, 1234)],
                    sync_join=[(0.0, "gloo")], setup_sender=[(0.0, 1)])


async def test_a_survivor_whose_collective_error_comes_late_is_not_judged_frozen(monkeypatch):
    # The grace is short here so that the survivor's answer (1 s) comes well after it ended, as on
    # a loaded machine, yet well within the survivor's own deadline (sync_timeout_s 2 s + grace).
    monkeypatch.setattr(sync_group, "SYNC_GRACE_S", 0.5)
    trainer = trainer_script(collective_error("trainer", "send_weights"))  # a peer died: the trainer fails at once
    dead = Scripted("sampler0", receive_weights=[(0.0, ActorDiedError("sampler0", "killed by SIGKILL"))])
    slow = Scripted("sampler1", receive_weights=[(1.0, collective_error("sampler1", "receive_weights")), (0.0, GOT)],
                    stats=[(0.0, {})], sync_join=[(0.0, "gloo")], setup_receiver=[(0.0, 1)])
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
    ok = dict(stats=[(0.0, {})], sync_join=[(0.0, "gloo")], setup_receiver=[(0.0, 1)], restore_data_state=[(0.0, None)])
    dies = Scripted("sampler0", receive_weights=[(0.0, ActorDiedError("sampler0", "killed by SIGKILL")), (0.0, GOT)], **ok)
    slow = Scripted("sampler1", receive_weights=[(1.0, collective_error("sampler1", "receive_weights")), (0.0, GOT)], **ok)
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
    steady = Scripted("sampler1", receive_weights=[(0.1, collective_error("sampler1", "receive_weights")), (0.0, GOT)],
                      stats=[(0.0, {})], sync_join=[(0.0, "gloo")], setup_receiver=[(0.0, 1)])
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
    sampler = Scripted("sampler0", stats=[(0.0, {})])
    other = Scripted("sampler1", stats=[(0.0, {})])
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
            pool._pump_failed(task_fails, remote("sampler0", "rollouts", TaskFailureError, "9 of 10 score calls raised"))
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
    ok = dict(stats=[(0.0, {})], sync_join=[(0.0, "gloo")], setup_receiver=[(0.0, 1)], receive_weights=[(0.0, GOT)])
    never = Scripted("sampler0", **ok)
    never.set_state("dead")  # its start was lost, its restarts with it (sampler_start.py)
    died = Scripted("sampler1", restore_data_state=[(0.0, ActorDiedError("sampler1", "killed by SIGKILL"))], **ok)
    up = Scripted("sampler2", restore_data_state=[(0.0, None)], **ok)
    logs: list[str] = []
    pool = SamplerPool(trainer_script(SENT), [never, died, up], RolloutQueue(8, 4), run=run_config(), seeds=[0, 1, 2],
                       host="127.0.0.1", backend="gloo", log=logs.append)
    try:
        await pool.start(0, [])
    finally:
        await pool.close()
    assert [m.state for m in pool.members] == [MemberState.GONE, MemberState.LOST, MemberState.JOINED], logs
    assert never.calls == [] and pool.progress()["samplers"]["sampler0"] == "gone"
    (fault,) = pool.faults
    assert fault.sampler == "sampler1" and "failed to take its data position" in fault.cause, fault
    assert pool.generation == 0 and up.calls.count("receive_weights") == 1, logs


async def test_the_start_stops_when_every_sampler_is_gone():
    never = Scripted("sampler0")
    never.set_state("dead")
    pool = SamplerPool(trainer_script(SENT), [never], RolloutQueue(8, 4), run=run_config(), seeds=[0],
                       host="127.0.0.1", backend="gloo")
    try:
        with pytest.raises(NoSamplersError, match="no sampler could join the weight-sync group at the start"):
            await pool.start(0, [])
    finally:
        await pool.close()
