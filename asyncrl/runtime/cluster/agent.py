"""The node agent: ``asyncrl launch --node-rank R`` (R > 0) runs one on every node but node 0.

It connects to the supervisor's cluster socket (CURVE, with the cluster secret), joins with
``NodeHello`` (rank, host, the address peers reach it at, devices), then does what the supervisor
asks: start a worker process per ``SpawnActor``, off its loop (the worker then talks to the
supervisor itself), SIGTERM/SIGKILL it on ``StopActor``/``KillActor``, and report
``ActorStarted``/``ActorExited``. Where the supervisor has a ``zygote_preload`` (a GRPO run's launch
sets one) and this node has no accelerator, the agent starts a zygote of its own once it has
joined and forks each actor from it, as node 0 does (``runtime/zygotes/zygote.py``); otherwise,
and for an actor the zygote cannot start, by ``Popen``.
The workers' output is forwarded as ``ActorLog`` lines. It beats every ``heartbeat_interval_s``.

It ends, stopping every actor it started first, when:
* the supervisor says ``NodeShutdown`` (exit 0);
* its connection to the supervisor has been down for ``node_timeout_s`` (exit 1): the supervisor
  vanished, or the network did. ZeroMQ heartbeats (answered by libzmq's own thread, so a busy
  supervisor loop is not mistaken for death) turn a silent peer into a disconnection;
* it receives SIGINT/SIGTERM (exit 128 + signal); in an elastic cluster (``drain_timeout_s``) it
  first says `NodeDraining` and waits (bounded) for the actors it runs to be stopped by their
  owner, starting no new one, so a GRPO run drains its samplers before the node goes; a second
  signal, or no actor left, ends the wait;
* it could not join within ``join_timeout_s``, or was refused (exit 1).
If the agent itself dies, its workers follow it (``PR_SET_PDEATHSIG`` and the death pipe), and so
does its zygote, with the actors it forked.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from asyncrl.runtime import net, wire
from asyncrl.runtime import worker as worker_env
from asyncrl.runtime.cluster.auth import ENV_SECRET, ClusterKeys, keys_from_env
from asyncrl.runtime.config import SupervisorConfig
from asyncrl.runtime.devices import VISIBILITY_VARIABLE, detect, offered
from asyncrl.runtime.loop import run as run_loop
from asyncrl.runtime.process import ChildProcess, LogSink
from asyncrl.runtime.transport import LoopSocket, configure
from asyncrl.runtime.zygotes.zygote import ENV_PRELOAD, Zygote, ZygoteUnavailable, usable

_LOG_LINES_PER_MESSAGE = 256
_LOG_BACKLOG_MAX = 64
"""Log messages may wait behind a slow supervisor only this deep; beyond it lines are dropped
(and counted), so output can never delay a heartbeat or an exit report for long."""
_WATCHED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    rank: int
    nnodes: int
    master_addr: str
    master_port: int
    node_addr: str
    keys: ClusterKeys
    device_kind: str | None
    devices: list[str]
    join_timeout_s: float
    node_timeout_s: float
    heartbeat_interval_s: float
    term_timeout_s: float
    drain_timeout_s: float = 0.0
    """Elastic clusters only (0: none): see `NodeDraining`."""


class NodeAgent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.agent_id = secrets.token_hex(8)
        self.endpoint = net.tcp_endpoint(net.resolve(cfg.master_addr), cfg.master_port)
        self.node_timeout_s = cfg.node_timeout_s
        self.heartbeat_interval_s = cfg.heartbeat_interval_s
        self._children: dict[tuple[str, int], ChildProcess] = {}
        self._starting: dict[tuple[str, int], asyncio.Task] = {}  # Popen on a thread, or a fork, under way
        self._reporters: dict[tuple[str, int], asyncio.Task] = {}
        self._zygote: Zygote | None = None  # closed when the agent ends
        self._forker: Zygote | None = None  # where actors are forked from while it works; None: Popen
        self._zygote_decided: asyncio.Future | None = None  # pending while `run` joins (and starts it)
        self._tasks: set[asyncio.Task] = set()
        self._body = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(wire.ToAgent)
        self._down_timer: asyncio.TimerHandle | None = None
        self._told_handshake = False
        self._draining = False
        self.dropped_log_lines = 0

    def say(self, text: str) -> None:
        print(f"asyncrl agent (node {self.cfg.rank} of {self.cfg.nnodes}): {text}", file=sys.stderr, flush=True)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._welcome: asyncio.Future = loop.create_future()
        self._done: asyncio.Future = loop.create_future()
        self._zygote_decided = loop.create_future()  # a start waits for it (`_fork`)
        self._death_r, death_w = os.pipe()  # only we hold the write end: its EOF tells workers we died
        ctx = zmq.Context()
        sock = configure(ctx.socket(zmq.DEALER), linger_ms=2000)  # linger: NodeLeaving must get out
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a supervisor we are not connected to
        sock.setsockopt(zmq.ROUTING_ID, f"agent-{self.agent_id}".encode())  # stable across reconnects
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_interval_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.node_timeout_s * 1000))
        if "[" in self.endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        self.cfg.keys.secure_client(sock)
        monitor = sock.get_monitor_socket(_WATCHED)
        sock.connect(self.endpoint)
        self.sock = LoopSocket(sock, self._on_message, "node agent")
        self.monitor = LoopSocket(monitor, self._on_event, "node agent monitor")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signalled, sig)
        joined = False
        try:
            joined = await self._join()  # with this node's zygote started, where there is to be one
            self._zygote_decided.set_result(None)
            if joined:
                self._spawn_task(self._beat())
                await asyncio.wait([self._done])
            code, reason = self._done.result() if self._done.done() else (1, "could not join")
            await self._stop_all()
            if joined:
                self.send(wire.NodeLeaving(self.cfg.rank, self.agent_id, reason))
            self.say(f"exiting ({reason})")
            return code
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            for t in [*self._tasks, *self._reporters.values(), *self._starting.values()]:
                t.cancel()
            for proc in self._children.values():
                proc.kill_now()
            if self._zygote is not None:  # after the actors: it is the parent of some
                self._zygote.kill_now()
            sock.disable_monitor()
            self.monitor.close()
            self.sock.close()  # lingers up to 2 s for NodeLeaving
            ctx.term()
            os.close(self._death_r)
            os.close(death_w)

    # --- joining -----------------------------------------------------------------------------

    async def _join(self) -> bool:
        cfg = self.cfg
        hello = self._body.encode(
            wire.NodeHello(
                wire.NODE_PROTOCOL,
                cfg.rank,
                cfg.nnodes,
                self.agent_id,
                socket.gethostname(),
                cfg.node_addr,
                os.getpid(),
                cfg.device_kind or "",
                cfg.devices,
                len(os.sched_getaffinity(0)),
            )
        )
        deadline = time.monotonic() + cfg.join_timeout_s
        while not self._welcome.done() and not self._done.done():
            left = deadline - time.monotonic()
            if left <= 0:
                self._finish(
                    1,
                    f"no supervisor admitted us at {self.endpoint} within join_timeout_s={cfg.join_timeout_s:g} "
                    "(is node 0 running, and is the cluster secret the same everywhere?)",
                )
                return False
            self.sock.try_send([hello])  # repeated until answered; a retried hello is recognised
            await asyncio.wait([self._welcome, self._done], timeout=min(1.0, left), return_when=asyncio.FIRST_COMPLETED)
        if self._done.done():
            return False
        welcome = self._welcome.result()
        self.heartbeat_interval_s, self.node_timeout_s = welcome.heartbeat_interval_s, welcome.node_timeout_s
        self.say(f"joined the cluster at {self.endpoint} as {cfg.node_addr} with {len(cfg.devices)} device(s)")
        if welcome.zygote_preload and usable(len(cfg.devices)):
            # Started here (Popen on a thread), it imports while the supervisor goes on: a fork
            # waits for that (READY_TIMEOUT_S), and a SpawnActor read during this start waits for
            # the start (`_zygote_decided`) rather than go to Popen.
            try:
                self._zygote = self._forker = await Zygote.start(
                    {**os.environ, ENV_PRELOAD: welcome.zygote_preload}, self._death_r
                )
            except OSError as e:
                self.say(f"no zygote ({e}): actors start by Popen")
        return True

    async def _beat(self) -> None:
        beat = self._body.encode(wire.NodeHeartbeat(self.cfg.rank, self.agent_id))
        while True:
            # Never behind more than _LOG_BACKLOG_MAX queued log messages. While we are disconnected
            # it waits in our bounded queue, and node 0's deadline decides what that means.
            self.send(beat)
            await asyncio.sleep(self.heartbeat_interval_s)

    # --- messages ----------------------------------------------------------------------------

    def send(self, msg) -> None:
        self.sock.send([msg if isinstance(msg, bytes) else self._body.encode(msg)], copy=True)

    def _signalled(self, sig: int) -> None:
        reason = f"received {signal.Signals(sig).name}"
        here = len(self._reporters) + len(self._starting)
        if self._draining or not self.cfg.drain_timeout_s or not self._welcome.done() or not here:
            self._finish(128 + sig, reason)  # a second signal, a fixed-size cluster, or nothing to drain
            return
        self._draining = True
        self.say(
            f"{reason}: leaving once the {here} actor(s) here are stopped "
            f"(at most {self.cfg.drain_timeout_s:g} s; a second signal stops them now)"
        )
        self.send(wire.NodeDraining(self.cfg.rank, self.agent_id, reason, self.cfg.drain_timeout_s))
        self._spawn_task(self._drain(128 + sig, reason))

    async def _drain(self, code: int, reason: str) -> None:
        """Wait until every actor here has exited (their owner stops them) or the drain deadline
        passes, then leave as on any signal (the ones still running are stopped then)."""
        deadline = asyncio.get_running_loop().time() + self.cfg.drain_timeout_s
        while (self._reporters or self._starting) and not self._done.done():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                self.say(
                    f"{len(self._reporters) + len(self._starting)} actor(s) still running after "
                    f"{self.cfg.drain_timeout_s:g} s; stopping them"
                )
                break
            await asyncio.wait([*self._reporters.values(), *self._starting.values()], timeout=remaining)
        self._finish(code, reason)

    def _finish(self, code: int, reason: str) -> None:
        if not self._done.done():
            self._done.set_result((code, reason))

    def _on_message(self, frames: list) -> None:
        try:
            msg = self._decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.say(f"dropped an undecodable message from the supervisor ({e})")
            return
        if isinstance(msg, wire.NodeWelcome):
            if not self._welcome.done():
                self._welcome.set_result(msg)
        elif isinstance(msg, wire.NodeRejected):
            self._finish(1, f"the supervisor refused this node: {msg.reason}")
        elif isinstance(msg, wire.NodeShutdown):
            self._finish(0, f"the supervisor asked: {msg.reason}")
        elif isinstance(msg, wire.SpawnActor):
            self._spawn(msg)
        else:
            proc = self._children.get((msg.actor, msg.incarnation))
            if proc is None:
                self._stop_starting(msg.actor, msg.incarnation)
                return
            if isinstance(msg, wire.KillActor):
                proc.kill_now()
            else:  # StopActor
                self._spawn_task(proc.terminate(msg.term_timeout_s, kill_timeout_s=5.0))

    def _on_event(self, frames: list) -> None:
        try:
            event = parse_monitor_message([f.bytes for f in frames])["event"]
        except Exception:
            return
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self._down_timer is not None:
                self._down_timer.cancel()
                self._down_timer = None
                self.say("connection to the supervisor is back")
        elif event == zmq.EVENT_DISCONNECTED:
            if self._welcome.done() and self._down_timer is None and not self._done.done():
                self.say(
                    f"connection to the supervisor lost; stopping in {self.node_timeout_s:g} s unless it comes back"
                )
                self._down_timer = asyncio.get_running_loop().call_later(
                    self.node_timeout_s,
                    self._finish,
                    1,
                    f"the supervisor at {self.endpoint} was unreachable for {self.node_timeout_s:g} s",
                )
        elif not self._told_handshake:  # a failed handshake: usually a different secret
            self._told_handshake = True
            self.say(f"the handshake with {self.endpoint} failed: is the cluster secret the same as on node 0?")

    # --- actor processes ---------------------------------------------------------------------

    def _spawn(self, msg: wire.SpawnActor) -> None:
        key = (msg.actor, msg.incarnation)
        if key in self._children or key in self._starting:
            return
        if self._done.done() or self._draining:  # answered, so the supervisor's start does not wait for nothing
            self.send(wire.ActorExited(msg.actor, msg.incarnation, "not started: the node agent is stopping"))
            return
        task = self._starting[key] = asyncio.ensure_future(self._start(key, self._actor_env(msg)))
        task.add_done_callback(lambda _t: self._starting.pop(key, None))

    def _actor_env(self, msg: wire.SpawnActor) -> dict[str, str]:
        cfg = self.cfg
        visibility = {VISIBILITY_VARIABLE[cfg.device_kind]: ",".join(msg.devices)} if cfg.device_kind else {}
        return {
            **os.environ,
            net.ENV_NODE_ADDR: cfg.node_addr,
            net.ENV_NODE_RANK: str(cfg.rank),
            net.ENV_NNODES: str(cfg.nnodes),
            **visibility,
            **msg.env,
            "PYTHONUNBUFFERED": "1",
            worker_env.ENV_NAME: msg.actor,
            worker_env.ENV_INCARNATION: str(msg.incarnation),
            worker_env.ENV_SUPERVISOR: msg.supervisor_address,
            worker_env.ENV_PARENT_PID: str(os.getpid()),
            worker_env.ENV_DEATH_FD: str(self._death_r),
            worker_env.ENV_INIT_TIMEOUT: str(msg.init_timeout_s),
            ENV_SECRET: cfg.keys.secret,
        }

    async def _start(self, key: tuple[str, int], env: dict[str, str]) -> None:
        """Start an actor's process: forked by the zygote, or with ``Popen`` on a thread
        (`ChildProcess.start`): a burst of starts here (a scale-up placing its samplers on this
        node) held this loop, and with it the heartbeats whose silence for ``node_timeout_s`` (5 s
        by default) makes node 0 count this node, and every actor on it, as lost."""
        actor, incarnation = key
        prefix, sink = f"[{actor}]: ", functools.partial(self._forward, actor, incarnation)
        try:
            proc = await self._fork(actor, env, prefix, sink)
            if proc is None:
                proc = await ChildProcess.start(
                    [sys.executable, "-c", "from asyncrl.runtime.worker import main; main()"],
                    env,
                    prefix,
                    pass_fds=[self._death_r],
                    sink=sink,
                )
        except OSError as e:
            self.send(wire.ActorExited(actor, incarnation, f"could not be started: {e}"))
            return
        self._children[key] = proc
        self.send(wire.ActorStarted(actor, incarnation, proc.pid))
        reporter = self._reporters[key] = asyncio.ensure_future(self._report_exit(key, proc))
        reporter.add_done_callback(lambda _t: self._reporters.pop(key, None))

    async def _fork(self, actor: str, env: dict[str, str], prefix: str, sink: LogSink) -> ChildProcess | None:
        """The actor's process forked by the zygote, or None where it is to start by ``Popen``: no
        zygote here, or (said in the agent's output) the zygote failed or the actor's environment
        differs from its own where that matters (`Zygote.unsuitable`)."""
        if self._zygote_decided is not None:  # a start read while the zygote's own start ran waits
            await asyncio.shield(self._zygote_decided)
        zygote = self._forker
        if zygote is None or not zygote.alive:
            return None
        unsuitable = zygote.unsuitable(env)
        if unsuitable:
            self.say(f"actor {actor} starts by Popen: {unsuitable}")
            return None
        try:  # its parent is the zygote: that is whose death it watches
            return await zygote.spawn(
                {**env, worker_env.ENV_PARENT_PID: str(zygote.pid)}, prefix, pass_fds=[self._death_r], sink=sink
            )
        except ZygoteUnavailable as e:
            self._forker = None  # from now on by Popen; the agent still closes it
            self.say(f"actor {actor} starts by Popen, as will every later one: {e}")
            return None

    def _stop_starting(self, actor: str, incarnation: int) -> None:
        """A stop or kill for an actor whose start is under way: the start is cancelled, which
        kills the process once ``Popen`` returns (`ChildProcess.start`) or the zygote answers
        (`Zygote.spawn`), and the exit is reported now, as the supervisor's stop waits for it."""
        start = self._starting.pop((actor, incarnation), None)
        if start is not None:
            start.cancel()
            self.send(wire.ActorExited(actor, incarnation, "stopped while its process was being started"))

    async def _report_exit(self, key: tuple[str, int], proc: ChildProcess) -> None:
        await proc.exited
        self.send(wire.ActorExited(key[0], key[1], proc.exit_description()))
        await proc.terminate(self.cfg.term_timeout_s, kill_timeout_s=5.0)  # sweeps its group, drains logs
        self._children.pop(key, None)

    def _forward(self, actor: str, incarnation: int, stream: int, lines: list[bytes]) -> None:
        if self.sock.backlog > _LOG_BACKLOG_MAX:
            self.dropped_log_lines += len(lines)
            return
        if self.dropped_log_lines:
            lines = [
                f"(asyncrl agent: {self.dropped_log_lines} line(s) of actor output dropped: the supervisor "
                "read too slowly)".encode(),
                *lines,
            ]
            self.dropped_log_lines = 0
        text = [line.decode("utf-8", "replace") for line in lines]
        for i in range(0, len(text), _LOG_LINES_PER_MESSAGE):
            self.send(wire.ActorLog(actor, incarnation, stream, text[i : i + _LOG_LINES_PER_MESSAGE]))

    async def _stop_all(self) -> None:
        """SIGTERM then SIGKILL every actor's process group; wait for their exits to be reported.
        Starts under way are let finish first (bounded), so that their processes are stopped too."""
        if self._starting:
            await asyncio.wait(list(self._starting.values()), timeout=self.cfg.term_timeout_s)
        procs = list(self._children.values())
        if procs:
            await asyncio.gather(*(p.terminate(self.cfg.term_timeout_s, kill_timeout_s=5.0) for p in procs))
        if self._reporters:  # their ActorExited reports go out before our NodeLeaving
            await asyncio.wait(list(self._reporters.values()), timeout=self.cfg.term_timeout_s + 6.0)
        if self._zygote is not None:  # after the actors: it is the parent of some
            await self._zygote.close()

    def _spawn_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def run_agent(rank: int, node_addr: str | None, config: SupervisorConfig) -> int:
    """The body of ``asyncrl launch --node-rank R`` for R > 0; returns the exit code."""
    keys = keys_from_env()
    if keys is None:
        raise ValueError("a node agent needs the cluster secret")
    kind, ids = detect(config.device_kind)
    try:
        address = node_addr or os.environ.get(net.ENV_NODE_ADDR) or net.reachable_address(config.master_addr)
        agent = NodeAgent(
            AgentConfig(
                rank=rank,
                nnodes=config.nnodes,
                master_addr=config.master_addr,
                master_port=config.master_port,
                node_addr=address,
                keys=keys,
                device_kind=kind,
                devices=offered(ids, config.nproc_per_node),
                join_timeout_s=config.join_timeout_s,
                node_timeout_s=config.node_timeout_s,
                heartbeat_interval_s=config.heartbeat_interval_s,
                term_timeout_s=config.term_timeout_s,
                drain_timeout_s=config.drain_timeout_s if 0 < config.min_nnodes < config.nnodes else 0.0,
            )
        )
    except (OSError, ValueError) as e:
        print(f"asyncrl agent (node {rank}): {e}", file=sys.stderr)
        return 1
    return run_loop(agent.run())
