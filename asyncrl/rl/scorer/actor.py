"""`ScorerActor`: a local Hugging Face checkpoint that scores completions, through the one
`Scorer` its spec builds (``specs.py``): a teacher's per-token log-probs (`TeacherSpec`,
``teacher.py``), a reward model's scalar per completion (`RewardSpec`, ``reward.py``) or a
generative judge's verdict per completion (`JudgeSpec`, ``judge.py``). Prefill only, but for a
judge that reads its verdict from what it generates.

Each request (one group: a prompt and its completions) waits in a queue; one worker task takes
every request waiting when it is free, up to ``batch_tokens`` of them, and has the scorer score
them in one pass: the requests of every sampler that arrived while the previous pass ran share the
next (continuous batching, as an inference engine does, at prefill only).

A caller's deadline bounds its call (a request whose caller gave up is scored but not answered);
a pass that raises fails the requests it held with `ScorerError` and the actor goes on serving.
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

from asyncrl.errors import ActionableError
from asyncrl.rl.actor_device import actor_device
from asyncrl.rl.rollout import TeacherTopK
from asyncrl.rl.scorer.base import Scored, Scorer
from asyncrl.rl.scorer.factory import make_scorer
from asyncrl.rl.scorer.judge import JudgeError
from asyncrl.rl.scorer.reward import RewardModelError
from asyncrl.rl.scorer.specs import ScorerSpec, TeacherSpec
from asyncrl.rl.scorer.teacher import TeacherScorer
from asyncrl.rl.scoring.batch import ScoreRequest
from asyncrl.runtime.actor import Actor, endpoint


class ScorerError(ActionableError):
    """A request the scorer refuses (token ids outside the vocabulary it reads them with) or a pass
    that failed; the message names which."""


class ScorerActor(Actor):
    """Serves what ``spec`` describes (a `ScorerSpec`; default: a teacher at temperature 1) from
    ``model_path`` on ``device``, batching waiting requests up to ``batch_tokens`` tokens a pass
    (see the module docstring). ``cpu_threads`` > 0 sets torch's intra-op threads."""

    def __init__(
        self,
        model_path: str,
        spec: ScorerSpec | None = None,
        *,
        device: str = "cpu",
        batch_tokens: int = 16384,
        cpu_threads: int = 0,
    ):
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, not {batch_tokens!r}")
        if cpu_threads > 0:
            torch.set_num_threads(cpu_threads)
        self.name = os.environ.get("ASYNCRL_ACTOR", "") or "scorer"
        self.batch_tokens = batch_tokens
        try:
            self.scorer: Scorer = make_scorer(spec or TeacherSpec(), model_path, actor_device(device))
        except (RewardModelError, JudgeError) as exc:
            raise ScorerError(str(exc)) from None
        self._pending: list[tuple[ScoreRequest, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._stats = {
            "requests": 0,
            "passes": 0,
            "forwards": 0,
            "tokens": 0,
            "score_s": 0.0,
            "failed_passes": 0,
            "unparsed": 0,
        }

    async def on_start(self) -> None:
        self._worker = asyncio.create_task(self._serve(), name="scorer passes")

    async def on_stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    @endpoint
    async def teacher_logprobs(self, prompt_ids: list[int], completion_ids: list[list[int]]) -> list[list[float]]:
        """The teacher's log-prob of each completion token given the prompt and the completion's
        tokens before it, one list per completion (each as long as its completion)."""
        return await self._request("teacher_logprobs", "teacher", ScoreRequest(prompt_ids, completion_ids))

    @endpoint
    async def teacher_topk(self, prompt_ids: list[int], completion_ids: list[list[int]]) -> TeacherTopK:
        """The teacher's ``top_k`` most likely tokens and their log-probs at each completion
        position (the distribution that predicts that token), flat per completion (`TeacherTopK`)."""
        return await self._request("teacher_topk", "teacher", ScoreRequest(prompt_ids, completion_ids))

    @endpoint
    async def rewards(self, prompt_ids: list[int], completion_ids: list[list[int]]) -> list[float | None]:
        """The reward model's scalar for each completion after the prompt (kind "reward"), or the
        judge's verdict (kind "judge"; None where it did not parse: ``judge.py``)."""
        return await self._request("rewards", "reward", ScoreRequest(prompt_ids, completion_ids))

    async def _request(self, method: str, asked: str, request: ScoreRequest):
        """``request`` queued for the next pass, once checked: ``method`` is the endpoint called,
        ``asked`` the kind of scorer it is an endpoint of."""
        if method != self.scorer.endpoint:
            raise ScorerError(self._refusal(method, asked))
        if not request.prompt_ids:
            raise ScorerError(f"{self.name}: a request with an empty prompt (the first token is never scored)")
        vocab = self.scorer.vocab
        for ids in (request.prompt_ids, *request.completion_ids):
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise ScorerError(
                    f"{self.name}: token id {max(ids) if max(ids) >= vocab else min(ids)} is outside "
                    + self.scorer.vocabulary.format(n=vocab)
                )
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._wake.set()
        return await future

    def _refusal(self, method: str, asked: str) -> str:
        """Why this scorer does not answer ``method``: a teacher started with or without top-K
        answers the other teacher endpoint; any other scorer is of another kind."""
        if isinstance(self.scorer, TeacherScorer) and asked == "teacher":
            if self.scorer.top_k:
                return f"{self.name} serves its top {self.scorer.top_k} (--teacher.top_k): call teacher_topk"
            return f"{self.name} was started without top_k (--teacher.top_k): call teacher_logprobs"
        return f"{self.name} serves a {self.scorer.kind}, not a {asked}"

    @endpoint
    async def stats(self) -> dict[str, float]:
        """Requests answered, passes (each one batch of waiting requests), forwards, tokens
        scored (prompt and completion: the prefill), seconds spent scoring, and a judge's
        verdicts that did not parse."""
        return dict(self._stats)

    async def _serve(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                take: list[tuple[ScoreRequest, asyncio.Future]] = []
                tokens = 0
                while self._pending and (not take or tokens + _tokens(self._pending[0][0]) <= self.batch_tokens):
                    tokens += _tokens(self._pending[0][0])
                    take.append(self._pending.pop(0))
                live = [(request, future) for request, future in take if not future.done()]  # callers that gave up
                if live:
                    await self._pass(live)

    async def _pass(self, live: list[tuple[ScoreRequest, asyncio.Future]]) -> None:
        """One pass over ``live``'s requests: each caller answered, or told why the pass failed."""
        start = time.perf_counter()
        try:
            scored = await asyncio.to_thread(self._score, [request for request, _ in live])
        except Exception as exc:  # the actor goes on serving; these requests are told why
            self._stats["failed_passes"] += 1
            why = f"{self.name}: scoring {len(live)} request(s) failed: {type(exc).__name__}: {exc}"
            for _, future in live:
                if not future.done():
                    future.set_exception(ScorerError(why))
            return
        self._stats.update(
            passes=self._stats["passes"] + 1,
            forwards=self._stats["forwards"] + scored.forwards,
            requests=self._stats["requests"] + len(live),
            tokens=self._stats["tokens"] + sum(_tokens(request) for request, _ in live),
            score_s=self._stats["score_s"] + time.perf_counter() - start,
            unparsed=self._stats["unparsed"] + scored.unparsed,
        )
        for (_, future), answer in zip(live, scored.answers):
            if not future.done():
                future.set_result(answer)

    @torch.no_grad()
    def _score(self, requests: list[ScoreRequest]) -> Scored:
        return self.scorer.score(requests, self.batch_tokens)


def _tokens(request: ScoreRequest) -> int:
    return sum(len(request.prompt_ids) + len(c) for c in request.completion_ids)
