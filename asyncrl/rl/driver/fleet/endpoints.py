"""`sampler_endpoints`: each live sampler's OpenAI endpoint, for code outside a run's episodes.

An agent's episodes get a session's ``base_url`` and the token with their client; anyone else
(an evaluation script, a notebook beside the run) asks the run: ``asyncrl status RUN_DIR
--endpoint`` sends the status socket's ``endpoint`` command, which calls every sampler in or
coming to the group (`SamplerActor.openai_endpoint`: started on the first ask) and answers each
one's root ``base_url`` and token. The token is as secret as the run's status socket, whose
directory (mode 0700) lets only the run's owner connect; it travels nowhere else and is written
to no file.
"""

from __future__ import annotations

from asyncrl.errors import ActionableError, first_line
from asyncrl.rl.driver.fleet.calls import call_all
from asyncrl.rl.driver.fleet.membership import Membership, MemberState

ENDPOINT_S = 30.0
"""How long a sampler may take to answer (its endpoint starts on the first ask: a second or so)."""


class EndpointUnavailableError(ActionableError):
    """No sampler can be asked for its endpoint yet; the message says when to ask."""


async def sampler_endpoints(membership: Membership | None, args: dict[str, object]) -> dict[str, object]:
    """The status socket's ``endpoint`` command: ``{"endpoints": [{"sampler", "base_url",
    "token"} or {"sampler", "error"}, ...]}``, one per sampler in or coming to the group."""
    if args:
        raise EndpointUnavailableError(f"endpoint takes no arguments (got {', '.join(sorted(args))})")
    members = membership.with_state(MemberState.JOINED, MemberState.CANDIDATE) if membership is not None else []
    if not members:
        raise EndpointUnavailableError(
            "no sampler is up yet (or none is left): ask again once asyncrl status shows one running"
        )
    answers = await call_all(
        [m.handle for m in members],
        lambda h, i: h.openai_endpoint(),
        timeout_s=ENDPOINT_S,
        what="the OpenAI endpoint's start",
    )
    return {
        "endpoints": [
            {"sampler": name, "error": first_line(got)}
            if isinstance(got, BaseException)
            else {"sampler": name, "base_url": got["base_url"], "token": got["token"]}
            for name, got in zip(answers.names, answers.results)
        ]
    }
