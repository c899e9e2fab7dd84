"""Solve rates (and the task's metrics) of a policy on a task's problems, sampled or greedy, with
transformers' ``generate`` (the warm start's check and the trainer's held-out evaluation).

Episodes run through the same `EpisodeRunner` the samplers use (``tasks/episodes.py``), so a
multi-turn environment is evaluated turn by turn exactly as it is trained, and a task's score
runs under the same deadlines; only the generation differs: `hf_generate`, batched and
left-padded ``model.generate``. A task's evaluation keeps no log-probs (it needs none); an
agent's keeps them as the samplers do (``sampling.py``), so its endpoint answers ``logprobs``
and ``top_logprobs`` as a sampler's does and the agent behaves alike in training and evaluation.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from asyncrl.errors import AsyncrlError
from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.model.policy import PromptFormat
from asyncrl.rl.model.sampling import StepLogprobs
from asyncrl.rl.tasks.agent import Agent
from asyncrl.rl.tasks.base import Task
from asyncrl.rl.tasks.scoring import UserCalls, failure_kinds


class StoppedError(AsyncrlError):
    """A warm start or an evaluation was stopped (its ``stop`` event set) before it finished."""


def check_stop(stop: threading.Event | None, what: str = "the warm start of the default model") -> None:
    if stop is not None and stop.is_set():
        raise StoppedError(f"{what} was stopped before it finished")


class Evaluation(NamedTuple):
    """What an evaluation found."""

    solve_rate: float
    """Fraction of the episodes the task found correct."""
    metrics: dict[str, float]
    """The task's metrics (an environment's ``turns`` and ``episodes_truncated`` too), each a mean
    over the episodes (an episode without one counts 0), as the training steps report them."""
    errors: dict[str, int]
    """Failed user calls (score, step) by error kind; {} when none failed."""
    failures: dict[str, int] = {}
    """An agent's failed episodes by kind, one line each (`scoring.failure_kinds`: ``raised
    openai.BadRequestError: Error code: 400 - ...``) -> how many; {} when none failed or the task
    is not an agent (a failed score or step is counted in ``errors`` alone)."""


def evaluate(
    model,
    tokenizer,
    fmt: PromptFormat,
    problems: Sequence[Any],
    *,
    task: Task,
    greedy: bool = True,
    n: int = 1,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    temperature: float = 1.0,
    stop: threading.Event | None = None,
    calls: UserCalls | None = None,
    score_timeout_s: float = 10.0,
    max_context: int = 0,
) -> Evaluation:
    """``n`` episodes per problem of ``task``: the share it finds correct, its metrics, the failures.

    Greedy decoding, or pure sampling at ``temperature`` (no top-k / top-p: the distribution GRPO
    samples from), ``batch_size`` sequences per ``generate`` call. ``stop``: checked before each
    call; once set, raises `StoppedError`. Blocking: call it from a thread, not an event loop.

    ``calls``: the task's calls under the run's deadline and failure budget, as in the samplers
    (`UserCalls` with ``stop_early``: past the budget it raises `TaskFailureError` at once, naming
    the task and the first failure, instead of scoring every remaining problem 0, one deadline per
    hung worker at a time). None: calls of its own under ``score_timeout_s`` with no budget,
    failures scoring 0 (the warm start's check).
    """
    from asyncrl.rl.tasks.episodes import EpisodeRunner

    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, not {n} and {batch_size}")
    if greedy and n > 1:
        raise ValueError("greedy decoding gives the same completion n times; use n=1 or greedy=False")
    if not problems:
        return Evaluation(0.0, {}, {})
    params = SamplingParams(
        max_new_tokens=max_new_tokens or fmt.max_new_tokens_hint,
        temperature=0.0 if greedy else temperature,
        stop_token_ids=list(fmt.stop_token_ids),
    )
    own = calls is None
    if own:  # failures score 0 here, as in training; an agent's whole episode is one call
        calls = UserCalls(task.task_name(), score_timeout_s, max_failure_rate=1.0, workers=max(16, len(problems) * n))
    agent = isinstance(task, Agent)
    generate = hf_generate(model, tokenizer, fmt, batch_size, stop, logprobs=agent)
    try:
        if agent:
            return asyncio.run(
                _agent_evaluation(task, list(problems), n, params, generate, tokenizer, calls, max_context)
            )
        runner = EpisodeRunner(task, fmt, calls, max_context=max_context)
        groups = asyncio.run(runner.run(list(problems), n, params, generate))
    finally:
        if own:
            calls.close()
    samples = [s for g in groups for s in g]
    sums: dict[str, float] = {}
    errors: dict[str, int] = {}
    for s in samples:
        for key, value in s.metrics.items():
            sums[key] = sums.get(key, 0.0) + value
        if s.error:
            errors[s.error] = errors.get(s.error, 0) + 1
    return Evaluation(
        sum(s.correct for s in samples) / len(samples), {k: v / len(samples) for k, v in sorted(sums.items())}, errors
    )


def solve_rate(model, tokenizer, fmt: PromptFormat, problems: Sequence[Any], **kwargs: Any) -> float:
    """`evaluate`'s solve rate alone."""
    return evaluate(model, tokenizer, fmt, problems, **kwargs).solve_rate


async def _agent_evaluation(
    task: Agent, problems: list, n: int, params: SamplingParams, generate, tokenizer, calls, max_context: int
) -> Evaluation:
    """An agent's episodes against an endpoint of their own over ``generate`` (sampling ``params``,
    so greedy where asked), as the samplers run them: the share scored correct, the means of the
    metrics of their `Score`s (a failed episode counts 0) and the failures by kind, and by what
    they were (`failure_kinds`)."""
    from asyncrl.rl.agents.runner import AgentRunner
    from asyncrl.rl.agents.server import OpenAIServer

    async def versioned(prompts, k, p, progress=None):
        # model.generate blocks: on a thread of its own (one at a time: the endpoint gathers
        # requests into one call), so the loop keeps accepting and answering the agents. It
        # reports no tokens as they come: a stream gets each answer whole at its end.
        return 0, await asyncio.to_thread(lambda: asyncio.run(generate(prompts, k, p)))

    server = OpenAIServer(versioned, tokenizer, params, max_context=max_context, max_calls=task.max_calls)
    await server.start()
    try:
        episodes = await AgentRunner(task, server, calls).episodes(problems, n)
    finally:
        await server.close()
    sums: dict[str, float] = {}
    errors: dict[str, int] = {}
    for _, outcome in episodes:
        if outcome.error:
            errors[outcome.error] = errors.get(outcome.error, 0) + 1
            continue
        for key, value in outcome.value.metrics.items():
            sums[key] = sums.get(key, 0.0) + value
    return Evaluation(
        sum(not o.error and bool(o.value.correct) for _, o in episodes) / len(episodes),
        {k: v / len(episodes) for k, v in sorted(sums.items())},
        errors,
        failure_kinds(o for _, o in episodes),
    )


def hf_generate(
    model, tokenizer, fmt: PromptFormat, batch_size: int, stop: threading.Event | None = None, *, logprobs: bool = False
):
    """A `Generate` (tasks/episodes.py) over ``model.generate``: rows prompt-major (sample j of
    prompt i is row ``i * n + j``), ``batch_size`` rows per call, in order. ``logprobs``: each
    token's sampling log-prob and the ``params.top_logprobs`` likeliest tokens, as the samplers
    give them (`StepLogprobs`); else log-probs are 0 and no alternatives are kept."""

    async def generate(prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        rows = [p for p in prompts for _ in range(n)]
        done: list[Completion] = []
        for i in range(0, len(rows), batch_size):
            check_stop(stop)
            done += _generate_rows(model, tokenizer, fmt, rows[i : i + batch_size], params, logprobs)
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    return generate


@torch.no_grad()
def _generate_rows(
    model, tokenizer, fmt: PromptFormat, prompts: list[list[int]], params: SamplingParams, logprobs: bool = False
) -> list[Completion]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else fmt.stop_token_ids[0]
    width = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every completion starts at column `width`
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    greedy = params.temperature == 0
    sampling = {} if greedy else {"temperature": params.temperature, "top_k": 0, "top_p": params.top_p}
    if params.stop:  # transformers' own stop strings: a row that wrote one stops there
        sampling.update(stop_strings=list(params.stop), tokenizer=tokenizer)
    from transformers import LogitsProcessorList

    steps = StepLogprobs(params.temperature, params.top_p, params.top_logprobs) if logprobs else None
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=not greedy,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=params.stop_token_ids,
        pad_token_id=pad,
        logits_processor=LogitsProcessorList([steps] if steps is not None else []),
        **sampling,
    )
    generated = out[:, width:]
    lps, tops = steps.rows(generated) if steps is not None else (None, None)
    return [
        _completion(tokenizer, row, params, pad, lps[i] if lps else None, tops[i] if tops else None)
        for i, row in enumerate(generated.tolist())
    ]


def _completion(
    tokenizer,
    row: list[int],
    params: SamplingParams,
    pad: int,
    logprobs: list[float] | None = None,
    top: list | None = None,
) -> Completion:
    """One generated row as a `Completion`: cut after its first stop token, else after the token
    that completed a stop string, else with the padding of an early finish removed; ``logprobs``
    and ``top`` (per token of ``row``) cut with it (None: log-probs of 0)."""
    cut = next((j for j, t in enumerate(row) if t in params.stop_token_ids), None)
    if cut is not None:
        ids, reason = row[: cut + 1], "stop"
        text = tokenizer.decode(row[:cut], skip_special_tokens=True)
    else:
        ids, reason = row, "length"
        if params.stop:
            end = _stop_string_end(tokenizer, row, params.stop)
            if end is not None:
                ids, reason = row[:end], "stop"
        while len(ids) > 1 and ids[-1] == pad and reason == "length":
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if reason == "stop":  # as the backends give it: the text ends before the stop string
            hit = min((text.find(s) for s in params.stop if s in text), default=len(text))
            text = text[:hit]
    kept = logprobs[: len(ids)] if logprobs is not None else [0.0] * len(ids)
    return Completion(ids, kept, text, reason, top_logprobs=(top or [])[: len(ids)])


def _stop_string_end(tokenizer, row: list[int], stops: list[str]) -> int | None:
    """The fewest leading tokens of ``row`` whose text holds a stop string (a prefix's text only
    grows, so the search halves), or None."""

    def holds(k: int) -> bool:
        text = tokenizer.decode(row[:k], skip_special_tokens=True)
        return any(s in text for s in stops)

    if not holds(len(row)):
        return None
    lo, hi = 1, len(row)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    return lo
