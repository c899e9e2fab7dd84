"""`ScorerActor`: a local Hugging Face checkpoint that scores completions: a teacher's per-token
log-probs (kind "teacher"), a reward model's scalar per completion (kind "reward", ``reward.py``)
or a generative judge's verdict per completion (kind "judge", ``judge.py``). Prefill only, but
for a judge that reads its verdict from what it generates.

Each `teacher_logprobs` call (one group: a prompt and its completions) waits in a queue; one
worker task takes every request waiting when it is free, up to ``batch_tokens`` of them, and
scores them in one pass: the requests of every sampler that arrived while the previous pass ran
share the next (continuous batching, as an inference engine does, at prefill only). The pass is
the trainer's own scoring (`micro_batches` + `scored_logprobs`: the fused output layer on a
checkpoint that allows it), so a teacher's log-probs are computed exactly as the trainer's KL
reference's are, at the samplers' temperature.

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
from asyncrl.rl.model.policy import load_policy
from asyncrl.rl.rollout import RolloutGroup, TeacherTopK
from asyncrl.rl.scorer.judge import Judge, JudgeError
from asyncrl.rl.scorer.reward import RewardModelError, load_reward_model, sequence_rewards
from asyncrl.rl.scoring.logprobs import fused_head_fallback, scored_logprobs, scored_topk
from asyncrl.rl.trainer.batching import micro_batches
from asyncrl.runtime.actor import Actor, endpoint
from asyncrl.runtime.startup import start_phase


class ScorerError(ActionableError):
    """A request the scorer refuses (token ids outside the vocabulary it reads them with) or a pass
    that failed; the message names which."""


_VOCABULARY = {
    "teacher": "the teacher's vocabulary of {n}: teacher and student tokenizers differ",
    "reward": "the reward model's vocabulary of {n}: reward model and student tokenizers differ",
    # a judge reads the student's ids with the student's tokenizer (the driver passes its path)
    "judge": "the vocabulary of {n} of the student's tokenizer, which the judge decodes completions with",
}
"""What a token id outside the scorer's vocabulary is outside of, by the scorer's kind."""


class ScorerActor(Actor):
    """Serves ``model_path``'s log-probs of completion tokens at ``temperature`` (``kind``
    "teacher"), its scalar reward per completion (``kind`` "reward") or its verdict per
    completion (``kind`` "judge": ``judge`` holds `Judge`'s keyword arguments, the student's
    tokenizer path and the template's text among them) on ``device``, batching waiting requests
    up to ``batch_tokens`` tokens a pass (see the module docstring). ``cpu_threads`` > 0 sets
    torch's intra-op threads. ``top_k`` > 0 (a teacher): it answers `teacher_topk`, the teacher's
    ``top_k`` most likely tokens at each position (clamped to its vocabulary), instead of
    `teacher_logprobs`."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        temperature: float = 1.0,
        batch_tokens: int = 16384,
        cpu_threads: int = 0,
        kind: str = "teacher",
        judge: dict | None = None,
        top_k: int = 0,
    ):
        if kind not in ("teacher", "reward", "judge"):
            raise ValueError(f"kind must be 'teacher', 'reward' or 'judge', not {kind!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, not {temperature!r}")
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, not {batch_tokens!r}")
        if top_k < 0 or (top_k and kind != "teacher"):
            raise ValueError(f"top_k must be >= 0, and 0 for a {kind} (a teacher's option), not {top_k!r}")
        if cpu_threads > 0:
            torch.set_num_threads(cpu_threads)
        self.name = os.environ.get("ASYNCRL_ACTOR", "") or "scorer"
        self.device = actor_device(device)
        self.kind = kind
        start_phase(f"loading the {'reward model' if kind == 'reward' else kind} {model_path}")
        self.judge: Judge | None = None
        if kind == "judge":
            try:
                self.judge = Judge(model_path, device=self.device, **(judge or {}))
            except JudgeError as exc:
                raise ScorerError(str(exc)) from None
            self.model = self.judge.model
            self.vocab = len(self.judge.student)  # requests carry the student's token ids
        elif kind == "reward":
            try:
                self.model = load_reward_model(model_path, self.device)
            except RewardModelError as exc:
                raise ScorerError(str(exc)) from None
            self.vocab = int(self.model.get_input_embeddings().weight.shape[0])
        else:
            self.model, _, _ = load_policy(
                model_path, self.device, dtype=torch.bfloat16 if self.device.type == "cuda" else None
            )
            self.model.requires_grad_(False)
            self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.temperature, self.batch_tokens = temperature, batch_tokens
        self.top_k = min(top_k, self.vocab)  # K >= the vocabulary: the whole distribution
        self.fused = not fused_head_fallback(self.model)
        self._pending: list[tuple[list[int], list[list[int]], asyncio.Future]] = []
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
        if self.top_k:
            raise ScorerError(f"{self.name} serves its top {self.top_k} (--teacher.top_k): call teacher_topk")
        return await self._request("teacher", prompt_ids, completion_ids)

    @endpoint
    async def teacher_topk(self, prompt_ids: list[int], completion_ids: list[list[int]]) -> TeacherTopK:
        """The teacher's ``top_k`` most likely tokens and their log-probs at each completion
        position (the distribution that predicts that token), flat per completion (`TeacherTopK`)."""
        if not self.top_k:
            raise ScorerError(f"{self.name} was started without top_k (--teacher.top_k): call teacher_logprobs")
        answers = await self._request("teacher", prompt_ids, completion_ids)  # (ids, log-probs) a completion
        return TeacherTopK(self.top_k, [ids for ids, _ in answers], [lps for _, lps in answers])

    @endpoint
    async def rewards(self, prompt_ids: list[int], completion_ids: list[list[int]]) -> list[float | None]:
        """The reward model's scalar for each completion after the prompt (kind "reward"), or the
        judge's verdict (kind "judge"; None where it did not parse: ``judge.py``)."""
        return await self._request("judge" if self.kind == "judge" else "reward", prompt_ids, completion_ids)

    async def _request(self, kind: str, prompt_ids: list[int], completion_ids: list[list[int]]):
        if kind != self.kind:
            raise ScorerError(f"{self.name} serves a {self.kind}, not a {kind}")
        if not prompt_ids:
            raise ScorerError(f"{self.name}: a request with an empty prompt (the first token is never scored)")
        for ids in (prompt_ids, *completion_ids):
            if ids and (min(ids) < 0 or max(ids) >= self.vocab):
                raise ScorerError(
                    f"{self.name}: token id {max(ids) if max(ids) >= self.vocab else min(ids)} is outside "
                    + _VOCABULARY[self.kind].format(n=self.vocab)
                )
        future = asyncio.get_running_loop().create_future()
        self._pending.append((prompt_ids, completion_ids, future))
        self._wake.set()
        return await future

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
                take, tokens = [], 0
                while self._pending and (not take or tokens + _tokens(self._pending[0]) <= self.batch_tokens):
                    tokens += _tokens(self._pending[0])
                    take.append(self._pending.pop(0))
                live = [r for r in take if not r[2].done()]  # callers that gave up are not scored
                if not live:
                    continue
                start = time.perf_counter()
                try:
                    results, forwards = await asyncio.to_thread(self._score, [(p, c) for p, c, _ in live])
                except Exception as exc:  # the actor goes on serving; these requests are told why
                    self._stats["failed_passes"] += 1
                    for _, _, future in live:
                        if not future.done():
                            future.set_exception(
                                ScorerError(
                                    f"{self.name}: scoring {len(live)} request(s) failed: {type(exc).__name__}: {exc}"
                                )
                            )
                    continue
                self._stats.update(
                    passes=self._stats["passes"] + 1,
                    forwards=self._stats["forwards"] + forwards,
                    requests=self._stats["requests"] + len(live),
                    tokens=self._stats["tokens"] + sum(_tokens(r) for r in live),
                    score_s=self._stats["score_s"] + time.perf_counter() - start,
                )
                for (_, _, future), result in zip(live, results):
                    if not future.done():
                        future.set_result(result)

    @torch.no_grad()
    def _score(self, requests: list[tuple[list[int], list[list[int]]]]) -> tuple[list, int]:
        if self.kind == "reward":
            return sequence_rewards(self.model, requests, self.batch_tokens, self.device)
        if self.judge is not None:
            scores, calls = self.judge.score(requests, self.batch_tokens)
            self._stats["unparsed"] += sum(s is None for row in scores for s in row)
            return scores, calls
        groups = [
            RolloutGroup(
                i, prompt, completions, [[0.0] * len(c) for c in completions], [0.0] * len(completions), version=0
            )
            for i, (prompt, completions) in enumerate(requests)
        ]
        flat = [(g, j) for g in groups for j in range(len(g.completion_ids))]
        # micro_batches orders sequences by length: the advantage slot carries each one's index back
        tags = torch.arange(len(flat), dtype=torch.float64)
        out: list = [[] for _ in flat]  # per completion: its log-probs, or (top-K ids, their log-probs)
        batches = micro_batches(groups, tags, self.batch_tokens, self.device)
        autocast = torch.bfloat16 if self.device.type == "cuda" else None
        for batch in batches:
            if self.top_k:  # per completion (flat ids, flat log-probs), position-major
                values, ids = scored_topk(
                    self.model, batch, self.temperature, self.top_k, fused=self.fused, autocast_dtype=autocast
                )
            else:
                logprobs, _ = scored_logprobs(
                    self.model, batch, self.temperature, fused=self.fused, autocast_dtype=autocast
                )
            for s, tag in enumerate(batch.advantages.tolist()):
                g, j = flat[int(tag)]
                n = len(g.completion_ids[j])
                if self.top_k:
                    out[int(tag)] = (ids[s, :n].flatten().tolist(), values[s, :n].flatten().tolist())
                else:
                    out[int(tag)] = logprobs[s, :n].tolist()
        results, k = [], 0
        for g in groups:
            results.append(out[k : k + len(g.completion_ids)])
            k += len(g.completion_ids)
        return results, len(batches)


def _tokens(request: tuple) -> int:
    prompt, completions = request[0], request[1]
    return sum(len(prompt) + len(c) for c in completions)
