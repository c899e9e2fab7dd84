"""The supervisor's half of the conversation with its workers, over the control socket.

A worker (one actor incarnation) says ``Hello``; we answer ``Init`` (its class, its constructor's
arguments, where to bind); it says ``Ready`` with its address, or ``StartFailed``; while it starts
it may name the phase it is in (``StartPhase``, which moves its start deadline). From its ``Init``
on it sends ``Heartbeat``s, and ``Dead`` with its last words if it can. ``Shutdown`` asks it to
stop.

Workers on node 0 speak through the local control socket; workers on other nodes through the
cluster socket (``cluster/nodes.py``), which hands their messages to ``on_worker`` with itself as the
channel. Every answer goes back the way the worker's ``Hello`` came.

Invariant: a message counts only if it names the current incarnation of its actor and came through
that actor's own node's socket; anything else (a previous incarnation, a forged route) is ignored.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

import msgspec

from asyncrl.errors import ActionableError, ActorNotReadyError, ActorStartError, remote_error_class
from asyncrl.runtime import net, wire
from asyncrl.runtime.config import SupervisorConfig
from asyncrl.runtime.process import write_lines
from asyncrl.runtime.record import ActorRecord
from asyncrl.runtime.resources import SupervisorResources
from asyncrl.runtime.throttled_log import ThrottledLog
from asyncrl.runtime.transport import LoopSocket, bind_router

if TYPE_CHECKING:
    from asyncrl.runtime.cluster.nodes import Cluster

log = logging.getLogger("asyncrl.supervisor")


class ControlChannel:
    """Binds the supervisor's control socket (its ``address`` is what workers connect to) and
    keeps each record's side of the conversation: routing id, readiness, heartbeats, last words.
    ``cluster`` is set once the cluster socket exists (multi-node only)."""

    def __init__(
        self, resources: SupervisorResources, config: SupervisorConfig, records: dict[str, ActorRecord]
    ) -> None:
        self.config = config
        self.run_dir = resources.run_dir
        self.records = records
        self.cluster: Cluster | None = None
        bind = f"ipc://{self.run_dir}/supervisor.sock" if config.transport == "ipc" else f"tcp://{config.host}:*"
        sock, self.address = bind_router(resources.context, bind, gate=resources.gate)
        self.local = LoopSocket(sock, self._on_local, "supervisor control")
        self._decoder = msgspec.msgpack.Decoder(wire.ToSupervisor)
        self._body = msgspec.msgpack.Encoder()
        self.dropped = ThrottledLog(
            log, "supervisor: dropped", "an undecodable control message", "undecodable control messages"
        )  # any process of this user may write junk

    def close(self) -> None:
        self.dropped.close()
        self.local.close()

    def _on_local(self, frames: list) -> None:
        if len(frames) != 2:
            return  # not one of our workers: ignore
        try:
            msg = self._decoder.decode(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:  # UTF-8: not a DecodeError
            self.dropped.note(str(e))
            return
        self.on_worker(msg, frames[0].bytes, self.local)

    def on_worker(self, msg, route: bytes, channel: LoopSocket) -> None:
        """A worker's message, from the local control socket or (workers of other nodes) the
        cluster socket; ``channel`` is where its answers go."""
        rec = self.records.get(msg.actor)
        if rec is None or rec.incarnation != msg.incarnation:
            return  # from a previous incarnation, already handled
        if (channel is self.local) != (rec.node == 0):
            return  # a worker speaks to us through its own node's socket only
        if isinstance(msg, wire.Heartbeat):
            rec.last_heartbeat = time.monotonic()
            if rec.starting is not None:
                rec.starting.on_beat()
        elif isinstance(msg, wire.StartPhase):
            if rec.starting is not None:  # a report that crossed its Ready is of no more use
                rec.starting.on_phase(msg)
                budget = f" (budget {msg.budget_s:g} s)" if msg.budget_s else ""
                log.info("actor %s: starting: %s%s", rec.name, msg.phase, budget)
        elif isinstance(msg, wire.Hello):
            if rec.routing_id is not None:
                return  # the first hello of an incarnation wins; a repeat must not redirect it
            rec.routing_id = route
            rec.channel = channel
            if rec.starting is not None:  # its heartbeats begin with the Init we send now
                rec.starting.on_beat()
            self._send_init(rec, route, channel)
        elif isinstance(msg, wire.Ready):
            if rec.ready is not None and not rec.ready.done():
                rec.ready.set_result(msg.address)
        elif isinstance(msg, wire.StartFailed):
            if rec.ready is not None and not rec.ready.done():
                rec.ready.set_exception(_start_failure(rec.name, msg))
        else:  # Dead
            rec.last_words = msg.reason

    def _send_init(self, rec: ActorRecord, route: bytes, channel: LoopSocket) -> None:
        cfg = self.config
        module, qualname, script = rec.class_ref
        payload, bufs = rec.init_payload
        if rec.node != 0:
            if self.cluster is None:
                raise RuntimeError("a worker beyond node 0 without a cluster: it can only come through one")
            bind = net.tcp_endpoint(self.cluster.nodes[rec.node].address, "*")
        elif cfg.transport == "ipc":
            bind = f"ipc://{self.run_dir}/{rec.index}-{rec.incarnation}.sock"
        else:
            bind = f"tcp://{cfg.host}:*"
        init = wire.Init(
            module, qualname, script, payload, list(sys.path), bind, cfg.max_message_bytes, cfg.heartbeat_interval_s
        )
        channel.send([route, self._body.encode(init), *bufs], copy=False)

    def send_shutdown(self, rec: ActorRecord, reason: str) -> None:
        """Ask the worker that said ``Hello`` for ``rec``'s current incarnation to stop."""
        if rec.channel is not None:  # set with the routing id, by the incarnation's Hello
            rec.channel.send([rec.routing_id, self._body.encode(wire.Shutdown(reason))], copy=True)

    def on_remote_log(self, msg: wire.ActorLog) -> None:
        """Output of an actor on another node, forwarded by its agent: printed with its prefix."""
        rec = self.records.get(msg.actor)
        if rec is not None and rec.node != 0:
            write_lines(sys.stdout if msg.stream == 1 else sys.stderr, f"[{msg.actor}]: ", msg.lines)


def _start_failure(actor: str, msg: wire.StartFailed) -> ActorStartError:
    """What a constructor's exception becomes: an error the user fixes (an `ActionableError`, e.g.
    a policy too large for its GPU) is one line, its own; anything else keeps its type's name and
    the actor's traceback (a bug)."""
    if issubclass(remote_error_class(msg.type_name, msg.type_path), ActionableError):
        return ActorNotReadyError(actor, (msg.message.strip().splitlines() or [msg.type_name])[0])
    return ActorStartError(actor, f"{msg.type_name}: {msg.message}", msg.traceback)
