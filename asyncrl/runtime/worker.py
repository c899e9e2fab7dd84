"""Entry point of an actor process, started by the supervisor (``worker.main``).

Life of a worker: arm parent-death handling, say ``Hello`` to the supervisor, receive ``Init``,
build the actor, bind its ROUTER, say ``Ready``, serve until ``Shutdown`` (graceful: ``on_stop``,
exit 0) or a fatal error (``Dead`` with the reason, exit 1).

Parent death: ``PR_SET_PDEATHSIG`` delivers SIGTERM when the supervisor dies, even by SIGKILL; a
thread blocked on the read end of a pipe whose write end only the supervisor holds is the
fallback (it sees EOF when the supervisor is gone for any reason). Either one kills this
process's whole group with SIGKILL, so grandchildren go too. On another node the parent is the
node agent, which plays the supervisor's part in this.

Over TCP (another node, or ``transport='tcp'``) every socket authenticates with the cluster secret
that the parent put in ``ASYNCRL_CLUSTER_SECRET``, and the actor's ROUTER admits only its holders.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import importlib
import importlib.util
import os
import signal
import sys
import threading
import traceback
from typing import Any

import msgspec
import zmq

from asyncrl.errors import type_path
from asyncrl.runtime import startup, titles, wire
from asyncrl.runtime.actor import init_spec
from asyncrl.runtime.cluster.auth import ClusterKeys, Gatekeeper, keys_from_env
from asyncrl.runtime.loop import run
from asyncrl.runtime.loop_watch import LoopWatch
from asyncrl.runtime.server import ActorServer
from asyncrl.runtime.timeouts import timeout
from asyncrl.runtime.transport import LoopSocket, bind_router, connect_dealer

ENV_NAME = "ASYNCRL_ACTOR"
ENV_INCARNATION = "ASYNCRL_INCARNATION"
ENV_SUPERVISOR = "ASYNCRL_SUPERVISOR_ADDR"
ENV_PARENT_PID = "ASYNCRL_PARENT_PID"
ENV_DEATH_FD = "ASYNCRL_DEATH_FD"
ENV_INIT_TIMEOUT = "ASYNCRL_INIT_TIMEOUT_S"
ENV_LOOP_WATCH = "ASYNCRL_ACTOR_LOOP_WATCH_S"
"""A diagnostic, off unless set (inherited from the supervisor's or the node agent's
environment): seconds after which a ready actor whose event loop ran no callback says so on its
stderr, naming what holds the loop, as the driver's `LoopWatch` does (docs/observability.md)."""
SCRIPT_MODULE = "__asyncrl_script__"
"""Module name under which a launched script (or a ``__main__`` file) is loaded."""

_PR_SET_PDEATHSIG = 1


def _kill_my_group(*_args) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _arm_parent_death(parent_pid: int, death_fd: int) -> None:
    signal.signal(signal.SIGTERM, _kill_my_group)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the death pipe below still works
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        _kill_my_group()

    def watch() -> None:
        try:
            while os.read(death_fd, 1):
                pass
        except OSError:
            pass
        _kill_my_group()

    threading.Thread(target=watch, name="asyncrl-death-pipe", daemon=True).start()


class _Heartbeat(threading.Thread):
    """Beats from a thread with its own socket, so a long blocking endpoint (a training step
    holding the loop) does not look like death; a frozen or stopped process does.

    It also carries the actor's start phases (`startup.start_phase`), from whichever thread
    reports them: they are queued and the thread woken, so one goes out at once, before the next
    beat, even while the constructor holds the event loop."""

    def __init__(self, address: str, actor: str, incarnation: int, interval_s: float, keys: ClusterKeys | None):
        super().__init__(name="asyncrl-heartbeat", daemon=True)
        self.address, self.interval_s, self.keys = address, interval_s, keys
        self.actor, self.incarnation = actor, incarnation
        self.body = msgspec.msgpack.encode(wire.Heartbeat(actor, incarnation))
        self.stopped = threading.Event()
        self._wake = threading.Event()
        self._phases: collections.deque[bytes] = collections.deque(maxlen=16)  # only the latest matter

    def report_phase(self, phase: str, budget_s: float, knob: str) -> None:
        """Queue a start phase for the supervisor (any thread)."""
        msg = wire.StartPhase(self.actor, self.incarnation, phase, budget_s, knob)
        self._phases.append(msgspec.msgpack.encode(msg))
        self._wake.set()

    def stop(self) -> None:
        self.stopped.set()
        self._wake.set()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = connect_dealer(ctx, self.address, hwm=4, keys=self.keys)
        try:
            while True:
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if self.stopped.is_set():
                    break
                try:
                    while self._phases:
                        phase = self._phases.popleft()
                        try:
                            sock.send(phase, zmq.NOBLOCK)
                        except zmq.Again:
                            self._phases.appendleft(phase)  # sent with the next beat
                            raise
                    sock.send(self.body, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # supervisor busy; the next beat will do
        finally:
            sock.close(0)
            ctx.term()


def loop_watch_threshold() -> float:
    """`ENV_LOOP_WATCH`'s seconds; 0 where unset. A value that is not seconds > 0 is a ValueError
    (the actor's start fails, naming the variable)."""
    text = os.environ.get(ENV_LOOP_WATCH, "").strip()
    if not text:
        return 0.0
    try:
        threshold = float(text)
    except ValueError:
        threshold = float("nan")
    if not 0 < threshold < float("inf"):
        raise ValueError(f"{ENV_LOOP_WATCH} must be a number of seconds > 0 (unset: off), not {text!r}")
    return threshold


def load_class(init: wire.Init) -> type:
    if init.script:
        module = sys.modules.get(SCRIPT_MODULE)
        if module is None:
            sys.path.insert(0, os.path.dirname(init.script))
            spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, init.script)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load the driver script {init.script!r} as a module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[SCRIPT_MODULE] = module
            spec.loader.exec_module(module)
    else:
        module = importlib.import_module(init.module)
    obj: Any = module
    for part in init.qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Control:
    """The worker's end of its supervisor connection: ``Init`` once, then ``Shutdown``."""

    def __init__(self, ctx: zmq.Context, address: str, keys: ClusterKeys | None):
        loop = asyncio.get_running_loop()
        self.init: asyncio.Future = loop.create_future()
        self.shutdown: asyncio.Future = loop.create_future()
        self._decoder = msgspec.msgpack.Decoder(wire.ToWorker)
        # linger: last words (StartFailed, Dead) must get out before the process exits
        self.sock = LoopSocket(
            connect_dealer(ctx, address, linger_ms=2000, keys=keys), self._on_message, "worker control"
        )

    def _on_message(self, frames: list) -> None:
        try:
            msg = self._decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # only our supervisor can reach this socket; a garbled message is dropped
        target = self.init if type(msg) is wire.Init else self.shutdown
        if not target.done():
            target.set_result((msg, frames))

    def say(self, msg) -> None:
        self.sock.send([msgspec.msgpack.encode(msg)], copy=True)


async def _serve(name: str, incarnation: int, sup_address: str, init_timeout_s: float) -> int:
    keys = keys_from_env()
    ctx = zmq.Context()
    control = _Control(ctx, sup_address, keys)
    heartbeat = None
    server = None
    gate = None
    watch = None
    try:
        control.say(wire.Hello(name, incarnation, os.getpid()))
        try:
            async with timeout(init_timeout_s):
                init, frames = await control.init
        except asyncio.TimeoutError:
            raise TimeoutError(f"no Init for actor {name!r} from the supervisor within {init_timeout_s:g} s") from None
        # The driver's import path, in the driver's order, then whatever only this process has.
        # (Putting the driver's extra entries first instead let setuptools' vendored packages,
        # which it appends last, shadow installed ones in the actor and its children.)
        sys.path[:] = [*init.sys_path, *(p for p in sys.path if p not in init.sys_path)]
        heartbeat = _Heartbeat(sup_address, name, incarnation, init.heartbeat_interval_s, keys)
        heartbeat.start()
        startup.install(heartbeat.report_phase)
        try:
            watch_s = loop_watch_threshold()
            cls = load_class(init)
            spec = init_spec(cls)
            args = spec.arg_decoder.decode(init.args, frames)
            actor = spec.invoke(cls, args)
            await actor.on_start()
            if init.bind_address.startswith("tcp://"):
                if keys is None:
                    raise RuntimeError("asked to listen on TCP, but no cluster secret is in the environment")
                gate = Gatekeeper(ctx, keys, f"actor {name}")
            sock, address = bind_router(ctx, init.bind_address, gate=gate)
            server = ActorServer(actor, name, sock, init.max_message_bytes)
        except BaseException as e:
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            control.say(wire.StartFailed(name, incarnation, type(e).__name__, str(e), tb, type_path(type(e))))
            return 1
        finally:
            startup.install(None)  # ready (or failed): a phase reported from now on means nothing
        control.say(wire.Ready(name, incarnation, address))
        if watch_s:  # from here on: a constructor may hold the loop while it loads a model
            say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
            watch = LoopWatch(f"actor {name!r}", watch_s, say).start()
        await control.shutdown  # the supervisor's word, or our death by signal, ends this
        await server.close()
        await actor.on_stop()
        return 0
    except Exception as e:
        reason = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        control.say(wire.Dead(name, incarnation, reason))
        print(f"actor {name!r} failed:\n{reason}", file=sys.stderr, flush=True)
        return 1
    finally:
        if watch is not None:
            watch.close()
        if heartbeat is not None:
            heartbeat.stop()
        if server is not None:
            server.sock.close()
        control.sock.close()  # lingers up to 2 s for queued last words
        if gate is not None:
            gate.close()
        ctx.term()


def main() -> None:
    env = os.environ
    name = env[ENV_NAME]
    titles.set_title(name)
    _arm_parent_death(int(env[ENV_PARENT_PID]), int(env[ENV_DEATH_FD]))
    code = run(_serve(name, int(env[ENV_INCARNATION]), env[ENV_SUPERVISOR], float(env[ENV_INIT_TIMEOUT])))
    sys.exit(code)
