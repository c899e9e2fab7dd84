"""The endpoint's refusals: `Refused`, a request answered with an OpenAI-style error body instead
of a generation (`error_response`); a body that does not decode into its typed struct is refused
(`decode_body`). `json_response` is every JSON answer, a refusal's or a generation's.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Refused(Exception):
    """A request answered with an OpenAI-style error body: ``kind`` its ``type``, ``code`` its
    ``code`` where OpenAI gives one an agent can test (``context_length_exceeded``)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


async def decode_body(request, kind: type) -> Any:
    raw = await request.read()  # aiohttp answers 413 itself past client_max_size
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Refused(400, f"bad request body: {exc}") from None


def json_response(value: dict, status: int = 200):
    from aiohttp import web

    return web.Response(body=msgspec.json.encode(value), status=status, content_type="application/json")


def error_response(status: int, message: str, kind: str, code: str | None = None):
    return json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)
