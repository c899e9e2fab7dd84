"""The supervisor's side of a multi-node cluster: the cluster socket, node agents, remote processes.

Node 0's supervisor binds one CURVE-guarded ROUTER at ``master_addr:master_port``. Each node agent
connects to it, says ``NodeHello`` (its rank, host, address, devices) and gets ``NodeWelcome`` or
``NodeRejected``. Workers that agents start connect to the same socket for their ``Hello``/``Init``
conversation, which the supervisor handles exactly as for local workers. An actor process on
another node is represented here by a ``RemoteProcess``, which offers the supervisor what a local
``ChildProcess`` does (an ``exited`` future, ``terminate``, ``kill_now``), backed by messages to
and from the agent.

A node of an elastic cluster whose agent is told to stop first says it is *draining*
(``NodeDraining``): it takes no new actor, and its actors' owners stop them (the GRPO driver
drains its samplers there) until the agent leaves, at most ``drain_timeout_s`` later.

A node is lost when its agent says it is leaving or has been silent for ``node_timeout_s``
(agents beat every ``heartbeat_interval_s``). Every actor process of a lost node then counts as
exited, which fails its pending calls with ``ActorDiedError``. A lost node never rejoins: an agent
that reappears is told to shut down, so no actor outlives the supervisor's view of it. The agent,
for its part, stops its actors once its connection to us has been down for ``node_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import zmq

from asyncrl.errors import ClusterStartError
from asyncrl.runtime import wire
from asyncrl.runtime.cluster.auth import Gatekeeper
from asyncrl.runtime.config import SupervisorConfig
from asyncrl.runtime.devices import DevicePool
from asyncrl.runtime.net import is_wildcard, resolve, tcp_endpoint
from asyncrl.runtime.process import ActorProcess
from asyncrl.runtime.timeouts import timeout
from asyncrl.runtime.transport import LoopSocket, bind_router
from asyncrl.runtime.watchdog import SilenceWatchdog

log = logging.getLogger("asyncrl.cluster")

_WORKER_MESSAGES = (wire.Hello, wire.Ready, wire.StartFailed, wire.Heartbeat, wire.StartPhase, wire.Dead)
_LOGGED_BAD_MESSAGES = 5


class NodeStatus(msgspec.Struct, frozen=True):
    rank: int
    hostname: str
    address: str
    devices_free: int
    devices_total: int
    state: str
    """'joined', 'draining: <reason>' (it is leaving: it takes no new actor), or 'lost: <reason>'."""
    cores: int = 0
    """The CPU cores its actors may run on, as its agent reported them (0: not reported)."""

    @property
    def joined(self) -> bool:
        """It is up and takes new actors."""
        return self.state == "joined"

    @property
    def draining(self) -> bool:
        """It is leaving: its actors run on, it takes no new one."""
        return self.state.startswith("draining")


class RemoteProcess(ActorProcess):
    """An actor's process on another node, as its agent reports it."""

    def __init__(self, node: Node, actor: str, incarnation: int):
        self.node = node
        self.actor = actor
        self.incarnation = incarnation
        self.pid = 0  # the remote pid, once the agent has reported it
        self.exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self._reason = ""

    def exit_description(self) -> str:
        return self._reason

    def set_exited(self, reason: str) -> None:
        if not self.exited.done():
            self._reason = reason
            self.exited.set_result(None)

    async def terminate(self, term_timeout_s: float, kill_timeout_s: float) -> None:
        """SIGTERM, then SIGKILL, to the process group, by the agent. Returns once the agent
        reports the exit, the node is lost, or the escalation's time is up."""
        if self.alive:
            self.node.send(wire.StopActor(self.actor, self.incarnation, term_timeout_s))
            await self.wait(term_timeout_s + kill_timeout_s)

    def kill_now(self) -> None:
        """SIGKILL to the process group, by the agent (asynchronously: the exit is reported)."""
        if self.alive:
            self.node.send(wire.KillActor(self.actor, self.incarnation))


class Node:
    def __init__(self, cluster: Cluster, hello: wire.NodeHello, route: bytes):
        self.cluster = cluster
        self.rank = hello.rank
        self.hostname = hello.hostname
        self.address = hello.address
        self.pid = hello.pid
        self.agent_id = hello.agent_id
        self.route = route
        self.pool = DevicePool(hello.device_kind or None, hello.devices, where=f"node {hello.rank} ({hello.hostname})")
        self.cores = hello.cores
        self.last_seen = time.monotonic()
        self.procs: dict[tuple[str, int], RemoteProcess] = {}
        self.lost: str | None = None
        self.draining: str | None = None  # why it is leaving, once its agent said so
        self.gone = asyncio.get_running_loop().create_future()

    def send(self, msg) -> None:
        if self.lost is None:
            self.cluster.send(self.route, msg)

    def status(self) -> NodeStatus:
        state = (
            f"lost: {self.lost}"
            if self.lost is not None
            else f"draining: {self.draining}"
            if self.draining is not None
            else "joined"
        )
        return NodeStatus(
            self.rank, self.hostname, self.address, len(self.pool.free), self.pool.total, state, self.cores
        )


class Cluster:
    def __init__(
        self,
        ctx: zmq.Context,
        config: SupervisorConfig,
        gate: Gatekeeper,
        on_worker: Callable[[object, bytes, LoopSocket], None],
        on_log: Callable[[wire.ActorLog], None],
    ):
        self.config = config
        host = resolve(config.master_addr)
        if is_wildcard(host):
            raise ValueError(
                f"master_addr {config.master_addr!r} is a wildcard; give the address the other nodes reach"
            )
        sock, self.address = bind_router(ctx, tcp_endpoint(host, config.master_port), gate=gate)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an agent that reconnects keeps its routing id
        self.host = host
        self.nodes: dict[int, Node] = {}
        self._by_route: dict[bytes, Node] = {}
        self._on_worker = on_worker
        self._on_log = on_log
        self._closing = False
        self._bad_messages = 0
        self._all_joined = asyncio.Event()
        self._decoder = msgspec.msgpack.Decoder(wire.FromNode)
        self._body = msgspec.msgpack.Encoder()
        self.sock = LoopSocket(sock, self._on_message, "supervisor cluster socket")
        self._watchdog = SilenceWatchdog(
            "cluster",
            config.heartbeat_interval_s,
            config.node_timeout_s,
            lambda: [(node, node.last_seen) for node in self.nodes.values() if node.lost is None],
            self._silent,
        ).start()

    # --- membership --------------------------------------------------------------------------

    async def wait_for_nodes(self, timeout_s: float) -> None:
        """Return once every rank 1..nnodes-1 has joined (or, in an elastic cluster, ``min_nnodes``
        nodes in all, whichever ranks: the others may join later); ``ClusterStartError`` naming the
        missing ones after ``timeout_s``."""
        n = self.config.nnodes
        if len(self.nodes) >= self._needed() - 1:
            return  # --nnodes 1:N: node 0 alone is enough (no join would ever say so)
        try:
            async with timeout(timeout_s):  # wait_for on 3.11 can swallow a cancel
                await self._all_joined.wait()
        except TimeoutError:
            missing = [r for r in range(1, n) if r not in self.nodes]
            joined = ", ".join(str(r) for r in [0, *sorted(self.nodes)])
            if self._needed() < n:  # elastic: any of the missing ranks would do
                raise ClusterStartError(
                    f"{len(self.nodes) + 1} of the {self._needed()} nodes needed (--nnodes {self._needed()}:{n}) "
                    f"joined the cluster at {self.address} within {timeout_s:g} s (joined: {joined}); start "
                    f"`asyncrl launch --nnodes {self._needed()}:{n} --node-rank R ...` with R in "
                    f"{', '.join(map(str, missing))} on {self._needed() - 1 - len(self.nodes)} more node(s)",
                    missing,
                ) from None
            raise ClusterStartError(
                f"node(s) {', '.join(map(str, missing))} of {n} did not join the cluster at {self.address} within "
                f"{timeout_s:g} s (joined: {joined}); run `asyncrl launch --nnodes {n} --node-rank R "
                f"--master-addr {self.config.master_addr} --master-port {self.config.master_port} ...` "
                "on each missing node, with the same cluster secret",
                missing,
            ) from None

    def live(self) -> dict[int, Node]:
        return {r: node for r, node in self.nodes.items() if node.lost is None}

    def open(self) -> dict[int, Node]:
        """The live nodes that take new actors (not draining)."""
        return {r: node for r, node in self.live().items() if node.draining is None}

    def spawn(self, rank: int, msg: wire.SpawnActor) -> RemoteProcess:
        node = self.nodes.get(rank)
        if node is None or node.lost is not None:
            raise OSError(f"node {rank} is lost ({node.lost if node else 'never joined'})")
        proc = RemoteProcess(node, msg.actor, msg.incarnation)
        node.procs[(msg.actor, msg.incarnation)] = proc
        node.send(msg)
        return proc

    def _lose(self, node: Node, reason: str) -> None:
        if node.lost is not None:
            return
        node.lost = reason
        if self._closing or (node.draining is not None and not node.procs):
            log.info("node %d (%s) left: %s", node.rank, node.hostname, reason)  # as planned: nothing dies
        else:
            log.error(
                "node %d (%s, %s) lost: %s; its %d actor process(es) count as dead",
                node.rank,
                node.hostname,
                node.address,
                reason,
                len(node.procs),
            )
        for proc in node.procs.values():
            proc.set_exited(f"node {node.rank} ({node.hostname}) lost: {reason}")
        node.procs.clear()
        if not node.gone.done():
            node.gone.set_result(None)

    def _silent(self, node: Node, silent_s: float) -> None:
        self._lose(node, f"no heartbeat from its agent for {silent_s:.1f} s (agent dead or network down)")

    async def close(self, reason: str, timeout_s: float) -> None:
        """Tell every agent to stop its actors and exit; wait (bounded) for each to say it left."""
        self._closing = True
        live = list(self.live().values())
        for node in live:
            node.send(wire.NodeShutdown(reason))
        if live:
            await asyncio.wait([n.gone for n in live], timeout=timeout_s)
            for node in live:
                if not node.gone.done():
                    log.warning(
                        "node %d (%s) did not confirm its shutdown within %g s", node.rank, node.hostname, timeout_s
                    )
        self.close_now()

    def close_now(self) -> None:
        """Stop watching the nodes and close the socket, telling no agent (they stop on their
        own once we are unreachable for ``node_timeout_s``). Idempotent."""
        self._watchdog.close()
        self.sock.close()

    def status(self) -> list[NodeStatus]:
        return [self.nodes[r].status() for r in sorted(self.nodes)]

    # --- the socket --------------------------------------------------------------------------

    def send(self, route: bytes, msg) -> None:
        self.sock.send([route, self._body.encode(msg)], copy=True)

    def _on_message(self, frames: list) -> None:
        if len(frames) != 2:
            return self._bad(f"{len(frames)} frames")
        try:
            msg = self._decoder.decode(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._bad(str(e))
        route = frames[0].bytes
        if isinstance(msg, _WORKER_MESSAGES):
            return self._on_worker(msg, route, self.sock)
        if isinstance(msg, wire.NodeHello):
            return self._hello(msg, route)
        node = self._by_route.get(route)
        if node is None or node.lost is not None:
            if not isinstance(msg, wire.NodeLeaving):  # a lost node's agent came back: it must not serve
                self.send(route, wire.NodeShutdown("this node is not (or no longer) part of the cluster"))
            return
        node.last_seen = time.monotonic()
        if isinstance(msg, wire.ActorStarted):
            proc = node.procs.get((msg.actor, msg.incarnation))
            if proc is not None:
                proc.pid = msg.pid
        elif isinstance(msg, wire.ActorExited):
            proc = node.procs.pop((msg.actor, msg.incarnation), None)
            if proc is not None:
                proc.set_exited(f"{msg.reason} on node {node.rank}")
        elif isinstance(msg, wire.ActorLog):
            self._on_log(msg)
        elif isinstance(msg, wire.NodeLeaving):
            self._lose(node, f"its agent left ({msg.reason})")
        elif isinstance(msg, wire.NodeDraining):
            node.draining = msg.reason
            log.warning(
                "node %d (%s) is leaving (%s): it takes no new actor; its %d actor process(es) have %g s to be stopped",
                node.rank,
                node.hostname,
                msg.reason,
                len(node.procs),
                msg.timeout_s,
            )

    def _bad(self, what: str) -> None:
        self._bad_messages += 1
        if self._bad_messages <= _LOGGED_BAD_MESSAGES:
            log.warning("cluster socket: dropped an undecodable message (%s)", what)

    def _hello(self, hello: wire.NodeHello, route: bytes) -> None:
        n = self.config.nnodes
        node = self.nodes.get(hello.rank)
        reason = None
        if hello.protocol != wire.NODE_PROTOCOL:
            reason = (
                f"node protocol {hello.protocol}; this supervisor speaks {wire.NODE_PROTOCOL} "
                "(same asyncrl everywhere?)"
            )
        elif hello.nnodes != n:
            reason = f"the agent says --nnodes {hello.nnodes}; the supervisor runs {n} nodes"
        elif not 1 <= hello.rank < n:
            reason = f"node rank {hello.rank} is not in 1..{n - 1}"
        elif node is not None and node.agent_id != hello.agent_id:
            reason = f"node rank {hello.rank} is already taken by {node.hostname} (pid {node.pid})"
        elif node is not None and node.lost is not None:
            reason = f"node {hello.rank} was lost earlier in this run ({node.lost})"
        if reason is not None:
            log.warning(
                "refused a node agent on %s (pid %d) as node %d: %s", hello.hostname, hello.pid, hello.rank, reason
            )
            self.send(route, wire.NodeRejected(reason))
            return
        if node is None:  # not a retried hello
            node = self.nodes[hello.rank] = Node(self, hello, route)
            log.info(
                "node %d joined from %s (%s) with %d device(s)", node.rank, node.hostname, node.address, node.pool.total
            )
        self._by_route[route] = node
        node.route = route
        self.send(
            route,
            wire.NodeWelcome(self.config.heartbeat_interval_s, self.config.node_timeout_s, self.config.zygote_preload),
        )
        if len(self.nodes) >= self._needed() - 1:
            self._all_joined.set()

    def _needed(self) -> int:
        """The nodes (node 0 included) that ``start()`` waits for."""
        return self.config.min_nnodes or self.config.nnodes
