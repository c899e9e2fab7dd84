"""`GatedGeneration`: a sampler's generate calls, behind its weight-sync gate, and counted.

Every generate of the sampler's rollouts, held-out evaluation and OpenAI endpoint goes through
here: it waits while a weight sync is under way (or the last one failed), tags the batch with the
weight version it began under, generates again a batch that a failed sync may have half-written,
and counts what it made for the sampler's stats.
"""

from __future__ import annotations

import time

import msgspec

from asyncrl.rl.generation import Completion, SamplingParams, VersionSpan
from asyncrl.rl.sampler.backend import Progress, SamplerBackend
from asyncrl.rl.sampler.weight_receiving import WeightReceiving


class GatedGeneration:
    """``backend``'s generation behind ``weights``' gate. ``calls``: generate calls in flight now
    (rollouts, evaluation and raw ones); ``counts``: the rollout batches' counters."""

    def __init__(self, backend: SamplerBackend, weights: WeightReceiving):
        self.backend, self.weights = backend, weights
        self.calls = 0
        self.counts = {"tokens": 0, "completions": 0, "batches": 0, "generate_s": 0.0, "discarded_batches": 0}

    async def raw(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """The backend's completions as they are: not behind the gate, not counted."""
        self.calls += 1
        try:
            return await self.backend.generate(prompts, n, params)
        finally:
            self.calls -= 1

    async def __call__(
        self,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        progress: Progress | None = None,
        *,
        counted: bool = True,
    ) -> tuple[int, list[list[Completion]], float]:
        """Generate for ``prompts`` and return the weight version it began under (the oldest of
        its tokens), each completion with its `version_spans` (given, even where the weights did
        not change under it). The version is read right before calling the backend, with no ``await`` in
        between: a `receive_weights` that begins later either waits for this batch (the backend
        registers it before its first await) or loads between its steps, and one under way has
        shut the gate, so we wait for it first. A batch in flight during a failed sync may
        have read half-written weights: it is discarded and generated again. ``counted``: in the
        rollout stats (not the held-out evaluation's)."""
        while True:
            await self.weights.wait_ready()
            version, failures = self.weights.version, self.weights.failures
            start = time.perf_counter()
            self.calls += 1
            try:
                groups = await self.backend.generate(prompts, n, params, progress)
            finally:
                self.calls -= 1
            seconds = time.perf_counter() - start
            discarded = self.weights.failures != failures
            if counted:
                self._count(groups, seconds, discarded)
            if not discarded:
                return version, [[_spanned(c, version) for c in g] for g in groups], seconds

    def _count(self, groups: list[list[Completion]], seconds: float, discarded: bool) -> None:
        """A rollout batch in the stats."""
        self.counts["generate_s"] += seconds
        self.counts["batches"] += 1
        if discarded:
            self.counts["discarded_batches"] += 1
            return
        self.counts["completions"] += sum(len(g) for g in groups)
        self.counts["tokens"] += sum(len(c.token_ids) for g in groups for c in g)


def _spanned(c: Completion, version: int) -> Completion:
    """``c`` with its version spans said: one span of ``version`` where none changed under it."""
    return c if c.version_spans else msgspec.structs.replace(c, version_spans=[VersionSpan(0, version)])
