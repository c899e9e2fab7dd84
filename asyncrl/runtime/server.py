"""The actor side of RPC: a ROUTER that decodes calls, runs endpoints, and sends replies.

Invariant: a request that can be attributed to a call (it decoded far enough to have an ``id``)
always gets exactly one terminal answer (``Reply``, ``StreamEnd`` or ``Failure``) unless the caller
cancelled it; a request that cannot is answered with ``Failure(id=0)``. Every refusal is counted in
``bad_requests``; the first is logged in full, those that follow are summed up every few seconds
(`ThrottledLog`: a peer sending junk in a loop must not flood the console). Requests are decoded and
validated in the socket's readiness callback; each ``async`` endpoint call then runs as its own task.
Nothing a caller sends can stop the actor.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from asyncrl.errors import InvalidArgumentsError, MessageTooLargeError, ProtocolError, UnknownMethodError, type_path
from asyncrl.runtime import wire
from asyncrl.runtime.actor import EndpointSpec, endpoints_of
from asyncrl.runtime.codec import PayloadEncoder, frames_nbytes
from asyncrl.runtime.throttled_log import ThrottledLog
from asyncrl.runtime.timeouts import timeout
from asyncrl.runtime.transport import LoopSocket

log = logging.getLogger("asyncrl.server")

STREAM_WINDOW = 32
"""Items a stream may send ahead of the caller's credit; bounds buffering on both sides."""


class _Stream:
    __slots__ = ("credit", "wake")

    def __init__(self) -> None:
        self.credit = STREAM_WINDOW
        self.wake = asyncio.Event()


class ActorServer:
    def __init__(
        self,
        actor: Any,
        name: str,
        sock: zmq.Socket,
        max_message_bytes: int,
        stream_idle_timeout_s: float = 300.0,
    ) -> None:
        self.actor = actor
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.specs = endpoints_of(type(actor))
        self.bad_requests = 0
        self.refusals = ThrottledLog(log, f"actor {name}: refused", "a request", "requests")
        self._tasks: dict[tuple[bytes, int], asyncio.Task] = {}
        self._streams: dict[tuple[bytes, int], _Stream] = {}
        self._decoder = msgspec.msgpack.Decoder(wire.ToActor)
        self._body = msgspec.msgpack.Encoder()
        self._payload = PayloadEncoder()
        self.sock = LoopSocket(sock, self._dispatch, f"actor {name}")

    # --- receiving ---------------------------------------------------------------------------

    def _dispatch(self, frames: list) -> None:
        ident, parts = frames[0].bytes, frames[1:]
        if not parts:
            return self._bad(ident, 0, ProtocolError, "empty message")
        try:
            msg = self._decoder.decode(parts[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:  # bad UTF-8: not a DecodeError
            return self._bad(ident, 0, ProtocolError, f"undecodable request: {e}")
        size = len(parts[0]) if len(parts) == 1 else frames_nbytes(parts)
        if size > self.max_message_bytes:
            return self._bad(
                ident,
                msg.id,
                MessageTooLargeError,
                f"request of {size} bytes exceeds max_message_bytes={self.max_message_bytes}",
            )
        if isinstance(msg, wire.Call):
            self._start_call(ident, msg, parts)
        elif isinstance(msg, wire.Cancel):
            task = self._tasks.get((ident, msg.id))
            if task is not None:
                task.cancel()
        else:  # StreamCredit
            stream = self._streams.get((ident, msg.id))
            if stream is not None and msg.n > 0:
                stream.credit += msg.n
                stream.wake.set()

    def _bad(self, ident: bytes, call_id: int, error: type[Exception], message: str) -> None:
        self.bad_requests += 1
        self.refusals.note(message)
        self._send(ident, wire.Failure(call_id, error.__name__, message, type_path=type_path(error)))

    def _start_call(self, ident: bytes, msg: wire.Call, parts: list) -> None:
        spec = self.specs.get(msg.method)
        if spec is None:
            known = ", ".join(sorted(self.specs)) or "none"
            return self._bad(ident, msg.id, UnknownMethodError, f"no endpoint {msg.method!r} (endpoints: {known})")
        try:
            args = spec.arg_decoder.decode(msg.args, parts)
        except msgspec.ValidationError as e:
            return self._bad(ident, msg.id, InvalidArgumentsError, spec.explain(e))
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            return self._bad(ident, msg.id, ProtocolError, f"{spec.name}(): malformed arguments: {e}")
        key = (ident, msg.id)
        if key in self._tasks:
            return self._bad(ident, msg.id, ProtocolError, f"call id {msg.id} is already in flight")
        method = getattr(self.actor, spec.name)
        if not spec.is_async:
            try:
                result = spec.invoke(method, args)
            except Exception as e:
                return self._send(ident, _failure(msg.id, e))
            self._reply(ident, msg.id, spec, result)
            return
        if spec.is_stream:
            coro = self._run_stream(ident, msg.id, spec, spec.invoke(method, args))
        else:
            coro = self._run_call(ident, msg.id, spec, method, args)
        task = asyncio.ensure_future(coro)
        self._tasks[key] = task
        task.add_done_callback(lambda _t: self._tasks.pop(key, None))

    # --- running -----------------------------------------------------------------------------

    async def _run_call(self, ident: bytes, call_id: int, spec: EndpointSpec, method, args) -> None:
        try:
            result = await spec.invoke(method, args)
        except asyncio.CancelledError:
            return  # the caller cancelled; it expects no answer
        except Exception as e:
            return self._send(ident, _failure(call_id, e))
        self._reply(ident, call_id, spec, result)

    def _reply(self, ident: bytes, call_id: int, spec: EndpointSpec, result: Any, item: bool = False) -> bool:
        try:
            bufs: list = []
            value = self._payload.encode(result, bufs, first_index=1)
        except Exception as e:
            self._send(ident, _failure(call_id, e, f"{spec.name}(): cannot send the result: "))
            return False
        self._send(ident, (wire.StreamItem if item else wire.Reply)(call_id, value), bufs)
        return True

    async def _run_stream(self, ident: bytes, call_id: int, spec: EndpointSpec, agen) -> None:
        key = (ident, call_id)
        stream = self._streams[key] = _Stream()
        try:
            async for item in agen:
                while stream.credit <= 0:
                    stream.wake.clear()
                    try:
                        async with timeout(self.stream_idle_timeout_s):
                            await stream.wake.wait()
                    except asyncio.TimeoutError:
                        log.warning(
                            "actor %s: stream %s() abandoned: no credit from its caller in %gs",
                            self.name,
                            spec.name,
                            self.stream_idle_timeout_s,
                        )
                        return
                stream.credit -= 1
                if not self._reply(ident, call_id, spec, item, item=True):
                    return
        except asyncio.CancelledError:
            return
        except Exception as e:
            return self._send(ident, _failure(call_id, e))
        finally:
            self._streams.pop(key, None)
            await agen.aclose()
        self._send(ident, wire.StreamEnd(call_id))

    def _send(self, ident: bytes, msg: Any, bufs: Sequence[Any] = ()) -> None:
        body = self._body.encode(msg)
        size = len(body) + frames_nbytes(bufs) if bufs else len(body)
        if size > self.max_message_bytes:
            msg = wire.Failure(
                msg.id,
                MessageTooLargeError.__name__,
                f"reply of {size} bytes exceeds max_message_bytes={self.max_message_bytes}",
                type_path=type_path(MessageTooLargeError),
            )
            body, bufs = self._body.encode(msg), ()
        self.sock.send([ident, body, *bufs], copy=not bufs)

    async def close(self) -> None:
        """Cancel calls in flight, wait for them to unwind, close the socket."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.refusals.close()
        self.sock.close()


def _failure(call_id: int, e: BaseException, prefix: str = "") -> wire.Failure:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return wire.Failure(call_id, type(e).__name__, prefix + str(e), tb, type_path(type(e)))
