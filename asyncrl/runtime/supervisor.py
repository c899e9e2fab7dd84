"""The supervisor: spawns actor processes, watches them, restarts them, and shuts them all down.

Per actor it keeps one ``ActorRecord`` whose state moves
``STARTING -> RUNNING -> (RESTARTING -> RUNNING)* -> DEAD | STOPPED``. Death is observed by waiting
on the process's exit (pidfd) together with heartbeats (a frozen process is killed once silent for
``heartbeat_timeout_s``): the moment either fires, every call pending on that actor fails with
``ActorDiedError``.

Every process this supervisor starts leads its own process group and is tracked in ``_groups``
until that group is known empty; a ``weakref.finalize`` SIGKILLs whatever is left if the
supervisor is dropped or the interpreter exits without ``close()``. If this process is SIGKILLed,
the children notice on their own (see ``worker.py``).

With ``nnodes > 1`` this supervisor is node 0 of a cluster (see ``cluster.py``): actors placed on
another node are started by that node's agent and appear here as ``RemoteProcess``es, which the
code below treats like local processes. Over TCP every socket is CURVE-authenticated (``auth.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import re
import signal
import socket
import sys
import time
import weakref
from typing import Any, Callable

import msgspec
import zmq

from . import auth, net, signals, wire
from .actor import endpoints_of, init_spec
from .client import ActorClient
from .cluster import Cluster, NodeStatus
from .codec import PayloadEncoder
from .config import SupervisorConfig
from .devices import DevicePool, detect, offered
from .handle import ActorHandle
from .process import ChildProcess, write_lines
from .record import ActorRecord, ActorStatus
from .state import ActorState
from .status import StatusServer
from .transport import LoopSocket, bind_router, make_run_dir, remove_run_dir
from . import worker as worker_env
from ..errors import (
    ActorDiedError,
    ActorStartError,
    InvalidArgumentsError,
    NoFreeDevicesError,
    SupervisorClosedError,
)

log = logging.getLogger("asyncrl.supervisor")

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _class_ref(cls: type) -> tuple[str, str, str]:
    if "<locals>" in cls.__qualname__:
        raise TypeError(f"actor class {cls.__qualname__} must be defined at module level to be importable")
    module = cls.__module__
    if module in ("__main__", worker_env.SCRIPT_MODULE):
        path = getattr(sys.modules.get(module), "__file__", None)
        if not path:
            raise TypeError(f"actor class {cls.__qualname__} is defined interactively; put it in a file")
        return worker_env.SCRIPT_MODULE, cls.__qualname__, os.path.abspath(path)
    return module, cls.__qualname__, ""


def _kill_groups(groups: set[int]) -> None:
    for pgid in list(groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    groups.clear()


def _emergency_cleanup(groups: set[int], run_dir: str, fds: list[int]) -> None:
    _kill_groups(groups)
    remove_run_dir(run_dir)
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Supervisor:
    """Spawns and supervises actors. Use as ``async with Supervisor() as sup:``.

    Configuration comes from ``config`` or, by default, from ``SupervisorConfig.from_env`` (which
    ``asyncrl launch`` fills from its flags), with keyword ``overrides`` applied last."""

    def __init__(self, config: SupervisorConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = SupervisorConfig.from_env(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self._records: dict[str, ActorRecord] = {}
        self._groups: set[int] = set()
        self._names = itertools.count()
        self._indices = itertools.count()
        self._state = "new"
        self._exit = contextlib.ExitStack()
        self._status_servers: list = []

    # --- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> "Supervisor":
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        signum = signals.cancelled_by_signal(asyncio.current_task()) if exc_type is asyncio.CancelledError else None
        await self.close()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        if signum is not None:
            raise SystemExit(128 + signum) from None

    async def start(self) -> None:
        if self._state != "new":
            raise SupervisorClosedError(f"supervisor already {self._state}")
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._keys = _cluster_keys(cfg)
        self._gate: auth.Gatekeeper | None = None
        self._cluster: Cluster | None = None
        self._ctx = zmq.Context()
        self._run_dir = make_run_dir()
        # Children inherit the read end; only we hold the write end. Its EOF tells them we died.
        self._death_r, self._death_w = os.pipe()
        # Armed before anything else can fail, so a half-built supervisor is torn down too.
        self._finalizer = weakref.finalize(
            self, _emergency_cleanup, self._groups, self._run_dir, [self._death_r, self._death_w]
        )
        try:
            if self._keys is not None:  # before any bind: without it no TCP peer is admitted
                self._gate = auth.Gatekeeper(self._ctx, self._keys, "supervisor")
            bind = f"ipc://{self._run_dir}/supervisor.sock" if cfg.transport == "ipc" else f"tcp://{cfg.host}:*"
            sock, self.address = bind_router(self._ctx, bind, gate=self._gate)
            self._control = LoopSocket(sock, self._on_control, "supervisor control")
            kind, ids = detect(cfg.device_kind)
            self._devices = DevicePool(kind, offered(ids, cfg.nproc_per_node), where="node 0" if cfg.nnodes > 1 else "this host")
            if cfg.nnodes > 1:
                self._cluster = Cluster(self._ctx, cfg, self._gate, self._on_worker, self._on_remote_log)
            self._node_env = _node_env(cfg, self._cluster)
        except BaseException:
            self._close_sockets()
            self._finalizer()
            self._state = "closed"
            raise
        self._control_decoder = msgspec.msgpack.Decoder(wire.ToSupervisor)
        self._payload = PayloadEncoder()
        self._body = msgspec.msgpack.Encoder()
        self._tasks: set[asyncio.Task] = {asyncio.ensure_future(self._watch_heartbeats())}
        if cfg.handle_signals:
            self._exit.enter_context(signals.cancel_on_signals(asyncio.current_task()))
        self._state = "running"
        if self._cluster is not None:
            try:
                await self._cluster.wait_for_nodes(cfg.join_timeout_s)
            except BaseException:
                await self.close()
                raise

    def _close_sockets(self) -> None:
        if self._cluster is not None:
            self._cluster.sock.close()
        if getattr(self, "_control", None) is not None:
            self._control.close()
        if self._gate is not None:
            self._gate.close()  # its thread owns sockets of this context: stop it before destroy
        self._ctx.destroy(0)

    async def close(self) -> None:
        """Stop every actor (graceful, then SIGTERM, then SIGKILL to its process group), tell
        every node agent to exit, close sockets, remove the run directory. Idempotent. A second
        cancellation (a second Ctrl-C) while closing skips the graceful steps."""
        if self._state != "running":
            self._state = "closed"
            return
        self._state = "closing"
        try:
            await asyncio.gather(*(self._stop(rec, "the supervisor is shutting down") for rec in self._records.values()))
            if self._cluster is not None:
                await self._cluster.close("the supervisor is shutting down", self.config.term_timeout_s + 5.0)
        except asyncio.CancelledError:
            _kill_groups(self._groups)
            raise
        finally:
            self._state = "closed"
            for server in self._status_servers:  # answered while the actors stopped; not after
                server.close()
            for t in self._tasks:
                t.cancel()
            for rec in self._records.values():
                if rec.proc is not None and rec.proc.alive:
                    rec.proc.kill_now()
                if rec.client is not None:
                    rec.client.close()
            self._close_sockets()
            self._finalizer()  # kills any group still tracked, removes the run dir, closes the pipe
            self._exit.close()

    @property
    def auth_rejections(self) -> int:
        """Connections refused by authentication so far (0 when nothing listens on TCP)."""
        return self._gate.rejected if getattr(self, "_gate", None) is not None else 0

    def nodes(self) -> list[NodeStatus]:
        """One ``NodeStatus`` per node, node 0 (this one) first."""
        self._require_running()
        me = NodeStatus(0, socket.gethostname(), self._node_env[net.ENV_NODE_ADDR], len(self._devices.free), self._devices.total, "joined")
        return [me, *(self._cluster.status() if self._cluster is not None else [])]

    async def serve_status(self, run_dir: str, progress: Callable[[], dict[str, Any]] | None = None) -> StatusServer:
        """Answer ``asyncrl status RUN_DIR`` while this supervisor runs: the actors' states, the
        nodes, and what ``progress()`` returns (a JSON-able dict; called on this loop per request).
        Publishes ``RUN_DIR/supervisor.json``; the server is closed with the supervisor, or before
        by its own ``close()``. See ``status.py``."""
        self._require_running()
        server = StatusServer(run_dir, self.status, self.nodes, progress)
        server.start()
        self._status_servers.append(server)
        return server

    def _require_running(self) -> None:
        if self._state != "running":
            raise SupervisorClosedError(f"supervisor is {self._state}; use it inside `async with Supervisor()`")

    # --- spawning ----------------------------------------------------------------------------

    async def spawn(
        self,
        cls: type,
        *args: Any,
        name: str | None = None,
        gpus: int = 0,
        env: dict[str, str] | None = None,
        max_restarts: int = 0,
        call_timeout_s: float | None = None,
        kwargs: dict[str, Any] | None = None,
        node: int | None = None,
    ) -> ActorHandle:
        """Start ``cls(*args, **kwargs)`` in a new process and return its handle once ``__init__``
        and ``on_start`` have returned there. Raises ``ActorStartError`` (with the remote
        traceback) if they raise, ``NoFreeDevicesError`` if ``gpus`` cannot be met.

        ``node`` picks the node (0 is this one); by default an actor with ``gpus=0`` runs on node
        0 and one with devices on the lowest-ranked node that has ``gpus`` free (first fit, so a
        multi-device actor keeps its devices on one node)."""
        self._require_running()
        endpoints_of(cls)  # validates the class and its endpoint annotations here, not remotely
        class_ref = _class_ref(cls)
        name = name or f"{cls.__name__.lower()}-{next(self._names)}"
        if not _NAME.match(name):
            raise ValueError(f"actor name {name!r}: use 1-64 of A-Z a-z 0-9 _ . -")
        previous = self._records.get(name)
        if previous is not None and previous.state not in (ActorState.DEAD, ActorState.STOPPED):
            raise ValueError(f"an actor named {name!r} already exists ({previous.state.value})")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, not {max_restarts}")
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, not {call_timeout_s!r}")
        spec = init_spec(cls)
        bufs: list = []
        payload = self._payload.encode(spec.bind(args, kwargs or {}), bufs, first_index=1)
        try:  # the actor decodes these against __init__'s annotations; refuse a mismatch here
            spec.arg_decoder.decode(payload, [b"", *bufs])
        except msgspec.ValidationError as e:
            raise InvalidArgumentsError(name, "__init__", "InvalidArgumentsError", spec.explain(e)) from None
        rank, devices = self._place(name, gpus, node)
        rec = ActorRecord(
            name=name,
            index=next(self._indices),
            cls=cls,
            class_ref=class_ref,
            init_payload=(payload, bufs),
            devices=devices,
            env={k: str(v) for k, v in (env or {}).items()},
            max_restarts=max_restarts,
            call_timeout_s=call_timeout_s or self.config.call_timeout_s,
            node=rank,
            # a reused name continues its numbering, so (name, incarnation) never repeats
            incarnation=previous.incarnation if previous is not None else 0,
        )
        self._records[name] = rec
        try:
            await self._start_incarnation(rec)
        except BaseException as e:
            rec.set_state(ActorState.DEAD)
            rec.error = e if isinstance(e, ActorStartError) else ActorDiedError(name, "start interrupted")
            self._release_devices(rec)
            if self._records.get(name) is rec:
                del self._records[name]
            raise
        return ActorHandle(rec, endpoints_of(cls))

    def _place(self, name: str, gpus: int, node: int | None) -> tuple[int, list[str]]:
        if not isinstance(gpus, int) or gpus < 0:
            raise ValueError(f"gpus must be an int >= 0, not {gpus!r}")
        n = self.config.nnodes
        pools = {0: self._devices, **{r: nd.pool for r, nd in (self._cluster.live() if self._cluster else {}).items()}}
        if node is not None:
            if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < n:
                raise ValueError(f"node must be an int in 0..{n - 1}, not {node!r}")
            if node not in pools:
                raise ActorStartError(name, f"node {node} is lost ({self._cluster.nodes[node].lost})")
            return node, pools[node].take(gpus, name)
        if gpus == 0:
            return 0, []
        for rank in sorted(pools):
            if len(pools[rank].free) >= gpus:
                return rank, pools[rank].take(gpus, name)
        if len(pools) == 1:
            return 0, self._devices.take(gpus, name)  # raises, with the single-host wording
        free = ", ".join(f"node {r}: {len(p.free)} of {p.total}" for r, p in sorted(pools.items()))
        raise NoFreeDevicesError(f"actor {name!r} asks for {gpus} device(s); no node has that many free ({free})")

    def _pool(self, rec: ActorRecord) -> DevicePool:
        return self._devices if rec.node == 0 else self._cluster.nodes[rec.node].pool

    async def spawn_group(self, cls: type, n: int, *args: Any, name: str | None = None, **options: Any) -> list[ActorHandle]:
        """Start ``n`` alike actors concurrently, named ``<name>-0 .. <name>-(n-1)``. If any fails
        to start, the others are stopped and the first error is raised."""
        if n < 1:
            raise ValueError(f"n must be >= 1, not {n}")
        base = name or cls.__name__.lower()
        results = await asyncio.gather(
            *(self.spawn(cls, *args, name=f"{base}-{i}", **options) for i in range(n)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(self.stop(h) for h in results if isinstance(h, ActorHandle)))
            raise errors[0]
        return results

    async def stop(self, handle: ActorHandle) -> None:
        """Stop one actor for good (no restart); its pending calls fail with ``ActorDiedError``."""
        rec = self._records.get(handle.name)
        if rec is not None and rec is handle._record:
            await self._stop(rec, "stopped by the supervisor")

    def status(self) -> list[ActorStatus]:
        """One ``ActorStatus`` per actor, in spawn order."""
        return [r.status() for r in self._records.values()]

    # --- one incarnation ---------------------------------------------------------------------

    async def _start_incarnation(self, rec: ActorRecord) -> None:
        cfg = self.config
        if rec.stopping or self._state != "running":
            raise ActorStartError(rec.name, "the supervisor is shutting down")
        rec.incarnation += 1
        rec.routing_id = None
        rec.last_words = rec.kill_reason = ""
        rec.ready = self._loop.create_future()
        try:
            proc = self._start_process(rec) if rec.node == 0 else self._cluster.spawn(rec.node, wire.SpawnActor(
                rec.name, rec.incarnation, rec.devices, rec.env, self._cluster.address, cfg.start_timeout_s))
        except OSError as e:
            raise ActorStartError(rec.name, f"cannot start a process: {e}") from e
        rec.proc = proc
        try:
            await asyncio.wait({rec.ready, proc.exited}, timeout=cfg.start_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            proc.kill_now()  # its group stays tracked until close() or the finalizer sweeps it
            raise
        if rec.ready.done() and rec.ready.exception() is None and proc.alive:
            rec.client = ActorClient(self._ctx, rec.name, rec.ready.result(), cfg.max_message_bytes, keys=self._keys)
            rec.last_heartbeat = time.monotonic()
            rec.set_state(ActorState.RUNNING)
            watcher = asyncio.ensure_future(self._watch(rec, proc, rec.incarnation))
            self._tasks.add(watcher)
            watcher.add_done_callback(self._tasks.discard)
            return
        if rec.ready.done() and rec.ready.exception() is not None:
            error = rec.ready.exception()
        elif not proc.alive:
            error = ActorStartError(rec.name, f"process {proc.exit_description()} during start{_words(rec)}")
        else:
            error = ActorStartError(rec.name, f"not ready within start_timeout_s={cfg.start_timeout_s:g}")
        await self._reap(proc)
        raise error

    def _start_process(self, rec: ActorRecord) -> ChildProcess:
        env = {
            **os.environ,
            **self._node_env,
            **self._devices.env_for(rec.devices),
            **rec.env,
            "PYTHONUNBUFFERED": "1",
            worker_env.ENV_NAME: rec.name,
            worker_env.ENV_INCARNATION: str(rec.incarnation),
            worker_env.ENV_SUPERVISOR: self.address,
            worker_env.ENV_PARENT_PID: str(os.getpid()),
            worker_env.ENV_DEATH_FD: str(self._death_r),
            worker_env.ENV_INIT_TIMEOUT: str(self.config.start_timeout_s),
        }
        if self._keys is not None:  # the only way the secret leaves us: to our own children
            env[auth.ENV_SECRET] = self._keys.secret
        proc = ChildProcess(
            [sys.executable, "-c", "from asyncrl.runtime.worker import main; main()"], env, f"[{rec.name}]: ", pass_fds=[self._death_r]
        )
        self._groups.add(proc.pid)
        return proc

    async def _watch(self, rec: ActorRecord, proc: ChildProcess, incarnation: int) -> None:
        await proc.exited
        if rec.incarnation != incarnation:
            return
        reason = "stopped by the supervisor" if rec.stopping else rec.kill_reason or proc.exit_description()
        error: BaseException = ActorDiedError(rec.name, reason + _words(rec))
        if not rec.stopping:
            # Before anything is awaited: calls made from now on wait for the restart or fail.
            rec.set_state(ActorState.RESTARTING if rec.restarts < rec.max_restarts else ActorState.DEAD)
            rec.error = error
        rec.client.fail_all(error)
        await self._reap(proc)
        if rec.stopping:
            return
        while rec.restarts < rec.max_restarts and not rec.stopping:
            rec.restarts += 1
            log.warning("actor %s died (%s); restart %d of %d", rec.name, reason, rec.restarts, rec.max_restarts)
            try:
                await self._start_incarnation(rec)
                rec.error = None
                return
            except ActorStartError as e:
                error = e
        if rec.stopping:
            return  # stopped while it restarted: `_stop` finishes the record; no death to report
        log.error("actor %s is dead: %s", rec.name, error)
        rec.error = error
        if rec.state is not ActorState.STOPPED:
            rec.set_state(ActorState.DEAD)
        self._release_devices(rec)

    def _release_devices(self, rec: ActorRecord) -> None:
        if not rec.devices_released:
            rec.devices_released = True
            self._pool(rec).give_back(rec.devices)

    async def _reap(self, proc: ChildProcess) -> None:
        """Make sure the process and everything in its group are gone."""
        await proc.terminate(self.config.term_timeout_s, kill_timeout_s=5.0)
        if not proc.alive and isinstance(proc, ChildProcess):  # a remote pid is no group of ours
            self._groups.discard(proc.pid)

    async def _stop(self, rec: ActorRecord, reason: str) -> None:
        if rec.stopping:
            return
        rec.stopping = True
        proc = rec.proc
        if rec.client is not None:
            rec.client.fail_all(ActorDiedError(rec.name, reason))
        # Only a running incarnation is asked to stop and waited for: one still starting (a restart
        # under way when the run ends) reads Shutdown only once its constructor is done, which on
        # a busy machine is most of stop_timeout_s spent for nothing; it is terminated instead.
        if proc is not None and proc.alive and rec.routing_id is not None and rec.state is ActorState.RUNNING:
            rec.channel.send([rec.routing_id, self._body.encode(wire.Shutdown(reason))], copy=True)
            await proc.wait(self.config.stop_timeout_s)
        if proc is not None:
            await self._reap(proc)
        self._release_devices(rec)
        rec.error = rec.error or ActorDiedError(rec.name, reason)
        rec.set_state(ActorState.STOPPED)

    # --- control socket ----------------------------------------------------------------------

    def _on_control(self, frames: list) -> None:
        if len(frames) != 2:
            return  # not one of our workers: ignore
        try:
            msg = self._control_decoder.decode(frames[1].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("supervisor: dropped an undecodable control message")
            return
        self._on_worker(msg, frames[0].bytes, self._control)

    def _on_worker(self, msg, route: bytes, channel: LoopSocket) -> None:
        """A worker's message, from the local control socket or (workers of other nodes) the
        cluster socket; ``channel`` is where its answers go."""
        rec = self._records.get(msg.actor)
        if rec is None or rec.incarnation != msg.incarnation:
            return  # from a previous incarnation, already handled
        if (channel is self._control) != (rec.node == 0):
            return  # a worker speaks to us through its own node's socket only
        kind = type(msg)
        if kind is wire.Heartbeat:
            rec.last_heartbeat = time.monotonic()
        elif kind is wire.Hello:
            if rec.routing_id is not None:
                return  # the first hello of an incarnation wins; a repeat must not redirect it
            rec.routing_id = route
            rec.channel = channel
            self._send_init(rec)
        elif kind is wire.Ready:
            if not rec.ready.done():
                rec.ready.set_result(msg.address)
        elif kind is wire.StartFailed:
            if not rec.ready.done():
                rec.ready.set_exception(ActorStartError(rec.name, f"{msg.type_name}: {msg.message}", msg.traceback))
        else:  # Dead
            rec.last_words = msg.reason

    def _send_init(self, rec: ActorRecord) -> None:
        cfg = self.config
        module, qualname, script = rec.class_ref
        payload, bufs = rec.init_payload
        if rec.node != 0:
            bind = net.tcp_endpoint(self._cluster.nodes[rec.node].address, "*")
        elif cfg.transport == "ipc":
            bind = f"ipc://{self._run_dir}/{rec.index}-{rec.incarnation}.sock"
        else:
            bind = f"tcp://{cfg.host}:*"
        init = wire.Init(module, qualname, script, payload, list(sys.path), bind, cfg.max_message_bytes, cfg.heartbeat_interval_s)
        rec.channel.send([rec.routing_id, self._body.encode(init), *bufs], copy=False)

    def _on_remote_log(self, msg: wire.ActorLog) -> None:
        rec = self._records.get(msg.actor)
        if rec is not None and rec.node != 0:
            write_lines(sys.stdout if msg.stream == 1 else sys.stderr, f"[{msg.actor}]: ", msg.lines)

    async def _watch_heartbeats(self) -> None:
        cfg = self.config
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            now = time.monotonic()
            if now - last_tick > cfg.heartbeat_timeout_s / 2:
                # Our own loop was blocked: beats are queued unread, not missing. Start afresh.
                for rec in self._records.values():
                    rec.last_heartbeat = now
            last_tick = now
            for rec in self._records.values():
                silent = now - rec.last_heartbeat
                if rec.state is ActorState.RUNNING and silent > cfg.heartbeat_timeout_s and rec.proc.alive and not rec.kill_reason:
                    rec.kill_reason = f"no heartbeat for {silent:.1f} s (frozen or stopped?); killed"
                    log.error("actor %s: %s", rec.name, rec.kill_reason)
                    rec.proc.kill_now()


def _cluster_keys(cfg: SupervisorConfig) -> auth.ClusterKeys | None:
    """Keys for TCP sockets: the configured cluster secret; on one host, a fresh one if none is
    set (our children get it from us). None when nothing of ours speaks TCP."""
    if cfg.transport != "tcp" and cfg.nnodes == 1:
        return None
    secret = auth.load_secret()
    if secret is None:
        if cfg.nnodes > 1:
            raise ValueError(
                f"a cluster of {cfg.nnodes} nodes needs a cluster secret: set {auth.ENV_SECRET_FILE} "
                f"(or {auth.ENV_SECRET}) to the same secret on every node; `asyncrl secret PATH` makes one"
            )
        secret = auth.new_secret()
    return auth.ClusterKeys.from_secret(secret)


def _node_env(cfg: SupervisorConfig, cluster: Cluster | None) -> dict[str, str]:
    """What every local actor learns about its node; ``ASYNCRL_NODE_ADDR`` is where actors on
    other nodes reach this one (a user's own setting wins)."""
    address = os.environ.get(net.ENV_NODE_ADDR) or (cluster.host if cluster is not None else cfg.host)
    return {net.ENV_NODE_ADDR: address, net.ENV_NODE_RANK: "0", net.ENV_NNODES: str(cfg.nnodes)}


def _words(rec: ActorRecord) -> str:
    if not rec.last_words:
        return ""
    last = rec.last_words.strip().splitlines()[-1]
    return f"; its last words: {last}"
