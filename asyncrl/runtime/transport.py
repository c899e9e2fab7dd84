"""ZeroMQ sockets as the runtime uses them: bounded, explicit addresses, no lingering, one loop.

Addresses: ``ipc://`` inside a host (files in a private 0700 run directory), ``tcp://host:port``
across hosts, always authenticated (CURVE, see ``cluster/auth.py``): the helpers below refuse a ``tcp://``
endpoint without keys. Every socket has bounded high-water marks and every send queue is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from asyncrl.runtime.throttled_log import ThrottledLog

if TYPE_CHECKING:
    from asyncrl.runtime.cluster.auth import ClusterKeys, Gatekeeper

DEFAULT_HWM = 1000
MAX_QUEUED_SENDS = 100_000
RETRY_S = 0.05
"""How often a send queue is retried while a message waits for its peer's pipe (see `LoopSocket`)."""
RUN_DIR_PREFIX = "asyncrl-"

log = logging.getLogger("asyncrl.transport")


def configure(sock: zmq.Socket, hwm: int = DEFAULT_HWM, linger_ms: int = 0) -> zmq.Socket:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


def bind_router(
    ctx: zmq.Context, bind: str, hwm: int = DEFAULT_HWM, gate: Gatekeeper | None = None
) -> tuple[zmq.Socket, str]:
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
    ctx: zmq.Context, connect: str, hwm: int = DEFAULT_HWM, linger_ms: int = 0, keys: ClusterKeys | None = None
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

    When libzmq refuses a send (high-water mark reached), frames wait in an ordered queue of their
    peer's (a ROUTER's routing id; a DEALER has one), so a peer that sends and never reads holds up
    its own replies only, never another caller's (one queue for all once stalled an actor's every
    caller behind one flooding peer). libzmq tells when the socket can send, not when one peer's
    pipe has room, so while anything waits it is retried every ``RETRY_S`` as well. The queues
    are bounded by ``MAX_QUEUED_SENDS`` together, and what overflows them is dropped, counted in
    ``dropped_sends`` and logged (`ThrottledLog`: a peer that never reads overflows them once per
    message)."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list], None], name: str):
        self.sock = sock
        self.name = name
        self.dropped_sends = 0
        self._drops = ThrottledLog(log, f"{name}: dropped", "a message", "messages")
        self._on_message = on_message
        self._routed = sock.getsockopt(zmq.TYPE) == zmq.ROUTER
        self._queues: dict[bytes | None, collections.deque] = {}  # per peer, in the order sent
        self._waiting = 0  # messages in all the queues
        self._retry: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._fd = int(sock.getsockopt(zmq.FD))  # int(): the stub allows any option's type
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
                events = int(sock.getsockopt(zmq.EVENTS))
                if self._queues and events & zmq.POLLOUT:
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
        peer = self._peer(frames)
        if peer in self._queues:  # behind what already waits for this peer: its order is kept
            self._enqueue(peer, frames, copy)
        else:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                self._enqueue(peer, frames, copy)
            except zmq.ZMQError as e:  # EHOSTUNREACH: the peer of a ROUTER is gone
                self.dropped_sends += 1
                log.debug("%s: message dropped: %s", self.name, e)
        if int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._schedule_drain()

    @property
    def backlog(self) -> int:
        """Messages waiting in our queues because libzmq's are full (slow or absent peers)."""
        return self._waiting

    def _peer(self, frames: list) -> bytes | None:
        return bytes(frames[0]) if self._routed else None

    def try_send(self, frames: list) -> bool:
        """Send now or not at all (no queueing): for messages that are repeated anyway, such as
        a hello retried until answered, where a backlog would only be stale copies."""
        if self._closed or self._peer(frames) in self._queues:
            return False
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=True)
            sent = True
        except zmq.ZMQError:
            sent = False
        if int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._schedule_drain()
        return sent

    def _enqueue(self, peer: bytes | None, frames: list, copy: bool) -> None:
        if self._waiting >= MAX_QUEUED_SENDS:
            self.dropped_sends += 1
            self._drops.note(f"{self._waiting} messages wait for slow peers")
            return
        self._queues.setdefault(peer, collections.deque()).append((frames, copy))
        self._waiting += 1
        self._arm_retry()

    def _flush(self) -> None:
        """Send what waits, each peer's queue in order until its pipe is full again."""
        for peer in list(self._queues):
            queue = self._queues[peer]
            while queue:
                frames, copy = queue[0]
                try:
                    self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:  # the peer is gone: what waits for it goes too, one by one
                    self.dropped_sends += 1
                    log.debug("%s: message dropped: %s", self.name, e)
                queue.popleft()
                self._waiting -= 1
            if not queue:
                del self._queues[peer]
        if self._queues:
            self._arm_retry()

    def _arm_retry(self) -> None:
        if self._retry is None and not self._closed:
            self._retry = self._loop.call_later(RETRY_S, self._on_retry)

    def _on_retry(self) -> None:
        self._retry = None
        if not self._closed:
            self._flush()
            self._schedule_drain()  # a send re-checks for input; so does this

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._queues.clear()
        self._waiting = 0
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
