"""The OpenAI request bodies the endpoint accepts (typed: JSON decoded by msgspec into these, fields
it does not know ignored, nothing evaluated) and the ``chat.completion`` answer it builds."""

from __future__ import annotations

import secrets
import time
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


def chat_answer(completion: Completion, prompt_tokens: int, *, tools: bool, model: str = "",
                pieces: list[str] | None = None) -> dict[str, Any]:
    """The ``chat.completion`` object of ``completion``: its text as content, or where the request
    offered ``tools``, the ``<tool_call>`` blocks in it as ``tool_calls`` (finish reason
    "tool_calls") and the rest as content; ``pieces``: each token's text, to answer ``logprobs``."""
    content, calls = parse_tool_calls(completion.text) if tools else (completion.text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message,
                              "finish_reason": "tool_calls" if calls else completion.finish_reason}
    if pieces is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                          for t, lp in zip(pieces, completion.logprobs)]}
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model or MODEL_NAME, "choices": [choice], "usage": usage(prompt_tokens, completion)}


def usage(prompt_tokens: int, completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(completion.token_ids),
            "total_tokens": prompt_tokens + len(completion.token_ids)}
