"""A node agent starts its actors' processes off its loop (issue 52, item 5).

Seen on node 0: ``asyncrl scale RUN --samplers 99`` held the driver's loop 25 s in ``Popen``. A
node agent did the same with the starts placed on its node, and its loop also sends the
heartbeats whose silence for ``node_timeout_s`` (5 s by default) makes node 0 count the node, and
every actor on it, as lost. Here the agent runs in this process with its supervisor socket
replaced by a list; ``Popen`` is held on purpose until the agent's loop has shown it runs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import msgspec

from asyncrl.runtime import process, wire
from asyncrl.runtime.cluster import auth
from asyncrl.runtime.cluster.agent import AgentConfig, NodeAgent
from conftest import process_alive

HELD_S = 15.0
"""How long the held ``Popen`` waits for the agent's loop before it fails the test."""
_SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]  # the worker's stand-in


class _Frame:
    def __init__(self, msg):
        self.buffer = msgspec.msgpack.encode(msg)


class _Agent:
    """A `NodeAgent` as after its join, what it sends kept in ``sent`` (heartbeats decoded)."""

    def __init__(self):
        keys = auth.ClusterKeys.from_secret(auth.new_secret())
        cfg = AgentConfig(
            rank=1,
            nnodes=2,
            master_addr="127.0.0.1",
            master_port=1,
            node_addr="127.0.0.1",
            keys=keys,
            device_kind=None,
            devices=[],
            join_timeout_s=5.0,
            node_timeout_s=5.0,
            heartbeat_interval_s=0.05,
            term_timeout_s=5.0,
        )
        self.agent = agent = NodeAgent(cfg)
        loop = asyncio.get_running_loop()
        agent._welcome, agent._done = loop.create_future(), loop.create_future()
        agent._death_r, self._death_w = os.pipe()
        self.sent: list = []
        self.changed = asyncio.Event()
        self.beat = threading.Event()
        agent.send = self._send

    def _send(self, msg) -> None:
        if isinstance(msg, bytes):  # the only pre-encoded message: the heartbeat
            msg = msgspec.msgpack.decode(msg, type=wire.NodeHeartbeat)
            self.beat.set()
        self.sent.append(msg)
        self.changed.set()

    def tell(self, msg) -> None:
        self.agent._on_message([_Frame(msg)])

    async def reply(self, kind, timeout_s: float = 30.0):
        """The first message of ``kind`` the agent sent, waiting up to ``timeout_s`` for it."""
        async with asyncio.timeout(timeout_s):
            while True:
                found = [m for m in self.sent if isinstance(m, kind)]
                if found:
                    return found[0]
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        self.agent._finish(0, "test over")
        await self.agent._stop_all()
        for t in [*self.agent._tasks, *self.agent._starting.values()]:
            t.cancel()
        os.close(self.agent._death_r)
        os.close(self._death_w)


def _spawn_msg(actor: str) -> wire.SpawnActor:
    return wire.SpawnActor(actor, 0, [], {}, "tcp://127.0.0.1:1", 30.0)


class _HeldPopen:
    """``Popen`` made to return only once ``until`` is set (else it fails, naming ``what``), and to
    start a sleeper instead of a worker: ``made`` holds the processes it made; ``entered`` is set
    when it is called, ``returned`` when it returns."""

    def __init__(self, monkeypatch, until: threading.Event, what: str):
        self.until, self.what, self.real = until, what, subprocess.Popen
        self.made: list[subprocess.Popen] = []
        self.entered, self.returned = threading.Event(), threading.Event()
        monkeypatch.setattr(process.subprocess, "Popen", self)

    def __call__(self, argv, **kwargs) -> subprocess.Popen:
        self.entered.set()
        assert self.until.wait(HELD_S), f"{self.what} within {HELD_S:g} s"
        self.made.append(self.real(_SLEEPER, **kwargs))
        self.returned.set()
        return self.made[-1]


async def test_an_agent_beats_while_it_starts_an_actors_process(monkeypatch):
    """``Popen`` returns only once the agent has sent a heartbeat after the start began: on the
    loop (before) it held the heartbeats and failed here after 15 s."""
    a = _Agent()
    made = _HeldPopen(monkeypatch, a.beat, "the agent sent no heartbeat while a process was started").made
    try:
        a.tell(_spawn_msg("sampler5"))
        a.beat.clear()
        a.agent._spawn_task(a.agent._beat())
        started = await a.reply(wire.ActorStarted)
        assert (started.actor, started.pid) == ("sampler5", made[0].pid) and process_alive(started.pid)
        a.tell(wire.StopActor("sampler5", 0, 5.0))
        exited = await a.reply(wire.ActorExited)
        assert exited.actor == "sampler5" and "SIGTERM" in exited.reason, exited
        assert not process_alive(made[0].pid)
    finally:
        await a.close()


async def test_a_stop_while_an_actors_process_is_being_started_kills_it_and_says_so(monkeypatch):
    """A stop that arrives while ``Popen`` runs is answered at once (the supervisor's stop waits
    for the exit), and the process ``Popen`` then returns is killed, never reported started."""
    a = _Agent()
    release = threading.Event()
    held = _HeldPopen(monkeypatch, release, "the test did not release Popen (the agent's loop was held)")
    try:
        a.tell(_spawn_msg("sampler6"))
        assert await asyncio.to_thread(held.entered.wait, 30.0), "the agent did not call Popen"
        a.tell(wire.StopActor("sampler6", 0, 5.0))
        exited = await a.reply(wire.ActorExited)
        assert (exited.actor, exited.reason) == ("sampler6", "stopped while its process was being started")
        release.set()
        assert await asyncio.to_thread(held.returned.wait, 30.0), "Popen did not return"
        assert await asyncio.to_thread(held.made[0].wait, 30.0) < 0  # killed by a signal, not ended
        assert not [m for m in a.sent if isinstance(m, wire.ActorStarted)]
        assert not a.agent._children and not a.agent._starting
    finally:
        release.set()
        await a.close()


async def test_an_agent_stopping_waits_for_the_starts_under_way_and_stops_their_processes(monkeypatch):
    """The agent's end (`_stop_all`) lets a start under way finish, then stops its process too,
    so none outlives the agent's report of its exits."""
    a = _Agent()
    release = threading.Event()
    made = _HeldPopen(monkeypatch, release, "the test did not release Popen").made
    try:
        a.tell(_spawn_msg("sampler7"))
        stopping = asyncio.ensure_future(a.agent._stop_all())
        await asyncio.sleep(0)  # _stop_all is waiting on the start
        assert not stopping.done()
        release.set()
        await asyncio.wait_for(stopping, 30.0)
        started, exited = await a.reply(wire.ActorStarted), await a.reply(wire.ActorExited)
        assert started.pid == made[0].pid and exited.actor == "sampler7"
        assert not process_alive(made[0].pid)
    finally:
        release.set()
        await a.close()


async def test_a_stop_before_an_actors_start_ran_starts_no_process(monkeypatch):
    """A spawn and its stop handled in one turn of the loop: the start is cancelled before it
    calls ``Popen``; the exit is reported and no process is made."""
    a = _Agent()
    held = _HeldPopen(monkeypatch, threading.Event(), "Popen was called for a start already stopped")
    try:
        a.tell(_spawn_msg("sampler8"))
        a.tell(wire.StopActor("sampler8", 0, 5.0))
        exited = await a.reply(wire.ActorExited)
        assert (exited.actor, exited.reason) == ("sampler8", "stopped while its process was being started")
        await a.agent._stop_all()  # would wait on the start, were it still under way
        assert not held.entered.is_set() and not a.agent._starting and not a.agent._children
    finally:
        await a.close()
