"""Agents: a task whose episodes are the user's own code talking to the policy through the OpenAI API.

An agent is an async function ``agent(problem, client)``: ``client`` is an ``openai.AsyncOpenAI``
whose ``base_url`` is this episode's session on the sampler's endpoint; the agent calls
``client.chat.completions.create(...)`` as often as it likes (tools, its own message list, its
own loop) and returns the episode's reward, a number or a `Score`. The tokens the model generated
through the session are what is trained (``asyncrl/rl/agents/``); the agent's text is never
re-tokenised.

Two spellings, both ``--task.name``:
- ``my_agent.py:my_agent``, an async function: its problems are the rows of ``--task.data``
  (`FunctionAgent` wraps it);
- ``my_agent.py:MyAgent``, a subclass of `Agent` with ``async def run(self, problem, client)``,
  for an agent that makes its own problems (``problems()``/``splits()``, as any `Task`).

The whole episode is one call of the user's code under ``--task.score_timeout_s`` and the
failure budget (`UserCalls`): an agent that raises, hangs or returns no number scores 0, is
counted, and loses its episode only.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from asyncrl.rl.tasks.base import Score, Task, TaskError, TaskInputError, default_fingerprint

AgentFunction = Callable[[Any, Any], Awaitable[float | Score]]


class Agent(Task[Any]):
    """A task run by an agent: override `run` (and `problems` or `splits` where the problems are
    not the rows of ``--task.data``)."""

    max_calls: int = 16  # a class default an instance may override (`load_task`: --task.max_turns)
    """Model calls an episode may make; past them its session answers 429 (an agent in a loop)."""

    async def run(self, problem: Any, client: Any) -> float | Score:
        """One episode: talk to the policy through ``client`` (an ``openai.AsyncOpenAI``) and
        return the reward."""
        raise NotImplementedError(f"agent {self.task_name()} must define async run(problem, client)")

    # An agent's demonstration is a conversation (OpenAI messages), not a task's completion or turns:
    # its own warm start reads it (`agent_demonstration_row`), never the single-turn path.
    def demonstration(self, problem: Any) -> list[dict[str, Any]] | None:  # type: ignore[override]
        """What a perfect agent's episode says for ``problem``, for the embedded model's warm start:
        the conversation as OpenAI messages (``user``, ``assistant`` with ``content`` and/or
        ``tool_calls``, ``tool``, ...), rendered through the embedded model's chat template as the
        endpoint renders the episode's calls; the ``assistant`` messages are trained on, the rest
        is context. None: the agent has none (then the run needs ``--model_path``)."""
        return None

    def fingerprint(self) -> dict[str, Any]:
        """The name, the options and three problems' demonstrations (an agent has no prompt()),
        and the data files' digests: what the warm start's cache key needs."""
        return default_fingerprint(self, prompts=False)

    def prompt(self, problem: Any) -> str:
        raise TaskError(f"agent {self.task_name()}: an agent writes its own prompts; it has no prompt()")

    def score(self, problem: Any, completion: str) -> float:
        raise TaskError(f"agent {self.task_name()}: episodes are scored by run(), not score()")


class FunctionAgent(Agent):
    """An `Agent` made from an async function ``fn(problem, client)``; problems from ``--task.data``."""

    function: ClassVar[AgentFunction]

    @classmethod
    def of(cls, fn: AgentFunction) -> type[FunctionAgent]:
        if not inspect.iscoroutinefunction(fn):
            raise TaskInputError(
                f"{getattr(fn, '__qualname__', fn)!r} is not an async function: an agent is "
                "`async def agent(problem, client)`"
            )
        name = getattr(fn, "__name__", "agent")
        return type(f"FunctionAgent_{name}", (cls,), {"function": staticmethod(fn), "name": name})

    async def run(self, problem: Any, client: Any) -> float | Score:
        return await type(self).function(problem, client)
