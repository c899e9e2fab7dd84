"""`stream_answer`: a request with ``stream: true`` answered as server-sent events.

Each choice's text goes out as the backend generates it, in pieces no later token can change
(`TextStream`, ``stream.py``), then the rest of each answer, the usage and ``[DONE]``. The endpoint
(``server.py``) hands in the generation and the function that builds the whole answer.

A client that goes away mid-answer (its episode ended, its agent gave up) or a server that shuts
down under it is a normal end: the generation is stopped and one debug line says so, where
aiohttp would log a traceback for the write that finds the connection closed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from asyncrl.rl.agents.batcher import Progress
from asyncrl.rl.agents.refusal import Refused
from asyncrl.rl.agents.stream import TextStream
from asyncrl.rl.agents.wire import MODEL_NAME
from asyncrl.rl.generation import Completion

log = logging.getLogger(__name__)


async def stream_answer(
    request,
    body: Any,
    tokenizer: Any,
    stop_token_ids: list[int],
    generate: Callable[[Progress], Awaitable[list[Completion]]],
    answer: Callable[[list[Completion]], dict],
    *,
    chat: bool,
):
    """Server-sent events: each choice's text as the backend generates it (`TextStream`: only
    what no later token can change), then per choice the rest of its answer (with tool calls,
    log-probs) and its finish reason, the usage, ``[DONE]``. The response starts with the first
    piece of text, so a request refused before any (429, 504, a closed sampler) is answered
    with its status as without ``stream``; a failure after it is an ``error`` event. A connection
    that closes under it ends it quietly (see the module docstring).
    ``generate(progress)``: the request's generation, which tells ``progress(choice, ids)`` each
    choice's tokens as they come; ``answer``: the whole answer of its completions."""
    from aiohttp import web

    stop = [body.stop] if isinstance(body.stop, str) else [s for s in body.stop or [] if s]
    texts = [TextStream(tokenizer, stop_token_ids, stop, chat and bool(body.tools)) for _ in range(body.n)]
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.model or MODEL_NAME,
    }
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    events = _Events(request, response, head, texts, chat)
    try:
        whole = await events.stream(generate, answer)
        if whole is not None:
            await events.finish(whole)
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError: the connection is closing
        log.debug("a streamed answer ended early, its connection closed (%s)", exc)
    return response


class _Events:
    """The events of one streamed answer, written to its ``response``: chunks shaped as the API's
    (``head`` their common fields), a chat choice's first naming the role."""

    def __init__(self, request, response, head: dict, texts: list[TextStream], chat: bool) -> None:
        self.request, self.response, self.head, self.texts, self.chat = request, response, head, texts, chat
        self.started = [False] * len(texts)  # a chat choice's first delta names the role

    async def send(self, event: dict) -> None:
        if not self.response.prepared:
            await self.response.prepare(self.request)
        await self.response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")

    def choice(self, index: int, text: str, extra: dict | None = None, finish: str | None = None) -> dict:
        if not self.chat:
            return self.head | {
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish} | (extra or {})]
            }
        delta: dict[str, Any] = {"content": text} if text else {}
        if not self.started[index]:
            delta, self.started[index] = {"role": "assistant"} | delta, True
        return self.head | {
            "choices": [{"index": index, "delta": delta | (extra or {}), "logprobs": None, "finish_reason": finish}]
        }

    async def stream(
        self, generate: Callable[[Progress], Awaitable[list[Completion]]], answer: Callable[[list[Completion]], dict]
    ) -> dict | None:
        """Each choice's text as it is generated, then the whole answer; None where the answer was
        refused after the response started (said in an ``error`` event)."""
        updates: asyncio.Queue = asyncio.Queue()
        generating = asyncio.ensure_future(generate(lambda c, ids: updates.put_nowait((c, ids))))
        waiting: asyncio.Future | None = None
        try:
            while not generating.done() or not updates.empty():
                if updates.empty():
                    waiting = asyncio.ensure_future(updates.get())
                    await asyncio.wait({waiting, generating}, return_when=asyncio.FIRST_COMPLETED)
                    if not waiting.done():
                        continue
                    index, ids = waiting.result()
                else:
                    index, ids = updates.get_nowait()
                piece = self.texts[index].update(ids)
                if piece:
                    await self.send(self.choice(index, piece))
            try:
                return answer(generating.result())
            except Refused as exc:
                if not self.response.prepared:
                    raise
                await self.send(_error(str(exc), exc.kind, exc.status))
                return None
        finally:  # done, or the client went away: its generation is not wanted any more
            generating.cancel()
            if waiting is not None:
                waiting.cancel()

    async def finish(self, whole: dict) -> None:
        """Per choice the rest of its answer and its finish reason, then the usage and ``[DONE]``."""
        for index, final in enumerate(whole["choices"]):
            rest, extra = self._rest(index, final)
            if rest is None:  # cannot happen unless a backend decodes a prefix unlike the whole
                await self.send(_error("the streamed text does not begin the answer's", "server_error", 500))
                return
            event = self.choice(index, rest, extra)
            event["choices"][0]["logprobs"] = final.get("logprobs")
            await self.send(event)
            await self.send(self.choice(index, "", finish=final["finish_reason"]))
        await self.send(self.head | {"choices": [], "usage": whole["usage"]})
        await self.response.write(b"data: [DONE]\n\n")

    def _rest(self, index: int, final: dict) -> tuple[str | None, dict[str, Any]]:
        """What choice ``index``'s stream has not sent of its ``final`` answer, and (chat) its tool calls."""
        if not self.chat:
            return self.texts[index].finish(final["text"]), {}
        message = final["message"]
        rest = self.texts[index].finish(message["content"] or "")
        extra: dict[str, Any] = {}
        if message.get("tool_calls"):
            extra["tool_calls"] = [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]
        return rest, extra


def _error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
