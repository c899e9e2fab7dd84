"""Solve rates (and the task's metrics) of a policy on a task's problems, sampled or greedy: one
evaluator (`evaluate_with`) over any generation function, the `Generate` of ``tasks/episodes.py``.

Two generations feed it: `hf_generate`, batched and left-padded ``model.generate``, for the warm
start's check and the trainer's held-out evaluation (`evaluate`, blocking); and a sampler's own
backend, for the held-out evaluation on the samplers (``rl/model/heldout.py``). Episodes run
through the same `EpisodeRunner` the samplers use, so a multi-turn environment is evaluated turn
by turn exactly as it is trained, and a task's score runs under the same deadlines; an agent runs
against an endpoint of its own over the generation. The problems are solved in parts of
``chunk`` (each told to ``on_part`` as it ends, as a `Tally`: sums, so parts solved anywhere add
up exactly), ``at_once`` parts at a time. A task's evaluation keeps no log-probs (it needs none);
an agent's keeps them as the samplers do (``sampling.py``), so its endpoint answers ``logprobs``
and ``top_logprobs`` as a sampler's does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from asyncrl.errors import AsyncrlError
from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.model.policy import PromptFormat
from asyncrl.rl.model.sampling import StepLogprobs
from asyncrl.rl.model.tally import Tally
from asyncrl.rl.tasks.agent import Agent
from asyncrl.rl.tasks.base import Task
from asyncrl.rl.tasks.scoring import UserCalls, failure_kinds

if TYPE_CHECKING:
    from asyncrl.rl.tasks.episodes import Generate

OnPart = Callable[[range, Tally], None]
"""``on_part(positions, tally)``: the problems at ``positions`` (of the evaluation's list) are
solved, and their episodes add up to ``tally``."""


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
    chunk: int = 0,
    on_part: OnPart | None = None,
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

    ``chunk``: problems per part, one part after the other (0: all in one), each told to
    ``on_part`` when solved (`evaluate_with`). A part of whole batches (``chunk * n`` a multiple
    of ``batch_size``) makes the same ``generate`` calls, in the same order, as one part would.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    return asyncio.run(
        evaluate_with(
            hf_generate_for(task, model, tokenizer, fmt, batch_size, stop),
            fmt,
            problems,
            task=task,
            greedy=greedy,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            calls=calls,
            score_timeout_s=score_timeout_s,
            max_context=max_context,
            chunk=chunk,
            on_part=on_part,
        )
    )


async def evaluate_with(
    generate: Generate,
    fmt: PromptFormat,
    problems: Sequence[Any],
    *,
    task: Task,
    greedy: bool = True,
    n: int = 1,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    calls: UserCalls | None = None,
    score_timeout_s: float = 10.0,
    max_context: int = 0,
    chunk: int = 0,
    at_once: int = 1,
    on_part: OnPart | None = None,
) -> Evaluation:
    """`evaluate` over any ``generate`` (`Generate`: a sampler's backend, or `hf_generate`), on
    the caller's event loop: ``n`` episodes per problem of ``task``, the share found correct, the
    means of its metrics, the failed calls and an agent's failed episodes. The problems go in
    parts of ``chunk`` (0: one part), ``at_once`` of them in flight (a backend that batches
    concurrent calls, vLLM, takes them all at once; with 1 they are solved in order); each part's
    `Tally` goes to ``on_part`` as it ends. The first part to fail ends the others, and its error
    is raised."""
    from asyncrl.rl.tasks.episodes import EpisodeRunner

    if n < 1 or chunk < 0 or at_once < 1:
        raise ValueError(f"n and at_once must be >= 1 and chunk >= 0, not {n}, {at_once} and {chunk}")
    if greedy and n > 1:
        raise ValueError("greedy decoding gives the same completion n times; use n=1 or greedy=False")
    problems = list(problems)
    if not problems:
        return Evaluation(0.0, {}, {})
    params = SamplingParams(
        max_new_tokens=max_new_tokens or fmt.max_new_tokens_hint,
        temperature=0.0 if greedy else temperature,
        stop_token_ids=list(fmt.stop_token_ids),
    )
    own = calls is None
    if calls is None:  # failures score 0 here, as in training; an agent's whole episode is one call
        calls = UserCalls(task.task_name(), score_timeout_s, max_failure_rate=1.0, workers=max(16, len(problems) * n))
    server = None
    try:
        if isinstance(task, Agent):
            server = await _agent_endpoint(task, generate, fmt, params, max_context)
            solve = _agent_solver(task, server, calls, n)
        else:
            solve = _episodes_solver(EpisodeRunner(task, fmt, calls, max_context=max_context), n, params, generate)
        found = await _in_parts(solve, problems, chunk or len(problems), at_once, on_part)
    finally:
        if server is not None:
            await server.close()
        if own:
            calls.close()
    return Evaluation(found.solve_rate, found.means(), dict(found.errors), dict(found.failures))


def solve_rate(model, tokenizer, fmt: PromptFormat, problems: Sequence[Any], **kwargs: Any) -> float:
    """`evaluate`'s solve rate alone."""
    return evaluate(model, tokenizer, fmt, problems, **kwargs).solve_rate


async def _in_parts(
    solve: Callable[[list], Any], problems: list, size: int, at_once: int, on_part: OnPart | None
) -> Tally:
    """``solve`` each part of ``size`` problems, ``at_once`` workers taking the next part in
    order; the parts' tallies added in problem order."""
    starts = iter(range(0, len(problems), size))
    tallies: dict[int, Tally] = {}

    async def worker() -> None:
        for start in starts:  # shared: each part is taken once, in order
            positions = range(start, min(start + size, len(problems)))
            tallies[start] = await solve(problems[positions.start : positions.stop])
            if on_part is not None:
                on_part(positions, tallies[start])

    workers = [asyncio.ensure_future(worker()) for _ in range(min(at_once, -(-len(problems) // size)))]
    try:
        done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
        for w in done:
            w.result()  # the first failure, raised
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    found = Tally()
    for start in sorted(tallies):
        found = found + tallies[start]
    return found


def _episodes_solver(runner, n: int, params: SamplingParams, generate: Generate):
    """A part's episodes through the `EpisodeRunner`, added up."""

    async def solve(problems: list) -> Tally:
        groups = await runner.run(problems, n, params, generate)
        found = Tally(episodes=sum(len(g) for g in groups))
        for s in (s for g in groups for s in g):
            found.correct += bool(s.correct)
            for key, value in s.metrics.items():
                found.metrics[key] = found.metrics.get(key, 0.0) + value
            if s.error:
                found.errors[s.error] = found.errors.get(s.error, 0) + 1
        return found

    return solve


async def _agent_endpoint(task: Agent, generate: Generate, fmt: PromptFormat, params: SamplingParams, max_context: int):
    """An endpoint of the evaluation's own over ``generate`` (sampling ``params``, so greedy where
    asked), as the samplers serve their agents. It reports no tokens as they come: a stream gets
    each answer whole at its end."""
    from asyncrl.rl.agents.server import OpenAIServer

    async def versioned(prompts, k, p, progress=None):
        return 0, await generate(prompts, k, p)

    server = OpenAIServer(versioned, fmt.tokenizer, params, max_context=max_context, max_calls=task.max_calls)
    await server.start()
    return server


def _agent_solver(task: Agent, server, calls: UserCalls, n: int):
    """A part of an agent's episodes against ``server``: the share scored correct, the sums of the
    metrics of their `Score`s (a failed episode adds 0), the failures by kind and by what they
    were (`failure_kinds`)."""
    from asyncrl.rl.agents.runner import AgentRunner

    runner = AgentRunner(task, server, calls)

    async def solve(problems: list) -> Tally:
        episodes = await runner.episodes(problems, n)
        found = Tally(episodes=len(episodes), failures=failure_kinds(o for _, o in episodes))
        for _, outcome in episodes:
            if outcome.error:
                found.errors[outcome.error] = found.errors.get(outcome.error, 0) + 1
                continue
            found.correct += bool(outcome.value.correct)
            for key, value in outcome.value.metrics.items():
                found.metrics[key] = found.metrics.get(key, 0.0) + value
        return found

    return solve


def hf_generate_for(
    task: Task, model, tokenizer, fmt: PromptFormat, batch_size: int, stop: threading.Event | None = None
) -> Generate:
    """`hf_generate`, for ``task``'s evaluation: an agent's on a thread of its own, one call at a
    time (its endpoint gathers requests into one call), since ``model.generate`` blocks and the
    endpoint's loop must keep accepting and answering the agents; any other task's as it is (its
    episodes wait for each call anyway)."""
    generate = hf_generate(model, tokenizer, fmt, batch_size, stop, logprobs=isinstance(task, Agent))
    if not isinstance(task, Agent):
        return generate

    async def threaded(prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        return await asyncio.to_thread(lambda: asyncio.run(generate(prompts, n, params)))

    return threaded


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
    sampling: dict[str, object] = {}
    if not greedy:
        sampling.update(temperature=params.temperature, top_k=0, top_p=params.top_p)
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
