"""The supervisor: spawns actor processes, watches them, restarts them, and shuts them all down.

Per actor it keeps one ``ActorRecord`` whose state moves
``STARTING -> RUNNING -> (RESTARTING -> RUNNING)* -> DEAD | STOPPED``. Death is observed by waiting
on the process's exit (pidfd) together with heartbeats (a frozen process is killed once silent for
``heartbeat_timeout_s``, see ``watchdog.py``): the moment either fires, every call pending on that
actor fails with ``ActorDiedError``. A kill its owner asks for (``ActorHandle.kill``) is the same
death with a stated cause. How incarnations start, end and restart: ``incarnations.py``.

What the supervisor holds on its host (context, run directory, death pipe, process groups) is
owned by ``SupervisorResources`` (``resources.py``), which SIGKILLs every group it tracks and
removes the run directory however this process ends, bar a SIGKILL of it (then the children
notice on their own, see ``worker.py``). The conversation with workers lives in ``control.py``;
placement in ``placement.py``.

With ``nnodes > 1`` this supervisor is node 0 of a cluster (see ``cluster/nodes.py``): actors placed on
another node are started by that node's agent and appear here as ``RemoteProcess``es, which the
code below treats like local processes. Over TCP every socket is CURVE-authenticated (``cluster/auth.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from asyncrl.errors import ActorDiedError, ActorStartError, InvalidArgumentsError, SupervisorClosedError, first_line
from asyncrl.runtime import net, signals, titles
from asyncrl.runtime.actor import Actor, endpoints_of, init_spec
from asyncrl.runtime.cluster.nodes import Cluster, NodeStatus
from asyncrl.runtime.codec import PayloadEncoder
from asyncrl.runtime.config import SupervisorConfig
from asyncrl.runtime.control import ControlChannel
from asyncrl.runtime.devices import DevicePool, detect, offered
from asyncrl.runtime.handle import ActorHandle
from asyncrl.runtime.incarnations import Incarnations
from asyncrl.runtime.placement import check_name, class_ref, place
from asyncrl.runtime.record import ActorRecord, ActorStatus
from asyncrl.runtime.resources import SupervisorResources, cluster_keys
from asyncrl.runtime.state import ActorState, SupervisorState
from asyncrl.runtime.status import StatusServer
from asyncrl.runtime.zygotes.pool import ZygotePool, active_pool
from asyncrl.runtime.zygotes.zygote import ENV_PRELOAD, Zygote, usable

log = logging.getLogger("asyncrl.supervisor")

__all__ = ["Supervisor"]

A = TypeVar("A", bound=Actor)


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
        self._names = itertools.count()
        self._indices = itertools.count()
        self._state = SupervisorState.NEW
        self._exit = contextlib.ExitStack()
        self._status_servers: list[StatusServer] = []
        self._resources: SupervisorResources | None = None
        self._control: ControlChannel | None = None
        self._cluster: Cluster | None = None
        self._zygote: Zygote | None = None
        self._pool: ZygotePool | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Supervisor:
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
        if self._state != SupervisorState.NEW:
            raise SupervisorClosedError(f"supervisor already {self._state}")
        cfg = self.config
        # Owns the run directory from here on: a half-built supervisor is torn down by _release.
        self._resources = SupervisorResources(cluster_keys(cfg))
        try:
            self._control = ControlChannel(self._resources, cfg, self._records)
            self.address = self._control.address
            kind, ids = detect(cfg.device_kind)
            self._devices = DevicePool(
                kind, offered(ids, cfg.nproc_per_node), where="node 0" if cfg.nnodes > 1 else "this host"
            )
            if cfg.nnodes > 1:
                gate = self._resources.gate
                if gate is None:
                    raise RuntimeError("no gate in a multi-node run: cluster_keys gives keys whenever nnodes > 1")
                self._cluster = self._control.cluster = Cluster(
                    self._resources.context, cfg, gate, self._control.on_worker, self._control.on_remote_log
                )
            self._node_env = _node_env(cfg, self._cluster)
        except BaseException:
            self._release()
            self._state = SupervisorState.CLOSED
            raise
        self._payload = PayloadEncoder()
        self._incarnations = Incarnations(
            cfg, self._resources, self._control, self._cluster, self._devices, self._node_env, self._records
        )
        if cfg.zygote_preload and usable(self._devices.total):
            env = {**os.environ, ENV_PRELOAD: cfg.zygote_preload}
            self._pool = active_pool()
            try:  # imports in the background from now on, while the driver does its own start
                if self._pool is not None:  # the pool's, not ours: not among our groups
                    self._zygote = await self._pool.acquire(env)
                else:
                    self._zygote = await Zygote.start(env, self._resources.death_r)
                    self._resources.groups.add(self._zygote.pid)
                self._incarnations.zygote = self._zygote
            except OSError as e:
                log.warning("no zygote (%s): actors start by Popen", e)
        if cfg.handle_signals:
            self._exit.enter_context(signals.cancel_on_signals(asyncio.current_task()))
        self._state = SupervisorState.RUNNING
        if self._cluster is not None:
            try:
                await self._cluster.wait_for_nodes(cfg.join_timeout_s)
            except BaseException:
                await self.close()
                raise

    def _release(self) -> None:
        """Close the sockets, then the resources (which SIGKILL every group still tracked and
        remove the run directory). Synchronous, idempotent."""
        if self._zygote is not None:
            if self._pool is not None:  # its actors are killed by their groups below
                self._pool.release(self._zygote, reusable=False)
            else:
                self._zygote.kill_now()
            self._zygote = None
        if self._cluster is not None:
            self._cluster.close_now()
        if self._control is not None:
            self._control.close()
        if self._resources is not None:
            self._resources.close()

    async def close(self) -> None:
        """Stop every actor (graceful, then SIGTERM, then SIGKILL to its process group), tell
        every node agent to exit, close sockets, remove the run directory. Idempotent. A second
        cancellation (a second Ctrl-C) while closing skips the graceful steps."""
        if self._state != SupervisorState.RUNNING:
            self._state = SupervisorState.CLOSED
            return
        self._state = SupervisorState.CLOSING
        self._incarnations.closing = True  # no incarnation starts from now on
        try:
            await asyncio.gather(
                *(self._incarnations.stop(rec, "the supervisor is shutting down") for rec in self._records.values())
            )
            if self._cluster is not None:
                await self._cluster.close("the supervisor is shutting down", self.config.term_timeout_s + 5.0)
            if self._zygote is not None and self._pool is not None:  # after the actors: back, for the next supervisor
                self._pool.release(self._zygote, reusable=self._incarnations.zygote is self._zygote)
                self._zygote = None
            elif self._zygote is not None:  # after the actors: it is the parent of some
                await self._zygote.close()
                if self._zygote.proc.poll() is not None and self._resources is not None:
                    self._resources.groups.discard(self._zygote.pid)
        except asyncio.CancelledError:
            if self._resources is not None:  # made by start, which a running supervisor went through
                self._resources.kill_groups()
            raise
        finally:
            self._state = SupervisorState.CLOSED
            for server in self._status_servers:  # answered while the actors stopped; not after
                server.close()
            self._incarnations.close()
            self._release()
            self._exit.close()

    @property
    def auth_rejections(self) -> int:
        """Connections refused by authentication so far (0 when nothing listens on TCP)."""
        return self._resources.rejected if self._resources is not None else 0

    def nodes(self) -> list[NodeStatus]:
        """One ``NodeStatus`` per node, node 0 (this one) first."""
        self._require_running()
        me = NodeStatus(
            0,
            socket.gethostname(),
            self._node_env[net.ENV_NODE_ADDR],
            len(self._devices.free),
            self._devices.total,
            "joined",
            len(os.sched_getaffinity(0)),
        )
        return [me, *(self._cluster.status() if self._cluster is not None else [])]

    async def serve_status(self, run_dir: str, progress: Callable[[], dict[str, Any]] | None = None) -> StatusServer:
        """Answer ``asyncrl status RUN_DIR`` while this supervisor runs: the actors' states, the
        nodes, and what ``progress()`` returns (a JSON-able dict; called on this loop per request).
        Publishes ``RUN_DIR/supervisor.json``; the server is closed with the supervisor, or before
        by its own ``close()``. See ``status/``."""
        self._require_running()
        server = StatusServer(run_dir, self.status, self.nodes, progress)
        server.start()
        self._status_servers.append(server)
        return server

    def _require_running(self) -> None:
        if self._state != SupervisorState.RUNNING:
            raise SupervisorClosedError(f"supervisor is {self._state}; use it inside `async with Supervisor()`")

    # --- spawning ----------------------------------------------------------------------------

    async def spawn(
        self,
        cls: type[A],
        *args: Any,
        name: str | None = None,
        gpus: int = 0,
        env: dict[str, str] | None = None,
        max_restarts: int = 0,
        call_timeout_s: float | None = None,
        kwargs: dict[str, Any] | None = None,
        node: int | None = None,
        share_devices_with: str | None = None,
        keep_if_lost: bool = False,
    ) -> ActorHandle[A]:
        """Start ``cls(*args, **kwargs)`` in a new process and return its handle once ``__init__``
        and ``on_start`` have returned there. Raises ``ActorStartError`` (with the remote
        traceback) if they raise, ``NoFreeDevicesError`` if ``gpus`` cannot be met.

        A start whose process is lost (killed, silent, past its deadline) is tried again while
        ``max_restarts`` allows (the restarts once it runs share that budget; see
        ``Incarnations.first_start``). After the last try ``ActorNotReadyError`` is raised; or,
        with ``keep_if_lost``, the handle of the DEAD actor is returned, as if it had died once it
        ran (``status()`` lists it; every call fails at once with the start's error): for a member
        of a pool that can go on without it. A start its own code refused (the constructor
        raised) is neither tried again nor kept.

        ``node`` picks the node (0 is this one); by default an actor with ``gpus=0`` runs on node
        0 and one with devices on the lowest-ranked node that has ``gpus`` free (first fit, so a
        multi-device actor keeps its devices on one node). ``share_devices_with`` names a living
        actor whose devices (and node) this one uses too, colocated: they stay that actor's, given
        back when it ends, never by this one."""
        self._require_running()
        endpoints_of(cls)  # validates the class and its endpoint annotations here, not remotely
        ref = class_ref(cls)
        name = check_name(name or f"{cls.__name__.lower()}-{next(self._names)}")
        previous = self._records.get(name)
        if previous is not None and not previous.state.final:
            raise ValueError(f"an actor named {name!r} already exists ({previous.state.value})")
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, not {max_restarts}")
        if call_timeout_s is not None and not call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, not {call_timeout_s!r}")
        init_payload = self._init_payload(cls, name, args, kwargs or {})
        if share_devices_with is None:
            rank, devices = place(name, gpus, node, self.config.nnodes, self._devices, self._cluster)
        else:
            rank, devices = self._shared_devices(name, share_devices_with, gpus, node)
        rec = ActorRecord(
            name=name,
            index=next(self._indices),
            cls=cls,
            class_ref=ref,
            init_payload=init_payload,
            devices=devices,
            env={**titles.run_env(), **{k: str(v) for k, v in (env or {}).items()}},  # the run's name, on any node
            max_restarts=max_restarts,
            call_timeout_s=call_timeout_s or self.config.call_timeout_s,
            node=rank,
            # a reused name continues its numbering, so (name, incarnation) never repeats
            incarnation=previous.incarnation if previous is not None else 0,
        )
        rec.devices_released = share_devices_with is not None  # the owner's to give back
        self._records[name] = rec
        await self._first_start(rec, keep_if_lost)
        return ActorHandle(rec, endpoints_of(cls))

    def _init_payload(
        self, cls: type, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[msgspec.Raw, list]:
        """``cls(*args, **kwargs)``'s arguments encoded for the actor's process, and its out-of-band buffers."""
        spec = init_spec(cls)
        bufs: list = []
        payload = self._payload.encode(spec.bind(args, kwargs), bufs, first_index=1)
        try:  # the actor decodes these against __init__'s annotations; refuse a mismatch here
            spec.arg_decoder.decode(payload, [b"", *bufs])
        except msgspec.ValidationError as e:
            raise InvalidArgumentsError(name, "__init__", "InvalidArgumentsError", spec.explain(e)) from None
        return payload, bufs

    async def _first_start(self, rec: ActorRecord, keep_if_lost: bool) -> None:
        """Start ``rec``'s first incarnation. A start that fails leaves nothing behind (`_forget`),
        but one lost under ``keep_if_lost``: that actor stays, DEAD, its devices given back."""
        try:
            await self._incarnations.first_start(rec)
        except ActorStartError as e:
            lost = self._state == SupervisorState.RUNNING and not rec.stopping and not self._incarnations.refused(rec)
            if not (keep_if_lost and lost):
                self._forget(rec, e)
                raise
            log.error(
                "actor %s is dead: its start was lost, %d restart(s) spent (%s)", rec.name, rec.restarts, first_line(e)
            )
            rec.error = e
            rec.set_state(ActorState.DEAD)
            self._incarnations.release_devices(rec)
        except BaseException as e:
            self._forget(rec, e)
            raise

    def _forget(self, rec: ActorRecord, e: BaseException) -> None:
        """A spawn that raises leaves nothing behind: the record is dropped, its devices go back."""
        rec.set_state(ActorState.DEAD)
        rec.error = e if isinstance(e, ActorStartError) else ActorDiedError(rec.name, "start interrupted")
        self._incarnations.release_devices(rec)
        if self._records.get(rec.name) is rec:
            del self._records[rec.name]

    def _shared_devices(self, name: str, owner: str, gpus: int, node: int | None) -> tuple[int, list[str]]:
        record = self._records.get(owner)
        if record is None or record.state.final:
            raise ValueError(f"actor {name!r} is to share the devices of {owner!r}, which is not running")
        if gpus or (node is not None and node != record.node):
            raise ValueError(f"actor {name!r} shares {owner!r}'s devices: it takes neither gpus= nor another node")
        if not record.devices:
            raise ValueError(f"actor {name!r} is to share the devices of {owner!r}, which has none")
        return record.node, list(record.devices)

    async def spawn_group(
        self, cls: type[A], n: int, *args: Any, name: str | None = None, **options: Any
    ) -> list[ActorHandle[A]]:
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
        return [h for h in results if isinstance(h, ActorHandle)]  # all of them: no errors

    async def stop(self, handle: ActorHandle[Actor]) -> None:
        """Stop one actor for good (no restart); its pending calls fail with ``ActorDiedError``."""
        rec = self._records.get(handle.name)
        if rec is not None and rec is handle._record:
            await self._incarnations.stop(rec, "stopped by the supervisor")

    def status(self) -> list[ActorStatus]:
        """One ``ActorStatus`` per actor, in spawn order."""
        return [r.status() for r in self._records.values()]


def _node_env(cfg: SupervisorConfig, cluster: Cluster | None) -> dict[str, str]:
    """What every local actor learns about its node; ``ASYNCRL_NODE_ADDR`` is where actors on
    other nodes reach this one (a user's own setting wins)."""
    address = os.environ.get(net.ENV_NODE_ADDR) or (cluster.host if cluster is not None else cfg.host)
    return {net.ENV_NODE_ADDR: address, net.ENV_NODE_RANK: "0", net.ENV_NNODES: str(cfg.nnodes)}
