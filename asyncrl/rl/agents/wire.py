"""The OpenAI request bodies the endpoint accepts (typed: JSON decoded by msgspec into these, fields
it does not know ignored, nothing evaluated) and the ``chat.completion`` answer it builds."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.rl.agents.chat import parse_tool_calls
from asyncrl.rl.generation import Completion

MODEL_NAME = "policy"
"""The name ``/v1/models`` gives the sampler's policy."""


class ChatRequest(msgspec.Struct, kw_only=True):
    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool = False


class CompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str | list[int]
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False


LOWEST_LOGPROB = -9999.0
"""What JSON carries for a log-prob of -inf (a token outside the top-p nucleus), as vLLM's server does."""

Piece = Callable[[int], str]
"""A token's text (``tokenizer.decode([id])``, special tokens kept)."""


def chat_answer(
    completions: list[Completion],
    prompt_tokens: int,
    *,
    tools: bool,
    compact: bool = False,
    model: str = "",
    piece: Piece | None = None,
) -> dict[str, Any]:
    """The ``chat.completion`` object of ``completions`` (one choice each): a completion's text as
    content, or where the request offered ``tools``, the ``<tool_call>`` blocks in it as
    ``tool_calls`` (finish reason "tool_calls"; ``compact``: in the embedded template's form) and
    the rest as content; with ``piece`` (the request asked ``logprobs``) each token's sampling
    log-prob and its `Completion.top_logprobs`."""
    choices = []
    for index, completion in enumerate(completions):
        content, calls = parse_tool_calls(completion.text, compact=compact) if tools else (completion.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": "tool_calls" if calls else completion.finish_reason,
        }
        if piece is not None:
            choice["logprobs"] = {"content": chat_logprobs(completion, piece)}
        choices.append(choice)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model or MODEL_NAME,
        "choices": choices,
        "usage": usage(prompt_tokens, completions),
    }


def text_answer(
    completions: list[Completion], prompt_tokens: int, *, model: str = "", piece: Piece | None = None
) -> dict[str, Any]:
    """The ``text_completion`` object of ``completions`` (one choice each); with ``piece`` (the
    request asked ``logprobs``) each choice's legacy ``logprobs`` object."""
    choices = [
        {
            "index": i,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": None if piece is None else completion_logprobs(c, piece),
        }
        for i, c in enumerate(completions)
    ]
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model or MODEL_NAME,
        "choices": choices,
        "usage": usage(prompt_tokens, completions),
    }


def chat_logprobs(completion: Completion, piece: Piece, start: int = 0, end: int | None = None) -> list[dict]:
    """The ``logprobs.content`` entries of ``completion``'s tokens ``start:end``."""
    tops = completion.top_logprobs or [[]] * len(completion.token_ids)
    return [
        _entry(piece(token), lp) | {"top_logprobs": [_entry(piece(t), v) for t, v in top]}
        for token, lp, top in zip(completion.token_ids[start:end], completion.logprobs[start:end], tops[start:end])
    ]


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": max(logprob, LOWEST_LOGPROB), "bytes": list(text.encode())}


def completion_logprobs(completion: Completion, piece: Piece) -> dict[str, Any]:
    """The legacy ``/v1/completions`` ``logprobs`` object: tokens, their log-probs, their text
    offsets, and per token a dict of its alternatives' text and log-probs (None without them)."""
    pieces = [piece(t) for t in completion.token_ids]
    offsets, at = [], 0
    for text in pieces:
        offsets.append(at)
        at += len(text)
    tops = None
    if completion.top_logprobs:
        tops = [{piece(t): max(v, LOWEST_LOGPROB) for t, v in top} for top in completion.top_logprobs]
    return {
        "tokens": pieces,
        "token_logprobs": [max(v, LOWEST_LOGPROB) for v in completion.logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completions: list[Completion]) -> dict[str, int]:
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}
