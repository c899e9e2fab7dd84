"""Every actor's life, one incarnation after another: start it, watch it, restart it, stop it.

An incarnation is one process of an actor. ``start`` launches it (here, or through the agent of
its node) and waits for ``Ready`` or its exit, whichever comes first, within ``start_timeout_s`` of
the last start phase it reported (a phase may ask for more; see ``start_watch.py``), and while its
heartbeats, once begun, do not stop.
Once it runs, a watcher task waits on its exit; the silence watchdog kills it if its heartbeats
stop; its owner may kill it (``ActorHandle.kill``). However it ends, the watcher handles the exit
in one way: the record leaves RUNNING before anything is awaited (so no new call goes to the dead
process), pending calls fail with ``ActorDiedError`` naming the cause, and a new incarnation is
started while restarts are left, else the actor is DEAD and its devices go back to their pool.
A first incarnation lost while it starts is retried from the same budget (``first_start``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from asyncrl.errors import ActorDiedError, ActorNotReadyError, ActorStartError, first_line
from asyncrl.runtime import wire
from asyncrl.runtime import worker as worker_env
from asyncrl.runtime.client import ActorClient
from asyncrl.runtime.cluster import auth
from asyncrl.runtime.cluster.nodes import Cluster
from asyncrl.runtime.config import SupervisorConfig
from asyncrl.runtime.control import ControlChannel
from asyncrl.runtime.devices import DevicePool
from asyncrl.runtime.process import ActorProcess, ChildProcess
from asyncrl.runtime.record import ActorRecord
from asyncrl.runtime.resources import SupervisorResources
from asyncrl.runtime.start_watch import StartWatch
from asyncrl.runtime.state import ActorState
from asyncrl.runtime.watchdog import SilenceWatchdog
from asyncrl.runtime.zygotes.zygote import Zygote, ZygoteUnavailable

log = logging.getLogger("asyncrl.supervisor")


class Incarnations:
    """Starts, watches, restarts and stops the incarnations of the actors in ``records``, for
    one supervisor. ``node_env``: what each local actor learns about its node. Set ``closing``
    once the supervisor shuts down: no incarnation starts after that."""

    def __init__(
        self,
        config: SupervisorConfig,
        resources: SupervisorResources,
        control: ControlChannel,
        cluster: Cluster | None,
        devices: DevicePool,
        node_env: dict[str, str],
        records: dict[str, ActorRecord],
    ) -> None:
        self.config = config
        self.closing = False
        self._resources, self._control, self._cluster = resources, control, cluster
        self._devices, self._node_env, self._records = devices, node_env, records
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task] = set()
        self.zygote: Zygote | None = None
        """Where local actors are forked from while it works (``zygotes/zygote.py``); None: ``Popen``."""
        self._watchdog = SilenceWatchdog(
            "supervisor", config.heartbeat_interval_s, config.heartbeat_timeout_s, self._running, self._on_silent
        ).start()

    def close(self) -> None:
        """Stop watching; SIGKILL every incarnation still alive; close every client. Idempotent."""
        self.closing = True
        self._watchdog.close()
        for t in self._tasks:
            t.cancel()
        for rec in self._records.values():
            if rec.proc is not None and rec.proc.alive:
                rec.proc.kill_now()
            if rec.client is not None:
                rec.client.close()

    async def first_start(self, rec: ActorRecord) -> None:
        """Start ``rec``'s first incarnation, and start it again while it is lost during its start
        and restarts are left. Why here, for every actor: a process killed while it starts (an OOM
        kill, a preempted node, a SIGKILL), gone silent or past its start deadline is the same loss
        as one that dies once it runs, and a start under load takes long enough (minutes for a
        model) for that to happen; so it spends the same ``max_restarts`` (``rec.restarts``, which
        `_watch` goes on counting from). A start refused by the actor's own code (its constructor
        or ``on_start`` raised: `refused`) is not retried: its arguments are still unproven, the
        same ones fail the same way, and the caller should hear it at once. Each try is bounded by
        the start's own deadlines, so this ends. Raises the last try's ``ActorStartError``."""
        while True:
            try:
                await self.start(rec)
                rec.error = None
                return
            except ActorStartError as e:
                if self.refused(rec) or rec.stopping or self.closing or rec.restarts >= rec.max_restarts:
                    raise
                rec.error = e  # what `status()` says while it starts again
                rec.restarts += 1
                log.warning(
                    "actor %s lost during its start (%s); restart %d of %d",
                    rec.name,
                    first_line(e),
                    rec.restarts,
                    rec.max_restarts,
                )

    @staticmethod
    def refused(rec: ActorRecord) -> bool:
        """True if ``rec``'s last start failed because its own code raised (``StartFailed``: the
        constructor, ``on_start``, its arguments), not because its process was lost."""
        ready = rec.ready
        return ready is not None and ready.done() and not ready.cancelled() and ready.exception() is not None

    async def start(self, rec: ActorRecord) -> None:
        """Start ``rec``'s next incarnation; return once it is RUNNING and watched. Raises
        ``ActorStartError`` (the process is reaped first) if it fails or is not ready in time."""
        cfg = self.config
        if rec.stopping or self.closing:
            raise ActorStartError(rec.name, "the supervisor is shutting down")
        rec.incarnation += 1
        rec.routing_id = None
        rec.last_words = rec.kill_reason = ""
        ready = rec.ready = self._loop.create_future()
        watch = rec.starting = StartWatch(rec.name, cfg.start_timeout_s, cfg.heartbeat_timeout_s)
        try:
            proc = (
                await self._start_process(rec)
                if rec.node == 0
                else self._remote().spawn(
                    rec.node,
                    wire.SpawnActor(
                        rec.name, rec.incarnation, rec.devices, rec.env, self._remote().address, cfg.start_timeout_s
                    ),
                )
            )
        except OSError as e:
            raise ActorStartError(rec.name, f"cannot start a process: {e}") from e
        rec.proc = proc
        try:
            verdict = await self._await_start(ready, watch, proc)
        except asyncio.CancelledError:
            proc.kill_now()  # its group stays tracked until close() or the finalizer sweeps it
            raise
        finally:
            rec.starting = None
        failure = ready.exception() if ready.done() else None
        if ready.done() and failure is None and proc.alive:
            client = rec.client = ActorClient(
                self._resources.context, rec.name, ready.result(), cfg.max_message_bytes, keys=self._resources.keys
            )
            rec.last_heartbeat = time.monotonic()
            rec.set_state(ActorState.RUNNING)
            watcher = asyncio.ensure_future(self._watch(rec, proc, client, rec.incarnation))
            self._tasks.add(watcher)
            watcher.add_done_callback(self._tasks.discard)
            return
        error: BaseException
        if failure is not None:
            error = failure
        elif not proc.alive:
            error = ActorNotReadyError(rec.name, f"process {proc.exit_description()} during start{_words(rec)}")
        else:
            error = ActorNotReadyError(rec.name, verdict)
        await self._reap(proc)
        raise error

    async def _await_start(self, ready: asyncio.Future, watch: StartWatch, proc: ActorProcess) -> str:
        """Wait for ``Ready`` (``ready``), the process's exit, or a verdict of ``watch`` (a deadline
        that each reported phase moves, or the heartbeats' silence); the verdict, or "" when the
        wait ended otherwise."""
        while not (ready.done() or proc.exited.done()):
            verdict = watch.verdict()
            if verdict is not None:
                return verdict
            progress = asyncio.ensure_future(watch.changed.wait())
            try:
                await asyncio.wait(
                    {ready, proc.exited, progress},
                    timeout=watch.seconds_left(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                progress.cancel()
            watch.changed.clear()
        return ""

    async def _start_process(self, rec: ActorRecord) -> ChildProcess:
        res = self._resources
        env = {
            **os.environ,
            **self._node_env,
            **self._devices.env_for(rec.devices),
            **rec.env,
            "PYTHONUNBUFFERED": "1",
            worker_env.ENV_NAME: rec.name,
            worker_env.ENV_INCARNATION: str(rec.incarnation),
            worker_env.ENV_SUPERVISOR: self._control.address,
            worker_env.ENV_PARENT_PID: str(os.getpid()),
            worker_env.ENV_DEATH_FD: str(res.death_r),
            worker_env.ENV_INIT_TIMEOUT: str(self.config.start_timeout_s),
        }
        if res.keys is not None:  # the only way the secret leaves us: to our own children
            env[auth.ENV_SECRET] = res.keys.secret
        argv = [sys.executable, "-c", "from asyncrl.runtime.worker import main; main()"]
        prefix = f"[{rec.name}]: "
        zygote = self.zygote
        unsuitable = zygote.unsuitable(env) if zygote is not None and zygote.alive else ""
        if unsuitable:
            log.info("actor %s starts by Popen: %s", rec.name, unsuitable)
        elif zygote is not None and zygote.alive:
            try:  # its child's parent is the zygote: that is whose death it watches
                forked = await zygote.spawn(
                    {**env, worker_env.ENV_PARENT_PID: str(zygote.pid)}, prefix, pass_fds=[res.death_r]
                )
                res.groups.add(forked.pid)
                return forked
            except ZygoteUnavailable as e:
                self.zygote = None  # from now on by Popen; the supervisor still closes it
                log.warning("actor %s starts by Popen, as will every later one: %s", rec.name, e)
        proc = await ChildProcess.start(argv, env, prefix, pass_fds=[res.death_r])  # Popen on a thread
        res.groups.add(proc.pid)
        return proc

    async def _watch(self, rec: ActorRecord, proc: ActorProcess, client: ActorClient, incarnation: int) -> None:
        await proc.exited
        if rec.incarnation != incarnation:
            return
        reason = "stopped by the supervisor" if rec.stopping else rec.kill_reason or proc.exit_description()
        rec.last_death = (incarnation, reason + _words(rec))
        error: BaseException = ActorDiedError(rec.name, rec.last_death[1])
        if not rec.stopping:
            # Before anything is awaited: calls made from now on wait for the restart or fail.
            rec.set_state(ActorState.RESTARTING if rec.restarts < rec.max_restarts else ActorState.DEAD)
            rec.error = error
        client.fail_all(error)
        await self._reap(proc)
        if rec.stopping:
            return
        while rec.restarts < rec.max_restarts and not rec.stopping:
            rec.restarts += 1
            log.warning("actor %s died (%s); restart %d of %d", rec.name, reason, rec.restarts, rec.max_restarts)
            try:
                await self.start(rec)
                rec.error = None
                return
            except ActorStartError as e:
                error = e
        if rec.stopping:
            return  # stopped while it restarted: `stop` finishes the record; no death to report
        log.error("actor %s is dead: %s", rec.name, error)
        rec.error = error
        if rec.state is not ActorState.STOPPED:
            rec.set_state(ActorState.DEAD)
        self.release_devices(rec)

    def _running(self) -> list[tuple[ActorRecord, float]]:
        """What the heartbeat watchdog judges: running incarnations not already being killed."""
        return [
            (rec, rec.last_heartbeat)
            for rec in self._records.values()
            if rec.state is ActorState.RUNNING and rec.proc is not None and rec.proc.alive and not rec.kill_reason
        ]

    def _on_silent(self, rec: ActorRecord, silent_s: float) -> None:
        cause = f"no heartbeat for {silent_s:.1f} s (frozen or stopped?); killed"
        if rec.kill(cause):
            log.error("actor %s: %s", rec.name, cause)

    def _remote(self) -> Cluster:
        """The cluster of node agents, which exists whenever an actor is placed beyond node 0."""
        if self._cluster is None:
            raise RuntimeError("an actor placed on another node in a single-node run")
        return self._cluster

    def release_devices(self, rec: ActorRecord) -> None:
        """Give ``rec``'s devices back to its node's pool, once."""
        if not rec.devices_released:
            rec.devices_released = True
            pool = self._devices if rec.node == 0 else self._remote().nodes[rec.node].pool
            pool.give_back(rec.devices)

    async def _reap(self, proc: ActorProcess) -> None:
        """Make sure the process and everything in its group are gone."""
        await proc.terminate(self.config.term_timeout_s, kill_timeout_s=5.0)
        if not proc.alive and isinstance(proc, ChildProcess):  # a remote pid is no group of ours
            self._resources.groups.discard(proc.pid)

    async def stop(self, rec: ActorRecord, reason: str) -> None:
        """Stop ``rec`` for good: ask its running incarnation to stop (bounded by
        ``stop_timeout_s``), then SIGTERM and SIGKILL its group; STOPPED at the end."""
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
            self._control.send_shutdown(rec, reason)
            await proc.wait(self.config.stop_timeout_s)
        if proc is not None:
            await self._reap(proc)
        self.release_devices(rec)
        rec.error = rec.error or ActorDiedError(rec.name, reason)
        rec.set_state(ActorState.STOPPED)


def _words(rec: ActorRecord) -> str:
    if not rec.last_words:
        return ""
    last = rec.last_words.strip().splitlines()[-1]
    return f"; its last words: {last}"
