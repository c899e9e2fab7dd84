"""The caller side of RPC to one actor incarnation: a DEALER, a reader task, pending calls by id.

Invariant: every pending call ends, exactly once, with its reply, its deadline
(``CallTimeoutError``, after which a ``Cancel`` is sent), or ``fail_all`` (the supervisor saw the
actor die), whichever comes first. Nothing waits on the socket without one of those armed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq

from asyncrl.errors import CallTimeoutError, MessageTooLargeError, ProtocolError, remote_error_class
from asyncrl.runtime import wire
from asyncrl.runtime.actor import EndpointSpec
from asyncrl.runtime.cluster.auth import ClusterKeys
from asyncrl.runtime.codec import PayloadEncoder, frames_nbytes
from asyncrl.runtime.server import STREAM_WINDOW
from asyncrl.runtime.timeouts import timeout
from asyncrl.runtime.transport import LoopSocket, connect_dealer

log = logging.getLogger("asyncrl.client")

_END = object()


class _Pending:
    __slots__ = ("future", "method", "queue")

    def __init__(self, future: asyncio.Future | None, method: str, queue: asyncio.Queue | None = None):
        self.future = future
        self.method = method
        self.queue = queue


class ActorClient:
    def __init__(
        self, ctx: zmq.Context, actor: str, address: str, max_message_bytes: int, keys: ClusterKeys | None = None
    ) -> None:
        self.actor = actor
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._failed: BaseException | None = None
        self._decoder = msgspec.msgpack.Decoder(wire.FromActor)
        self._body = msgspec.msgpack.Encoder()
        self._payload = PayloadEncoder()
        self._sock = LoopSocket(connect_dealer(ctx, address, keys=keys), self._on_message, f"client of {actor}")

    # --- sending -----------------------------------------------------------------------------

    def _send_call(self, spec: EndpointSpec, args: tuple, kwargs: dict, pending: _Pending) -> int:
        if self._failed is not None:
            raise self._failed
        bufs: list = []
        payload = self._payload.encode(spec.bind(args, kwargs), bufs, first_index=1)
        call_id = next(self._ids)
        body = self._body.encode(wire.Call(call_id, spec.name, payload))
        size = len(body) + (frames_nbytes(bufs) if bufs else 0)
        if size > self.max_message_bytes:
            raise MessageTooLargeError(
                f"call {spec.name}() to actor {self.actor!r} is {size} bytes, "
                f"over max_message_bytes={self.max_message_bytes}"
            )
        self._pending[call_id] = pending
        self._sock.send([body, *bufs], copy=not bufs)
        return call_id

    def _cancel(self, call_id: int) -> None:
        self._pending.pop(call_id, None)
        if self._failed is None:
            self._sock.send([self._body.encode(wire.Cancel(call_id))], copy=True)

    async def call(self, spec: EndpointSpec, args: tuple, kwargs: dict, timeout_s: float) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = self._send_call(spec, args, kwargs, _Pending(future, spec.name))
        timer = loop.call_later(timeout_s, _expire, future, self.actor, spec.name, timeout_s)
        try:
            value, frames = await future
        except (CallTimeoutError, asyncio.CancelledError):
            self._cancel(call_id)
            raise
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)
        return self._decode_result(spec, value, frames)

    def _decode_result(self, spec: EndpointSpec, value, frames: list) -> Any:
        try:
            return spec.return_decoder.decode(value, frames)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
            raise ProtocolError(
                f"actor {self.actor!r}: {spec.name}() returned a value that does not match its annotation: {e}"
            ) from None

    async def stream(self, spec: EndpointSpec, args: tuple, kwargs: dict, timeout_s: float) -> AsyncIterator[Any]:
        """Items of a streaming endpoint; ``timeout_s`` bounds the wait for each item."""
        # Unbounded type, bounded content: the actor sends at most STREAM_WINDOW items beyond the
        # credit we have granted, and we grant credit only for items already taken off this queue.
        queue: asyncio.Queue = asyncio.Queue()
        call_id = self._send_call(spec, args, kwargs, _Pending(None, spec.name, queue))
        consumed = 0
        finished = False
        try:
            while True:
                try:
                    # Not wait_for: on Python 3.11 it swallows a cancel that comes as the item does,
                    # and a consumer told to stop (a pump at the end of a run) would go on reading.
                    async with timeout(timeout_s):
                        item = await queue.get()
                except TimeoutError:
                    raise CallTimeoutError(self.actor, f"{spec.name}() (next stream item)", timeout_s) from None
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                value, frames = item
                yield self._decode_result(spec, value, frames)
                consumed += 1
                if consumed >= STREAM_WINDOW // 2 and self._failed is None:
                    self._sock.send([self._body.encode(wire.StreamCredit(call_id, consumed))], copy=True)
                    consumed = 0
        finally:
            if finished:
                self._pending.pop(call_id, None)
            else:
                self._cancel(call_id)

    # --- receiving ---------------------------------------------------------------------------

    def _on_message(self, frames: list) -> None:
        try:
            msg = self._decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("actor %s sent an undecodable reply (%s); dropped", self.actor, e)
            return
        pending = self._pending.get(msg.id)
        if pending is None:
            if isinstance(msg, wire.Failure) and msg.id == 0:
                log.warning("actor %s refused a request: %s", self.actor, msg.message)
            return  # an answer to a call we already gave up on
        # A call has its future, a stream its queue: a reply of the other kind is not ours to take.
        if isinstance(msg, wire.Reply):
            if pending.future is not None and not pending.future.done():
                pending.future.set_result((msg.value, frames))
        elif isinstance(msg, wire.StreamItem):
            if pending.queue is not None:
                pending.queue.put_nowait((msg.value, frames))
        elif isinstance(msg, wire.StreamEnd):
            if pending.queue is not None:
                pending.queue.put_nowait(_END)
        else:  # Failure
            error = _remote_error(self.actor, pending.method, msg)
            if pending.queue is not None:
                pending.queue.put_nowait(error)
            elif pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)

    # --- failure -----------------------------------------------------------------------------

    def fail_all(self, error: BaseException) -> None:
        """The actor is gone: fail every pending call with ``error`` and refuse new ones."""
        if self._failed is not None:
            return
        self._failed = error
        for pending in self._pending.values():
            if pending.queue is not None:
                pending.queue.put_nowait(error)
            elif pending.future is not None and not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()
        self.close()

    def close(self) -> None:
        self._sock.close()

    @property
    def failed(self) -> BaseException | None:
        return self._failed


def _expire(future: asyncio.Future, actor: str, method: str, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(CallTimeoutError(actor, method, timeout_s))


def _remote_error(actor: str, method: str, msg: wire.Failure) -> Exception:
    return remote_error_class(msg.type_name, msg.type_path)(actor, method, msg.type_name, msg.message, msg.traceback)
