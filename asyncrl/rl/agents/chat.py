"""OpenAI chat messages in and out of a chat template: rendering a request's messages (and its
``tools``) into the prompt token ids the model is given, and reading tool calls out of the model's
text into OpenAI ``tool_calls``.

Rendering is the tokenizer's own chat template (``apply_chat_template``), so ``tool`` messages and
``tools`` are written the way the model was trained to read them. Tool calls are read in the
Hermes / Qwen form those templates teach, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
or for the embedded model's tokenizer the compact form its template writes
(`asyncrl.rl.model.tokenizer.agent_chat_template`), ``<tool_call>NAME KEY=VALUE</tool_call>`` or
``<tool_call>NAME {...}</tool_call>``; JSON is parsed with ``json`` (never evaluated), and a
block that is not a well-formed call stays in the text as ordinary content. A block's JSON ends
where the JSON does, not at the first ``</tool_call>``: a string argument may hold that text.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, cast

from asyncrl.errors import AsyncrlError

COMPACT_CALLS = "{#- asyncrl: compact tool calls, v1 -#}"
"""The comment that marks a chat template writing the embedded agent template's compact call form
(`asyncrl.rl.model.tokenizer.agent_chat_template`): it travels with the template in a saved
checkpoint, so the endpoint reads a GRPO run's saved embedded model's calls in that form too. (A
change to the form changes the mark.) Defined here, where the form is read back."""


def compact_calls(tokenizer: Any) -> bool:
    """The tokenizer's chat template writes tool calls in the compact form (`COMPACT_CALLS`)."""
    return COMPACT_CALLS in (getattr(tokenizer, "chat_template", None) or "")


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s*")


def _skip_space(text: str, at: int) -> int:
    """``at`` past the whitespace there (``\\s*`` matches at any place, the empty match included)."""
    return cast(re.Match[str], _SPACE.match(text, at)).end()


_JSON = json.JSONDecoder()
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # a function name as OpenAI allows it (and dotted ones)
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRequestError(AsyncrlError, ValueError):
    """A request's messages or tools cannot be rendered; the message says which and why (HTTP 400)."""


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool = True,
) -> list[int]:
    """The prompt token ids of a chat request: the template's rendering of ``messages`` (OpenAI
    form) and ``tools`` with the generation prompt (unless ``generation_prompt`` is False: a whole
    conversation, as the warm start renders a demonstration), tokenised without added specials
    (the template writes its own)."""
    converted = [_template_message(i, m) for i, m in enumerate(messages)]
    if not converted:
        raise ChatRequestError("messages is empty")
    if not getattr(tokenizer, "chat_template", None):
        raise ChatRequestError("this model has no chat template: use /v1/completions with a prompt")
    try:
        text = tokenizer.apply_chat_template(
            converted, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as exc:  # the template's raise_exception, or a message it cannot take
        raise ChatRequestError(f"the chat template refused the messages: {type(exc).__name__}: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _template_message(index: int, message: Any) -> dict[str, Any]:
    """An OpenAI message as chat templates take it: text content as a string (a list of text
    parts joined), an assistant's ``tool_calls`` with their arguments as a dict where they are a
    JSON object (templates write ``arguments | tojson``)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ChatRequestError(f"message {index} must be an object with a role in {ROLES}, not {message!r:.80}")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatRequestError(f"message {index}: only text content parts are served, not {part!r:.80}")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ChatRequestError(f"message {index}: content must be a string or a list of text parts")
    out: dict[str, Any] = {"role": message["role"], "content": content}
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ChatRequestError(f"message {index}: tool_calls must be a list")
        out["tool_calls"] = [_template_call(index, c) for c in calls]
    return out


def _template_call(index: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatRequestError(f"message {index}: a tool call needs a function with a name, not {call!r:.80}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def parse_tool_calls(text: str, *, compact: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a model's answer: each well-formed ``<tool_call>`` block
    becomes an OpenAI tool call (its arguments as a JSON string) and leaves the content; the rest
    of the text, stripped, is the content. ``compact``: the blocks are in the embedded template's
    compact form (`compact_calls` says which a tokenizer writes)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = at = 0
    read = _compact_call if compact else _tool_call
    while (at := text.find(_OPEN, at)) >= 0:
        found = read(text, _skip_space(text, at + len(_OPEN)))
        if found is None:  # not a call we understand: it stays in the content as written
            at += len(_OPEN)
            continue
        call, end = found
        kept.append(text[last:at])
        last = at = end
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _closed(text: str, at: int) -> int | None:
    """The end of the ``</tool_call>`` at ``at`` (after whitespace), or None where none is."""
    at = _skip_space(text, at)
    return at + len(_CLOSE) if text.startswith(_CLOSE, at) else None


def _json_at(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value that starts at ``at`` and where it ends, or None."""
    try:
        return _JSON.raw_decode(text, at)
    except ValueError:
        return None


def _tool_call(text: str, at: int) -> tuple[dict[str, Any], int] | None:
    """Hermes's ``{"name": ..., "arguments": ...}`` at ``at``, closed: (the call, where its block ends)."""
    found = _json_at(text, at)
    if found is None or (end := _closed(text, found[1])) is None:
        return None
    value = found[0]
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    call = _call(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
    return call, end


def _compact_call(text: str, at: int) -> tuple[dict[str, Any], int] | None:
    """``NAME KEY=VALUE`` (one string argument, the value verbatim up to the closing tag, which the
    template writes only for a value without one) or ``NAME ARGUMENTS`` (a JSON object, or a JSON
    string for arguments that are not an object), as the template writes them, at ``at``."""
    name = _NAME.match(text, at)
    if name is None or not text.startswith(" ", name.end()):
        return None
    rest = name.end() + 1
    equals = text.find("=", rest)
    if equals >= 0 and text[rest:equals].isidentifier():  # no tag can be inside an identifier
        close = text.find(_CLOSE, equals)
        if close < 0:
            return None
        value = text[equals + 1 : close].rstrip()
        return _call(name.group(), json.dumps({text[rest:equals]: value}, ensure_ascii=False)), close + len(_CLOSE)
    found = _json_at(text, _skip_space(text, rest))
    if found is None or (end := _closed(text, found[1])) is None:
        return None
    arguments = found[0]
    if isinstance(arguments, dict):
        return _call(name.group(), json.dumps(arguments, ensure_ascii=False)), end
    return (_call(name.group(), arguments), end) if isinstance(arguments, str) else None


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
