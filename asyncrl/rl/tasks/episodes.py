"""The episode runner: problems in, scored samples out, for a single-turn `Task` and a multi-turn
`Environment` alike, over any generation function (the sampler's backend, the trainer's HF model).

A single-turn task is one ``generate`` call of ``n`` completions per prompt, then one ``score``
call per completion. An environment's episode alternates model turns and environment replies::

    prompt | model turn 1 | reply 1 | model turn 2 | reply 2 | ... | model turn k

Every turn of every open episode goes into one ``generate`` call (turn 1: ``n`` per prompt;
later turns: each episode's whole context, one completion each), so a backend batches them and
vLLM's prefix cache reuses each context's earlier turns. After each model turn `Environment.step`
answers; the episode ends when it says ``done``, or truncated after ``max_turns`` model turns or
when the next turn would not fit ``max_context`` positions. The model's tokens keep their
behaviour log-probs and mask 1; the replies' tokens (`PromptFormat.reply_ids`) are context:
log-prob 0.0, mask 0. `step` gets the turn's text as the backends decode it (no final stop token,
special tokens skipped), ending with the stop string where one ended the turn (a tool call's
closing tag). A turn's ``max_new_tokens`` is the caller's, capped by what fits the context.

Seeds: turn 1 is called with the caller's ``params`` (plus the environment's stop strings), as a
single-turn task is; each later call gets a seed derived from ``(seed, turn, token budget)``, so
a seeded run repeats exactly.

User code (score, step) runs through `UserCalls`: a call that raises, hangs or returns a bad
value gives reward 0 and its error kind (a failed step ends its episode). The runner never calls
`UserCalls.check`: its owner decides when too many failures stop the run.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgspec

from asyncrl.rl.generation import Completion, SamplingParams, VersionSpan, row_seed
from asyncrl.rl.tasks.base import (
    Environment,
    Episode,
    Message,
    Prompt,
    Reply,
    Task,
    TaskInputError,
    as_prompt,
    as_score,
)
from asyncrl.rl.tasks.scoring import Outcome, UserCalls

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Generate = Callable[[list[list[int]], int, SamplingParams], Awaitable[list[list[Completion]]]]
"""``generate(prompts, n, params)``: ``n`` completions per token-id prompt, in prompt order (a
`SamplerBackend.generate`, or a closure over one)."""


class PromptRenderer(Protocol):
    """What the runner needs of a policy's prompt format (`asyncrl.rl.model.policy.PromptFormat`)."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    def render_ids(self, prompt: Prompt) -> list[int]: ...

    def reply_ids(
        self, prompt: Prompt, turns: list[Message], reply: Reply, model_stopped_on_token: bool
    ) -> list[int]: ...


class Sample(msgspec.Struct):
    """One scored completion (single-turn) or episode (multi-turn) of a problem."""

    token_ids: list[int]
    """Everything after the prompt: the model's tokens and, in an episode, the environment's."""
    logprobs: list[float]
    """Behaviour log-prob of each token; 0.0 at the environment's tokens."""
    text: str
    """The model's text: the completion's; for an episode the turns' texts (the model's and the
    environment's replies) concatenated."""
    reward: float
    correct: bool
    finish_reason: str
    """Of the (last) model turn: "stop" or "length"."""
    action_mask: list[int] = []
    """Per token, 1 for the model's and 0 for the environment's; [] when all are the model's."""
    metrics: dict[str, float] = {}
    """The task's metrics; an episode's also count its model ``turns`` and ``episodes_truncated`` (0/1)."""
    error: str = ""
    """The error kind of a failed score or step ("raised", "timeout", "bad_value"), else ""."""
    version_spans: list[VersionSpan] = []
    """The weight versions its tokens were sampled under (`Completion.version_spans`; an
    environment's tokens take the version of the turn before them); [] where not known."""


class EpisodeRunner:
    """Runs a task's problems into `Sample`s with a caller's ``generate``. ``max_turns``: model
    turns per episode (0: the environment's ``max_turns``); ``max_context``: the model's positions,
    prompt included (0: no limit), which an episode's turns must fit."""

    def __init__(self, task: Task, fmt: PromptRenderer, calls: UserCalls, *, max_turns: int = 0, max_context: int = 0):
        for name, value in (("max_turns", max_turns), ("max_context", max_context)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0 (0: the default), not {value!r}")
        self.task, self.fmt, self.calls = task, fmt, calls
        self.max_context = max_context
        env = task if isinstance(task, Environment) else None
        self.environment = env is not None
        self.max_turns = max_turns or (int(env.max_turns) if env is not None else 1)
        self.stop = list(env.stop) if env is not None else []
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise TaskInputError(f"environment {task.task_name()}: stop must be non-empty strings, not {self.stop!r}")

    async def run(
        self,
        problems: list,
        n: int,
        params: SamplingParams,
        generate: Generate,
        prompt_ids: list[list[int]] | None = None,
    ) -> list[list[Sample]]:
        """``n`` samples per problem, in problem order. ``prompt_ids``: each problem's rendered
        prompt where the caller has it (`render_ids` of the task's prompt otherwise). Raises what
        ``generate`` raises, and `TaskFailureError` when the task's calls leave no worker."""
        if n < 1:
            raise ValueError(f"n must be >= 1, not {n}")
        if prompt_ids is None:
            prompt_ids = [self.fmt.render_ids(as_prompt(self.task.prompt(p))) for p in problems]
        if len(prompt_ids) != len(problems):
            raise ValueError(f"{len(prompt_ids)} prompt_ids for {len(problems)} problems")
        if not problems:
            return []
        if not self.environment:
            return await self._single_turn(problems, n, params, generate, prompt_ids)
        return await self._episodes(problems, n, params, generate, prompt_ids)

    # --- single turn ------------------------------------------------------------------------------

    async def _single_turn(self, problems, n, params, generate, prompt_ids) -> list[list[Sample]]:
        groups = _checked(await generate(prompt_ids, n, params), len(problems), n)
        convert = partial(as_score, correct_reward=self.task.correct_reward)
        outcomes = await asyncio.gather(
            *(
                self.calls.call(self.task.score, p, c.text, what="score", convert=convert)
                for p, g in zip(problems, groups)
                for c in g
            )
        )
        samples = [_scored(c, o) for g, os in zip(groups, _chunks(outcomes, n)) for c, o in zip(g, os)]
        return _chunks(samples, n)

    # --- episodes ---------------------------------------------------------------------------------

    async def _episodes(self, problems, n, params, generate, prompt_ids) -> list[list[Sample]]:
        stop = list(params.stop) + [s for s in self.stop if s not in params.stop]
        params = msgspec.structs.replace(params, stop=stop)
        runs = []
        for problem, ids in zip(problems, prompt_ids):
            prompt = as_prompt(self.task.prompt(problem))
            runs += [_Run(problem, prompt, list(ids)) for _ in range(n)]
        open_runs, turn = runs, 1
        while open_runs:
            fitting = []
            for r in open_runs:
                if self._room(r, params) > 0:
                    fitting.append(r)
                else:  # only a prompt that fills the context gets here: `_answer` keeps room for a turn
                    self._truncate(r)
            completions = await self._turn(turn, fitting, n if turn == 1 else 1, params, generate)
            replies = await asyncio.gather(*(self._step(r, c, params) for r, c in zip(fitting, completions)))
            open_runs = [r for r, reply in zip(fitting, replies) if self._answer(r, reply)]
            turn += 1
        return _chunks([r.sample for r in runs], n)

    def _room(self, r: _Run, params: SamplingParams) -> int:
        """New tokens the run's next turn may have: ``max_new_tokens``, capped by the context."""
        if not self.max_context:
            return params.max_new_tokens
        return min(params.max_new_tokens, self.max_context - len(r.prompt_ids) - len(r.ids))

    async def _turn(
        self, turn: int, runs: list[_Run], n: int, params: SamplingParams, generate: Generate
    ) -> list[Completion]:
        """One model turn of ``runs``: one ``generate`` call per distinct token budget (one in all,
        unless some contexts are near ``max_context``). Turn 1 gives ``n`` completions per prompt
        (the ``n`` runs of a problem are adjacent); later turns one per run's context."""
        heads = runs[::n]  # turn 1: one per problem
        by_room: dict[int, list[int]] = {}
        for i, r in enumerate(heads):
            by_room.setdefault(self._room(r, params), []).append(i)
        calls = []
        for room, indices in by_room.items():
            # Turn 1 with one budget is exactly a single-turn task's call; any other derives its
            # seed from (seed, turn, budget), so a seeded run repeats whatever the batching.
            same = turn == 1 and room == params.max_new_tokens
            seed = params.seed if params.seed is None or same else row_seed(params.seed, turn, room)
            turn_params = msgspec.structs.replace(params, max_new_tokens=room, seed=seed)
            contexts = [heads[i].prompt_ids + heads[i].ids for i in indices]
            calls.append(generate(contexts, n, turn_params))
        results = await asyncio.gather(*calls)
        out: list[Completion | None] = [None] * len(runs)
        for indices, groups in zip(by_room.values(), results):
            for i, group in zip(indices, _checked(groups, len(indices), n)):
                out[i * n : (i + 1) * n] = group
        return cast(list[Completion], out)  # every run's place was filled above

    async def _step(self, r: _Run, c: Completion, params: SamplingParams) -> Outcome:
        text = self._turn_text(c, params)
        r.spans = join_spans(r.spans, c.version_spans, len(r.ids))
        r.ids += c.token_ids
        r.logprobs += c.logprobs
        r.mask += [1] * len(c.token_ids)
        r.texts.append(text)
        r.finish_reason = c.finish_reason
        r.stopped_on_token = _on_stop_token(c, params)
        r.add_turn(Message("assistant", text))
        convert = partial(as_reply, task=self.task)
        return await self.calls.call(self._env.step, r.episode, text, what="step", convert=convert)

    def _answer(self, r: _Run, outcome: Outcome) -> bool:
        """Apply the environment's answer; True while the episode goes on."""
        if outcome.error:
            r.finish(0.0, False, {}, outcome.error)
            return False
        reply: Reply = outcome.value
        _add(r.metrics, reply.metrics)
        if reply.done:
            correct = reply.correct if reply.correct is not None else reply.reward >= self.task.correct_reward
            r.finish(float(reply.reward), bool(correct), {"episodes_truncated": 0.0})
            return False
        if r.model_turns >= self.max_turns:
            self._truncate(r)
            return False
        ids = self.fmt.reply_ids(r.prompt, list(r.turns), reply, r.stopped_on_token)
        if self.max_context and len(r.prompt_ids) + len(r.ids) + len(ids) >= self.max_context:
            self._truncate(r)  # no room left for a token of the next turn
            return False
        r.ids += ids
        r.logprobs += [0.0] * len(ids)
        r.mask += [0] * len(ids)
        r.texts.append(reply.text)
        r.add_turn(Message(reply.role, reply.text))
        return True

    def _truncate(self, r: _Run) -> None:
        r.finish(float(self._env.truncated_reward), False, {"episodes_truncated": 1.0})

    @property
    def _env(self) -> Environment:
        """The task as the environment it is: only an environment's episodes take a step or run
        out of turns (a single-turn task's end with its one completion)."""
        return cast(Environment, self.task)

    def _turn_text(self, c: Completion, params: SamplingParams) -> str:
        """The turn's text as step() gets it: the completion's, and where a stop string ended the
        turn, that string too (the backends cut their text before it)."""
        if c.finish_reason != "stop" or not params.stop or _on_stop_token(c, params):
            return c.text
        full = self.fmt.tokenizer.decode(c.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        end = _first_stop_end(full, params.stop)
        return c.text if end is None else full[:end]


class _Run:
    """One episode in progress: its tokens after the prompt, and its `Sample` once finished."""

    def __init__(self, problem: Any, prompt: Prompt, prompt_ids: list[int]):
        self.prompt, self.prompt_ids = prompt, prompt_ids
        self.episode = Episode(problem, prompt)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.spans: list[VersionSpan] = []
        self.texts: list[str] = []
        self.turns: list[Message] = []  # ours: step() may change episode.turns, the context may not
        self.model_turns = 0
        self.metrics: dict[str, float] = {}
        self.finish_reason = "length"
        self.stopped_on_token = False
        self.sample: Sample | None = None

    def add_turn(self, message: Message) -> None:
        self.turns.append(message)
        self.episode.turns.append(message)
        self.model_turns += message.role == "assistant"

    def finish(self, reward: float, correct: bool, metrics: dict[str, float], error: str = "") -> None:
        _add(self.metrics, metrics)
        self.metrics["turns"] = float(self.model_turns)
        self.metrics.setdefault("episodes_truncated", 0.0)
        self.sample = Sample(
            self.ids,
            self.logprobs,
            "".join(self.texts),
            reward,
            correct,
            self.finish_reason,
            action_mask=self.mask,
            metrics=self.metrics,
            error=error,
            version_spans=self.spans,
        )


def as_reply(value: Any, task: Task) -> Reply:
    """An `Environment.step` result checked: a `Reply` with string text and role, a finite
    reward, a bool or None for correct, finite numbers for metrics; `TaskInputError` otherwise."""
    if not isinstance(value, Reply):
        raise TaskInputError(f"step() must return a Reply, not {type(value).__name__}")
    if not isinstance(value.text, str) or not isinstance(value.role, str) or not value.role:
        raise TaskInputError(f"step() returned a Reply whose text or role is not a string: {value!r:.120}")
    if value.correct is not None and not isinstance(value.correct, bool):
        raise TaskInputError(f"step() returned correct={value.correct!r}, not a bool or None")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TaskInputError(f"step() returned a reward of {reward!r}, not a finite number")
    if not isinstance(value.metrics, dict):
        raise TaskInputError(f"step() returned metrics {value.metrics!r:.80}, not a dict")
    metrics = {}
    for k, v in value.metrics.items():
        if not isinstance(k, str) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise TaskInputError(f"step() metric {k!r} is {v!r}, not a finite number")
        metrics[k] = float(v)
    return msgspec.structs.replace(value, reward=float(reward), metrics=metrics)


def _scored(c: Completion, o: Outcome) -> Sample:
    if o.error:
        return Sample(
            c.token_ids, c.logprobs, c.text, 0.0, False, c.finish_reason, error=o.error, version_spans=c.version_spans
        )
    return Sample(
        c.token_ids,
        c.logprobs,
        c.text,
        o.value.reward,
        bool(o.value.correct),
        c.finish_reason,
        metrics=dict(o.value.metrics),
        version_spans=c.version_spans,
    )


def join_spans(spans: list[VersionSpan], turn: list[VersionSpan], offset: int) -> list[VersionSpan]:
    """An episode's version spans with a turn's (``turn``, its tokens from ``offset`` on) after
    them; a span of the version already running is not repeated."""
    out = list(spans)
    for span in turn:
        if not out or out[-1].version != span.version:
            out.append(VersionSpan(span.start + offset, span.version))
    return out


def _checked(groups: list[list[Completion]], prompts: int, n: int) -> list[list[Completion]]:
    if len(groups) != prompts or any(len(g) != n for g in groups):
        raise ValueError(f"generate returned {[len(g) for g in groups]} completions for {prompts} prompts of {n} each")
    return groups


def _chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def _add(into: dict[str, float], metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        into[key] = into.get(key, 0.0) + float(value)


def _on_stop_token(c: Completion, params: SamplingParams) -> bool:
    return bool(c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in params.stop_token_ids)


def _first_stop_end(text: str, stops: list[str]) -> int | None:
    """Where the stop string that completes first in ``text`` ends (vLLM's choice), or None."""
    ends = [at + len(s) for s in stops if (at := text.find(s)) >= 0]
    return min(ends) if ends else None
