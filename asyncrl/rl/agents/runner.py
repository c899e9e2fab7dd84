"""`AgentRunner`: an `Agent`'s episodes, each in a session of its own, into rollout groups.

For every episode the runner opens a session on the endpoint (`OpenAIServer.open_session`),
hands the agent an ``openai.AsyncOpenAI`` client whose ``base_url`` is that session's and whose
key is the endpoint's token, and runs ``agent.run(problem, client)`` through `UserCalls` (the
deadline and failure budget of every user call). When the episode ends, however it ends, the
session is closed (a late answer is no longer recorded) and its calls become samples
(`assemble`), each with the episode's reward; an agent that raised or hung scores 0, its error
counted, as a failed environment step does.

A group is one problem's samples over its ``n`` episodes. They share the longest common prefix
of their first prompts as the group's prompt; the rest of each sample's first prompt becomes
context (mask 0) at the head of its completion, so each sample's tokens are exactly what the
model was given and generated. An episode that made no model call gives no sample; a problem
none of whose episodes did gives no group.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, NamedTuple

from asyncrl.rl.agents.server import OpenAIServer
from asyncrl.rl.agents.session import AgentSample, assemble
from asyncrl.rl.tasks.agent import Agent
from asyncrl.rl.tasks.base import as_score
from asyncrl.rl.tasks.episodes import Sample
from asyncrl.rl.tasks.scoring import Outcome, UserCalls


class AgentGroup(NamedTuple):
    """One problem's samples: the prompt they share, each sample's tokens after it, and the
    oldest weight version any of their tokens was generated under."""

    prompt_ids: list[int]
    samples: list[Sample]
    version: int


class AgentRunner:
    """Runs ``agent``'s episodes against ``server`` with ``calls`` (the task's `UserCalls`)."""

    def __init__(self, agent: Agent, server: OpenAIServer, calls: UserCalls):
        self.agent, self.server, self.calls = agent, server, calls

    async def run(self, problems: list[Any], n: int) -> list[AgentGroup | None]:
        """``n`` episodes per problem, all at once; per problem its group (None: no model call)."""
        episodes = await self.episodes(problems, n)
        return [
            _group([(s, o) for samples, o in episodes[i * n : (i + 1) * n] for s in samples])
            for i in range(len(problems))
        ]

    async def episodes(self, problems: list[Any], n: int) -> list[tuple[list[AgentSample], Outcome]]:
        """``n`` episodes per problem, all at once, problem-major: each one's samples and outcome
        (its `Score` as ``value`` unless ``error``)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, not {n}")
        return list(await asyncio.gather(*(self.episode(p) for p in problems for _ in range(n))))

    async def episode(self, problem: Any) -> tuple[list[AgentSample], Outcome]:
        """One episode: its samples and its outcome."""
        session = self.server.open_session()
        client = self.server.client(session.key)
        try:
            convert = partial(as_score, correct_reward=self.agent.correct_reward)
            outcome = await self.calls.call(self.agent.run, problem, client, what="agent", convert=convert)
        finally:
            self.server.close_session(session.key)
            await client.close()
        return assemble(session.calls), outcome


def _group(episodes: list[tuple[AgentSample, Outcome]]) -> AgentGroup | None:
    if not episodes:
        return None
    first = [s.prompt_ids for s, _ in episodes]
    shared = _common_prefix(first)
    if shared == 0:  # prompts that share not even a first token: keep those like the first one's
        episodes = [e for e in episodes if e[0].prompt_ids[0] == first[0][0]]
        shared = _common_prefix([s.prompt_ids for s, _ in episodes])
    samples = []
    for sample, outcome in episodes:
        head = sample.prompt_ids[shared:]
        score = outcome.value
        metrics = {"calls": float(sample.calls)}
        if not outcome.error:
            metrics.update(score.metrics)
        samples.append(
            Sample(
                token_ids=head + sample.token_ids,
                logprobs=[0.0] * len(head) + sample.logprobs,
                text="",
                reward=0.0 if outcome.error else score.reward,
                correct=False if outcome.error else bool(score.correct),
                finish_reason="stop",
                action_mask=[0] * len(head) + sample.action_mask,
                metrics=metrics,
                error=outcome.error,
            )
        )
    return AgentGroup(episodes[0][0].prompt_ids[:shared], samples, min(s.version for s, _ in episodes))


def _common_prefix(rows: list[list[int]]) -> int:
    length = min(len(r) for r in rows)
    for i in range(length):
        token = rows[0][i]
        if any(r[i] != token for r in rows):
            return i
    return length
