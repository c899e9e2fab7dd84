"""ZeroMQ sockets as the runtime uses them: bounded, explicit addresses, no lingering, one loop.

Addresses: ``ipc://`` inside a host (files in a private 0700 run directory), ``tcp://host:port``
across hosts, always authenticated (CURVE, see ``auth.py``): the helpers below refuse a ``tcp://``
endpoint without keys. Every socket has bounded high-water marks and every send queue is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Callable

import zmq

from asyncrl.runtime.throttled_log import ThrottledLog

if TYPE_CHECKING:
    from asyncrl.runtime.auth import ClusterKeys, Gatekeeper

DEFAULT_HWM = 1000
MAX_QUEUED_SENDS = 100_000
RUN_DIR_PREFIX = "asyncrl-"

log = logging.getLogger("asyncrl.transport")


def configure(sock: zmq.Socket, hwm: int = DEFAULT_HWM, linger_ms: int = 0) -> zmq.Socket:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


def bind_router(ctx: zmq.Context, bind: str, hwm: int = DEFAULT_HWM, gate: "Gatekeeper | None" = None) -> tuple[zmq.Socket, str]:
    """A ROUTER bound to ``bind`` (``tcp://host:*`` picks a free port); returns it and its address.
    A ``tcp://`` socket must be guarded: ``gate`` admits only holders of the cluster secret."""
    if bind.startswith("tcp://") and gate is None:
        raise ValueError(f"refusing to bind {bind} without authentication (no cluster keys)")
    sock = configure(zmq.Socket(ctx, zmq.ROUTER), hwm)
    # A reply to a caller that disconnected raises instead of vanishing silently; we count it.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        if "[" in bind:
            sock.setsockopt(zmq.IPV6, 1)
        if gate is not None and bind.startswith("tcp://"):
            gate.secure_server(sock)
        sock.bind(bind)
    except (zmq.ZMQError, OSError) as e:
        sock.close(0)
        raise OSError(f"cannot bind {bind}: {e}") from e
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_dealer(
    ctx: zmq.Context, connect: str, hwm: int = DEFAULT_HWM, linger_ms: int = 0, keys: "ClusterKeys | None" = None
) -> zmq.Socket:
    """A DEALER connected to ``connect``; over ``tcp://`` it authenticates with ``keys``."""
    if connect.startswith("tcp://") and keys is None:
        raise ValueError(f"refusing to connect to {connect} without authentication (no cluster keys)")
    sock = configure(zmq.Socket(ctx, zmq.DEALER), hwm, linger_ms)
    if "[" in connect:
        sock.setsockopt(zmq.IPV6, 1)
    if keys is not None and connect.startswith("tcp://"):
        keys.secure_client(sock)
    sock.connect(connect)
    return sock


class LoopSocket:
    """A ZeroMQ socket driven straight from the event loop's readiness callback.

    Each complete message is handed to ``on_message(frames)`` from the loop's reader callback, and
    ``send`` hands frames to libzmq without waiting; no future is created per message, which is
    most of the cost of a small call on pyzmq's asyncio wrapper. ``on_message`` must not block.

    ZeroMQ's descriptor is edge-triggered: it signals a change of state, not readiness. So every
    wake-up drains until ``ZMQ_EVENTS`` says no message is left, and every send re-checks the
    events and schedules a drain if a message became readable meanwhile.

    When libzmq refuses a send (high-water mark reached), frames wait in an ordered queue that is
    flushed when the socket becomes writable again; the queue is bounded by ``MAX_QUEUED_SENDS``
    and what overflows it is dropped, counted in ``dropped_sends`` and logged (`ThrottledLog`: a peer
    that sends and never reads overflows it once per message)."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list], None], name: str):
        self.sock = sock
        self.name = name
        self.dropped_sends = 0
        self._drops = ThrottledLog(log, f"{name}: dropped", "a message", "messages")
        self._on_message = on_message
        self._queued: collections.deque = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._drain_scheduled = False
        self._closed = False
        self._loop.add_reader(self._fd, self._drain)
        self._schedule_drain()  # messages may have arrived before the reader was added

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        sock = self.sock
        try:
            while not self._closed:
                events = sock.getsockopt(zmq.EVENTS)
                if self._queued and events & zmq.POLLOUT:
                    self._flush()
                if not events & zmq.POLLIN:
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                try:
                    self._on_message(frames)
                except Exception:
                    log.exception("%s: message handler failed; message dropped", self.name)
        except zmq.ZMQError as e:
            if not self._closed:
                log.warning("%s: socket error: %s", self.name, e)

    def send(self, frames: list, copy: bool = False) -> None:
        """Queue ``frames`` as one message. Never blocks; see the class docstring for overflow."""
        if self._closed:
            return
        if self._queued:
            self._enqueue(frames, copy)
            return
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self._enqueue(frames, copy)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the peer of a ROUTER is gone
            self.dropped_sends += 1
            log.debug("%s: message dropped: %s", self.name, e)
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule_drain()

    @property
    def backlog(self) -> int:
        """Messages waiting in our queue because libzmq's is full (a slow or absent peer)."""
        return len(self._queued)

    def try_send(self, frames: list) -> bool:
        """Send now or not at all (no queueing): for messages that are repeated anyway, such as
        a hello retried until answered, where a backlog would only be stale copies."""
        if self._closed or self._queued:
            return False
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=True)
            sent = True
        except zmq.ZMQError:
            sent = False
        if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._schedule_drain()
        return sent

    def _enqueue(self, frames: list, copy: bool) -> None:
        if len(self._queued) >= MAX_QUEUED_SENDS:
            self.dropped_sends += 1
            self._drops.note(f"{len(self._queued)} messages wait for a slow peer")
            return
        self._queued.append((frames, copy))

    def _flush(self) -> None:
        while self._queued:
            frames, copy = self._queued[0]
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                self.dropped_sends += 1
                log.debug("%s: message dropped: %s", self.name, e)
            self._queued.popleft()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queued.clear()
        self._drops.close()
        try:
            self._loop.remove_reader(self._fd)
        except (RuntimeError, ValueError):
            pass  # the loop is already closed
        self.sock.close()


def make_run_dir() -> str:
    """A private directory for this supervisor's ipc socket files; its name carries our pid so a
    later supervisor can remove it if we were SIGKILLed before removing it ourselves."""
    remove_stale_run_dirs()
    return tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")


def remove_run_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_run_dirs() -> None:
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if not name.startswith(RUN_DIR_PREFIX):
            continue
        pid_text = name[len(RUN_DIR_PREFIX) :].split("-", 1)[0]
        path = os.path.join(base, name)
        try:
            owned = os.stat(path).st_uid == os.getuid()
        except OSError:
            continue
        if pid_text.isdigit() and owned and not pid_alive(int(pid_text)):
            remove_run_dir(path)
