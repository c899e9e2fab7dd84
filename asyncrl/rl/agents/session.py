"""What an agent's episode generated, token for token, and the training samples made from it.

A `Session` belongs to one episode. Each model call made through it (`SessionCall`) records the
prompt ids exactly as the chat template rendered them, the generated ids with the log-probs they
were sampled with, and the weight version the generation began under. Nothing is re-tokenised.

`assemble` turns the calls into samples. A call whose prompt extends an earlier sample's tokens
(its prompt and everything generated and appended since) token for token continues that sample:
the tokens in between (the closing of the model's turn, a tool result, the next user message, the
generation prompt) join it as context with mask 0 and log-prob 0.0, and the new generated tokens
as actions with mask 1. A call that extends no sample (the agent edited or dropped earlier
messages, a template rendered an earlier turn differently, a second conversation) starts a new
sample. Every sample of an episode gets the episode's reward (as AReaL and verl do).
"""

from __future__ import annotations

import msgspec


class SessionCall(msgspec.Struct, frozen=True):
    """One model call of a session: a prompt and the completion generated for it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str


class AgentSample(msgspec.Struct, frozen=True):
    """A training sample assembled from a session's calls: ``prompt_ids`` (the first call's prompt)
    then ``token_ids``, the model's tokens (mask 1, their sampling log-probs) and the context
    between its calls (mask 0, log-prob 0.0)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    action_mask: list[int]
    version: int
    """The oldest weight version any of its calls began under."""
    calls: int
    """Model calls merged into it."""


class Session:
    """The calls of one episode, in the order their generations finished."""

    def __init__(self, key: str, max_calls: int):
        self.key = key
        self.max_calls = max_calls
        self.calls: list[SessionCall] = []
        self.closed = False
        self.in_flight = 0  # calls generating now: an episode's samples are read after they end

    def record(self, call: SessionCall) -> None:
        if not self.closed:  # a call that finished after its episode ended is not trained on
            self.calls.append(call)


def assemble(calls: list[SessionCall]) -> list[AgentSample]:
    """The samples of a session (see the module docstring), in the order they were started."""
    open_: list[dict] = []
    for call in calls:
        into = None
        for sample in reversed(open_):  # the latest conversation first
            full = sample["prompt"] + sample["ids"]
            if len(call.prompt_ids) >= len(full) and call.prompt_ids[: len(full)] == full:
                into = sample
                break
        if into is None:
            open_.append(
                {
                    "prompt": list(call.prompt_ids),
                    "ids": list(call.token_ids),
                    "lps": list(call.logprobs),
                    "mask": [1] * len(call.token_ids),
                    "version": call.version,
                    "calls": 1,
                }
            )
            continue
        context = call.prompt_ids[len(into["prompt"]) + len(into["ids"]) :]
        into["ids"] += context + list(call.token_ids)
        into["lps"] += [0.0] * len(context) + list(call.logprobs)
        into["mask"] += [0] * len(context) + [1] * len(call.token_ids)
        into["version"] = min(into["version"], call.version)
        into["calls"] += 1
    return [AgentSample(s["prompt"], s["ids"], s["lps"], s["mask"], s["version"], s["calls"]) for s in open_]
