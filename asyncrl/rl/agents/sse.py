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

    updates: asyncio.Queue = asyncio.Queue()
    stop = [body.stop] if isinstance(body.stop, str) else [s for s in body.stop or [] if s]
    texts = [TextStream(tokenizer, stop_token_ids, stop, chat and bool(body.tools)) for _ in range(body.n)]
    started = [False] * body.n  # a chat choice's first delta names the role
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.model or MODEL_NAME,
    }
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def send(event: dict) -> None:
        if not response.prepared:
            await response.prepare(request)
        await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")

    def choice(index: int, text: str, extra: dict | None = None, finish: str | None = None) -> dict:
        if not chat:
            return head | {
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish} | (extra or {})]
            }
        delta: dict[str, Any] = {"content": text} if text else {}
        if not started[index]:
            delta, started[index] = {"role": "assistant"} | delta, True
        return head | {
            "choices": [{"index": index, "delta": delta | (extra or {}), "logprobs": None, "finish_reason": finish}]
        }

    async def events() -> None:
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
                piece = texts[index].update(ids)
                if piece:
                    await send(choice(index, piece))
            try:
                whole = answer(generating.result())
            except Refused as exc:
                if not response.prepared:
                    raise
                await send({"error": {"message": str(exc), "type": exc.kind, "param": None, "code": exc.status}})
                return
        finally:  # done, or the client went away: its generation is not wanted any more
            generating.cancel()
            if waiting is not None:
                waiting.cancel()
        for index, final in enumerate(whole["choices"]):
            if chat:
                message = final["message"]
                rest = texts[index].finish(message["content"] or "")
                extra: dict[str, Any] = {}
                if message.get("tool_calls"):
                    extra["tool_calls"] = [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]
            else:
                rest, extra = texts[index].finish(final["text"]), {}
            if rest is None:  # cannot happen unless a backend decodes a prefix unlike the whole
                await send(
                    {
                        "error": {
                            "message": "the streamed text does not begin the answer's",
                            "type": "server_error",
                            "param": None,
                            "code": 500,
                        }
                    }
                )
                return
            event = choice(index, rest, extra)
            event["choices"][0]["logprobs"] = final.get("logprobs")
            await send(event)
            await send(choice(index, "", finish=final["finish_reason"]))
        await send(head | {"choices": [], "usage": whole["usage"]})
        await response.write(b"data: [DONE]\n\n")

    try:
        await events()
    except ConnectionError as exc:  # aiohttp's ClientConnectionResetError: the connection is closing
        log.debug("a streamed answer ended early, its connection closed (%s)", exc)
    return response
