"""`TextStream`: the text of a completion as its tokens come, in pieces that never need taking back.

A stream (``stream: true``) sends each choice's text as the backend generates it. What has been
sent cannot be withdrawn, so a piece goes out only once no later token can change it: the text
before any stop string (and any tail that could still grow into one), without a trailing partial
UTF-8 character (decoded as U+FFFD until its last byte comes), and where the request offered
tools, before any ``<tool_call>`` (a call is sent whole once parsed) with the whitespace the
answer's content is stripped of held back. The final answer's text then extends what was sent,
and the last piece is the rest of it (`finish`).
"""

from __future__ import annotations

from typing import Any

TOOL_CALL_OPEN = "<tool_call>"


class TextStream:
    """One choice's text as it grows. ``tokenizer``: decodes as the backends do (special tokens
    skipped); ``stop_token_ids``: a last token among them is not text; ``stops``: the request's
    stop strings; ``tools``: the request offered tools (content is read around ``<tool_call>``)."""

    def __init__(self, tokenizer: Any, stop_token_ids: list[int], stops: list[str], tools: bool):
        self.tokenizer, self.stop_token_ids, self.tools = tokenizer, set(stop_token_ids), tools
        self.holds = [*stops, *([TOOL_CALL_OPEN] if tools else [])]
        self.sent = ""

    def update(self, token_ids: list[int]) -> str:
        """The new piece of text for the tokens generated so far ("" if none can go out yet)."""
        if token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        safe = self._settled(text)
        if not safe.startswith(self.sent):  # tokens generated again (a discarded batch): wait for the answer
            return ""
        piece, self.sent = safe[len(self.sent) :], safe
        return piece

    def finish(self, final: str) -> str | None:
        """The rest of the answer's ``final`` text after what was sent; None if it does not extend it."""
        if not final.startswith(self.sent):
            return None
        rest, self.sent = final[len(self.sent) :], final
        return rest

    def _settled(self, text: str) -> str:
        for hold in self.holds:
            at = text.find(hold)
            if at >= 0:
                text = text[:at]
        tail = max((k for hold in self.holds for k in range(1, len(hold)) if text.endswith(hold[:k])), default=0)
        text = text[: len(text) - tail].rstrip("\ufffd")
        return text.strip() if self.tools else text
