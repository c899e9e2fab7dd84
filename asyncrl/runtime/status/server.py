"""``StatusServer``: answers ``asyncrl status RUN_DIR`` for one run directory, from the event loop.

It binds a ROUTER at an ``ipc://`` path inside a private directory of its own (mode 0700, named
like the supervisor's, so a later supervisor sweeps it if this process is SIGKILLed), and
publishes that address in ``RUN_DIR/supervisor.json``. Only the owner of the run can connect: the
directory's mode is the access control, and nothing listens on TCP, so no CURVE is needed. Every
``StatusRequest`` is answered with one ``StatusReply``, and each ``CommandRequest`` for a command
the run registered (`add_command`: ``asyncrl scale``, ``asyncrl status --endpoint``) with one
``CommandReply`` (a command that awaits is answered when it ends, the server serving meanwhile);
anything else gets a typed ``StatusFailure`` and the server keeps serving. A command changes the run, and the
directory's mode is its access control too: only the run's owner reaches the socket.

``close()`` removes the socket and supervisor.json (if still ours); so does a ``weakref.finalize``
if the owner never calls it, and the ``signals.on_force_exit`` hook if a second Ctrl-C ends the
process at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from asyncrl.errors import AsyncrlError
from asyncrl.runtime import signals
from asyncrl.runtime.cluster.nodes import NodeStatus
from asyncrl.runtime.files import write_atomic
from asyncrl.runtime.record import ActorStatus
from asyncrl.runtime.status.schema import (
    MAX_FRAME_BYTES,
    MAX_PROGRESS_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL,
    SUPERVISOR_FILE,
    CommandReply,
    CommandRequest,
    RunDirInUseError,
    StatusFailure,
    StatusReply,
    StatusRequest,
    SupervisorFile,
    proc_stat,
    read_file,
    same_process_alive,
)
from asyncrl.runtime.transport import LoopSocket, configure, make_run_dir, remove_run_dir


def _remove_if_ours(path: str, ours: bytes) -> None:
    """Unlink ``path`` only while it still holds what we wrote: a later supervisor of the same run
    directory may have replaced it, and its file is not ours to remove."""
    try:
        with open(path, "rb") as f:
            if f.read(len(ours) + 1) != ours:
                return
        os.unlink(path)
    except OSError:
        pass


def _cleanup(socket_dir: str, path: str, ours: list[bytes]) -> None:
    if ours:
        _remove_if_ours(path, ours[0])
    remove_run_dir(socket_dir)


class StatusServer:
    """Answers ``StatusRequest``s for one run directory. ``actors`` and ``nodes`` are the
    supervisor's ``status`` and ``nodes``; ``progress`` returns a JSON-able dict describing the
    run. All three are called on the event loop, once per request, so they must be quick."""

    def __init__(
        self,
        run_dir: str,
        actors: Callable[[], list[ActorStatus]],
        nodes: Callable[[], list[NodeStatus]],
        progress: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, SUPERVISOR_FILE)
        self.address = ""
        self.requests = 0
        """Requests answered with a ``StatusReply``."""
        self.refused = 0
        """Messages answered with a ``StatusFailure`` (malformed, oversized, wrong protocol)."""
        self._actors, self._nodes, self._progress = actors, nodes, progress
        self._sock: LoopSocket | None = None
        self._ctx: zmq.Context | None = None
        self._closed = False
        self._written: list[bytes] = []  # filled once supervisor.json is ours; read by the finalizer
        self._hooks = contextlib.ExitStack()
        self._commands: dict[str, Callable[[dict[str, Any]], Any]] = {}
        self._answering: set[asyncio.Task] = set()  # commands that await: close() cancels them
        self._decoder = msgspec.msgpack.Decoder(StatusRequest | CommandRequest)
        self._encoder = msgspec.msgpack.Encoder()

    def start(self) -> None:
        """Bind and publish. Call from the event loop that will serve the requests."""
        if not os.path.isdir(self.run_dir):
            raise FileNotFoundError(f"run directory {self.run_dir} does not exist")
        _refuse_if_served(self.path)
        self._socket_dir = make_run_dir()
        self._finalizer = weakref.finalize(self, _cleanup, self._socket_dir, self.path, self._written)
        self._hooks.enter_context(signals.on_force_exit(self._finalizer))
        try:
            self._ctx = zmq.Context()
            sock = configure(self._ctx.socket(zmq.ROUTER), hwm=64)  # made by ctx: destroy() closes it on any failure
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished client is dropped, not queued
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # before bind: a listener copies its options
            bind = f"ipc://{self._socket_dir}/status.sock"
            try:
                sock.bind(bind)
            except zmq.ZMQError as e:
                sock.close(0)
                raise OSError(f"status server: cannot bind {bind}: {e}") from e
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._sock = LoopSocket(sock, self._on_message, "status server")
            self.started_at = time.time()
            self._started = time.monotonic()
            self._publish()
        except BaseException:
            self.close()
            raise

    def _publish(self) -> None:
        """Write supervisor.json by rename, so a reader sees the old file, none, or all of ours."""
        mine = proc_stat(os.getpid())  # our own process: always there
        start_ticks = mine[1] if mine is not None else 0
        record = SupervisorFile(os.getpid(), start_ticks, socket.gethostname(), self.address, self.started_at)
        data = msgspec.json.format(msgspec.json.encode(record), indent=2) + b"\n"
        write_atomic(self.path, data)
        self._written.append(data)

    def close(self) -> None:
        """Stop answering; remove the socket and supervisor.json (if still ours). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._answering):
            task.cancel()
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.destroy(0)
        if hasattr(self, "_finalizer"):
            self._finalizer()
        self._hooks.close()

    def add_command(self, name: str, handler: Callable[[dict[str, Any]], Any]) -> None:
        """Answer ``CommandRequest(name, args)`` with ``handler(args)`` (called on the event loop:
        it must be quick, and leave long work to a task), a dict, or an awaitable of one (a
        command that asks actors): its answer is sent when it ends, requests being served
        meanwhile; it needs a deadline of its own (the caller waits its ``--timeout`` only). An
        `AsyncrlError` or ``ValueError`` it raises is the caller's answer, as a ``StatusFailure``
        of its type and message."""
        self._commands[name] = handler

    async def __aenter__(self) -> StatusServer:
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # --- requests ------------------------------------------------------------------------------

    def _on_message(self, frames: list) -> None:
        route = frames[0].bytes
        if len(frames) != 2:
            return self._refuse(route, "ProtocolError", f"a request is one frame, not {len(frames) - 1}")
        body = frames[1]
        if len(body) > MAX_REQUEST_BYTES:
            return self._refuse(
                route, "MessageTooLargeError", f"request of {len(body)} bytes, over {MAX_REQUEST_BYTES}"
            )
        try:
            request = self._decoder.decode(body.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._refuse(route, "ProtocolError", f"not a StatusRequest or CommandRequest: {e}")
        if request.protocol != PROTOCOL:
            return self._refuse(
                route, "ProtocolError", f"status protocol {request.protocol}; this supervisor speaks {PROTOCOL}"
            )
        if isinstance(request, CommandRequest):
            return self._command(route, request)
        try:
            reply = self._encoder.encode(self.snapshot())
        except Exception as e:  # a bug of ours must not stop the server: say it to the caller
            return self._refuse(route, type(e).__name__, str(e))
        self.requests += 1
        self._send(route, reply)

    def _command(self, route: bytes, request: CommandRequest) -> None:
        handler = self._commands.get(request.name)
        if handler is None:
            known = ", ".join(sorted(self._commands)) or "none"
            return self._refuse(
                route, "UnknownCommandError", f"this run has no command {request.name!r} (it has: {known})"
            )
        try:
            result = handler(dict(request.args))
        except Exception as e:
            return self._answer(route, request.name, error=e)
        if not inspect.isawaitable(result):
            return self._answer(route, request.name, result)
        task = asyncio.ensure_future(self._answer_when_done(route, request.name, result))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer_when_done(self, route: bytes, name: str, result: Any) -> None:
        try:
            value = await result
        except Exception as e:
            self._answer(route, name, error=e)
        else:
            self._answer(route, name, value)

    def _answer(self, route: bytes, name: str, result: Any = None, error: Exception | None = None) -> None:
        if self._closed:
            return
        try:
            if error is not None:
                raise error
            reply = self._encoder.encode(CommandReply(name, result))
        except (AsyncrlError, ValueError) as e:  # refused: the one line the caller needs
            return self._refuse(route, type(e).__name__, str(e))
        except Exception as e:  # a bug of ours must not stop the server: say it to the caller
            return self._refuse(route, type(e).__name__, f"{name} failed: {e}")
        self.requests += 1
        self._send(route, reply)

    def _send(self, route: bytes, reply: bytes) -> None:
        if self._sock is not None:  # the requests come from it: it exists while one is answered
            self._sock.send([route, reply], copy=True)

    def _refuse(self, route: bytes, type_name: str, message: str) -> None:
        self.refused += 1
        self._send(route, self._encoder.encode(StatusFailure(type_name, message)))

    def snapshot(self) -> StatusReply:
        """What a request is answered with, now."""
        try:
            nodes = self._nodes()
        except AsyncrlError:  # the supervisor is closing: its actors' states still say something
            nodes = []
        progress, error = self._progress_now()
        return StatusReply(
            protocol=PROTOCOL,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            run_dir=self.run_dir,
            address=self.address,
            started_at=self.started_at,
            uptime_s=round(time.monotonic() - self._started, 3),
            actors=self._actors(),
            nodes=nodes,
            progress=progress,
            progress_error=error,
        )

    def _progress_now(self) -> tuple[dict[str, Any], str | None]:
        if self._progress is None:
            return {}, None
        try:
            value = self._progress()
            if not isinstance(value, dict):
                raise TypeError(f"progress() returned a {type(value).__name__}, not a dict")
            text = msgspec.json.encode(value)  # what `--json` prints must be JSON: normalise here
            if len(text) > MAX_PROGRESS_BYTES:
                raise ValueError(f"progress() returned {len(text)} bytes of JSON, over {MAX_PROGRESS_BYTES}")
            return msgspec.json.decode(text), None
        except Exception as e:
            return {}, f"{type(e).__name__}: {e}"


def _refuse_if_served(path: str) -> None:
    try:
        current = read_file(path)
    except (OSError, ValueError, msgspec.DecodeError):
        return  # none, or unreadable: ours replaces it
    if current.hostname == socket.gethostname() and same_process_alive(current.pid, current.pid_start_ticks):
        raise RunDirInUseError(
            f"{os.path.dirname(path)} is already served by a live supervisor (pid {current.pid}, {current.address}); "
            "two runs must not share a run directory"
        )
