"""The rollout queue's contract for long tails (docs/grpo.md, "Long generations"), held by the
driver's real parts: `Pumps` (one per sampler), the `Pacer`, the `RolloutQueue` and `Membership`,
driven by a training loop on a virtual clock (virtual_time.py) against samplers whose completions
take as long as their lengths, drawn from the heavy-tailed ``lognormal`` profile of
``--sampler.lengths``. The samplers are stand-ins (an in-process engine on the virtual clock that
decodes every running completion at one rate, as a batching engine does, and takes each weight
update between two of its steps): what is under test is how the driver treats what they send.

Over a run:

* no group is dropped, though the longest completions span many weight updates;
* the lengths trained are the lengths generated: a two-sample Kolmogorov-Smirnov test at level
  0.001 (critical value 1.95 * sqrt((n + m) / (n m))) finds no difference;
* no group waits behind another: each is queued the moment it is delivered;
* every group trained is at most ``max_staleness`` versions past the one it was finished under,
  and each token's version is where its completion's spans put it.

Before groups were queued in completion order and their staleness counted from their finish,
the same run dropped the long groups (their first tokens were many versions old) and held short
groups behind the long group granted before them.
"""

from __future__ import annotations

import asyncio
import math
import random
from types import SimpleNamespace

import pytest

from asyncrl.rl.config.lengths import LengthProfile
from asyncrl.rl.config.run import DeadlineConfig, RecoveryConfig
from asyncrl.rl.driver.fleet.membership import Membership
from asyncrl.rl.driver.fleet.pumps import Pumps, RolloutFlow
from asyncrl.rl.driver.pacing import Pacer
from asyncrl.rl.driver.queue import RolloutQueue
from asyncrl.rl.driver.uniform import UniformGroups
from asyncrl.rl.generation import VersionSpan
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.runtime.state import ActorState
from virtual_time import run_virtual

TOKENS_PER_S = 1000.0  # each running completion's decoding rate in the stand-in engine


class Weights:
    """The version the samplers hold, and when each one went in (in-flight updates)."""

    def __init__(self) -> None:
        self.changes = [(0.0, 0)]  # (loop time, version), in order

    @property
    def version(self) -> int:
        return self.changes[-1][1]

    def update(self, version: int) -> None:
        self.changes.append((asyncio.get_running_loop().time(), version))

    def spans(self, began: float, length: int) -> list[VersionSpan]:
        """The versions of a completion of ``length`` tokens begun at ``began``: token i is
        sampled at ``began + (i + 1) / rate``, under the version in place then."""
        spans: list[VersionSpan] = []
        for at, version in self.changes:
            first = 0 if at <= began else math.ceil((at - began) * TOKENS_PER_S - 1e-9) - 1
            first = max(first, 0)
            if first >= length:
                break
            if spans and spans[-1].start == first:
                spans[-1] = VersionSpan(first, version)
            elif not spans or spans[-1].version != version:
                spans.append(VersionSpan(first, version))
        return spans


class LongTailSampler:
    """A sampler's handle, as the pumps use it: ``rollouts(max_groups)`` runs that many problems
    at once and yields each group as it ends (a batching engine's sampler)."""

    def __init__(self, name: str, weights: Weights, profile: LengthProfile, seed: int, generated: list[int]):
        self.name, self.weights, self.profile = name, weights, profile
        self.rng = random.Random(seed)
        self.generated = generated  # every completion length this sampler delivered
        self.problems = 0
        self.running = 0  # problems decoding now: the engine's batch, in groups
        self._since = 0.0
        self.group_seconds = 0.0  # the integral of ``running`` over time

    def count_running(self, change: int) -> None:
        now = asyncio.get_running_loop().time()
        self.group_seconds += self.running * (now - self._since)
        self.running += change
        self._since = now

    def info(self) -> SimpleNamespace:
        return SimpleNamespace(state=ActorState.RUNNING, incarnation=0)

    def pinned(self, incarnation: int) -> LongTailSampler:
        return self

    def with_timeout(self, timeout_s: float) -> LongTailSampler:
        return self

    async def rollouts(self, max_groups: int):
        ended: asyncio.Queue[RolloutGroup] = asyncio.Queue()
        runs = [asyncio.ensure_future(self._problem(ended)) for _ in range(max_groups)]
        try:
            for _ in range(max_groups):
                group = await ended.get()
                self.generated.extend(len(c) for c in group.completion_ids)
                yield group
        finally:
            for r in runs:
                r.cancel()

    async def _problem(self, ended: asyncio.Queue[RolloutGroup]) -> None:
        loop = asyncio.get_running_loop()
        self.problems += 1
        prompt_id = self.problems
        began, version = loop.time(), self.weights.version
        lengths = [self.profile.draw(self.rng) for _ in range(4)]
        self.count_running(+1)
        try:
            await asyncio.sleep(max(lengths) / TOKENS_PER_S)
        finally:
            self.count_running(-1)
        ended.put_nowait(
            RolloutGroup(
                prompt_id=prompt_id,
                prompt_ids=[1, 2, 3],
                completion_ids=[[5] * n for n in lengths],
                behaviour_logprobs=[[-1.0] * n for n in lengths],
                rewards=[0.0, 1.0, 0.0, 1.0],
                version=version,
                sampler=self.name,
                finished_at=loop.time(),
                version_spans=[self.weights.spans(began, n) for n in lengths],
                delivered_version=self.weights.version,
            )
        )


class RecordingQueue(RolloutQueue):
    """The real queue, noting when each group was offered to it."""

    def __init__(self, capacity: int, max_staleness: int):
        super().__init__(capacity, max_staleness)
        self.offered: dict[str, float] = {}

    async def put(self, group: RolloutGroup, timeout_s: float) -> bool:
        self.offered[group.uid] = asyncio.get_running_loop().time()
        return await super().put(group, timeout_s)


async def run_long_tails(
    *,
    steps: int,
    n: int,
    max_staleness: int,
    samplers: int,
    batch: int,
    streams: int,
    train_s: float,
    batching: bool = True,
) -> dict:
    profile = LengthProfile("lognormal", 8192)
    weights, generated = Weights(), []
    handles = [LongTailSampler(f"sampler{i}", weights, profile, seed=i, generated=generated) for i in range(samplers)]
    membership = Membership(handles, list(range(samplers)), recovery=RecoveryConfig(), log=lambda *_: None)
    for m in membership.members:  # what each sampler's stats tell the driver before it joins
        membership.engine_seen(m, batches_requests=batching)
    queue = RecordingQueue(2 * n * (max_staleness + 1), max_staleness)
    pacer = Pacer(queue, n, max_staleness, version=0, next_step=1)
    flow = RolloutFlow(queue, pacer=pacer, batch_groups=batch, streams=streams)
    pumps = Pumps(membership, flow, DeadlineConfig(), UniformGroups(0))
    tasks = [membership.spawn(pumps.run(m, 0), m.name) for m in membership.members]
    trained: list[RolloutGroup] = []
    taken_at: list[tuple[int, RolloutGroup]] = []
    start = asyncio.get_running_loop().time()
    try:
        for step in range(1, steps + 1):
            got = await queue.get_batch(n, current_version=step - 1, timeout_s=600.0)
            for task in tasks:
                if task.done():
                    task.result()  # a pump that failed: its error, not a timeout later
            pacer.batch_taken(step - 1)
            trained += got
            taken_at += [(step - 1, g) for g in got]
            await asyncio.sleep(train_s)
            weights.update(step)  # the sync: every sampler takes it between two decoding steps
            pacer.synced(step)
        for h in handles:
            h.count_running(0)  # the integral up to now
        elapsed = asyncio.get_running_loop().time() - start
    finally:
        await membership.close()
    finished = {g.uid: g.finished_at for g in trained}
    return {
        "elapsed": elapsed,
        "engine_groups": [h.group_seconds / elapsed for h in handles],  # the mean batch, in groups
        "queue": queue,
        "trained": trained,
        "taken_at": taken_at,
        "generated": generated,
        "waits": [queue.offered[uid] - at for uid, at in finished.items()],
    }


def ks_statistic(a: list[int], b: list[int]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = sorted(a), sorted(b)
    i = j = 0
    gap = 0.0
    while i < len(a) and j < len(b):
        x = min(a[i], b[j])
        while i < len(a) and a[i] == x:
            i += 1
        while j < len(b) and b[j] == x:
            j += 1
        gap = max(gap, abs(i / len(a) - j / len(b)))
    return gap


@pytest.mark.parametrize("batching", [True, False], ids=["batching-engine", "batch-per-call"])
@pytest.mark.parametrize("samplers", [1, 2])
def test_long_completions_are_trained_as_often_as_they_are_made(samplers, batching):
    out = run_virtual(
        run_long_tails(
            steps=60, n=8, max_staleness=1, samplers=samplers, batch=4, streams=2, train_s=0.5, batching=batching
        )
    )
    queue, trained, generated = out["queue"], out["trained"], out["generated"]
    stats = queue.stats()
    assert stats.dropped_stale == 0 and stats.gets == 60 * 8

    lengths = [len(c) for g in trained for c in g.completion_ids]
    d = ks_statistic(lengths, generated)
    critical = 1.95 * math.sqrt((len(lengths) + len(generated)) / (len(lengths) * len(generated)))
    assert d < critical, (d, critical)
    # The tail itself was trained: completions of over a quarter of the cap, which span versions.
    longest = [g for g in trained if max(len(c) for c in g.completion_ids) > 2048]
    assert (
        max(g.newest_version - g.version for g in longest) >= 2
    )  # dropped at staleness 2 when counted from the oldest

    assert max(out["waits"]) == 0.0  # queued the moment it was delivered: behind nobody

    for version, g in out["taken_at"]:
        assert version - g.finished_version <= 1  # the staleness bound, from the finish
        for i, spans in enumerate(g.version_spans):
            tokens = g.token_versions(i)
            assert tokens[0] == spans[0].version >= g.version and tokens == sorted(tokens)


def test_a_batching_engine_stays_full_while_its_long_groups_decode():
    """One GPU's defaults (a step's groups a batch, one stream, ``max_staleness`` 1) with a
    trainer faster than generation. An engine that batches concurrent calls gets a new group
    each time one ends, so its batch stays at the window's 8 groups; batch by batch (the pumps'
    only way before, kept for engines that generate a batch per call) it thins out behind each
    batch's longest group, as a synchronous step's does."""
    runs = {
        batching: run_virtual(
            run_long_tails(
                steps=40, n=8, max_staleness=1, samplers=1, batch=8, streams=1, train_s=0.5, batching=batching
            )
        )
        for batching in (True, False)
    }
    full, thinned = runs[True], runs[False]
    assert full["queue"].stats().dropped_stale == 0 and max(full["waits"]) == 0.0
    assert full["engine_groups"][0] > 0.9 * 8, full["engine_groups"]
    assert thinned["engine_groups"][0] < 0.7 * 8, thinned["engine_groups"]
    assert full["elapsed"] < 0.75 * thinned["elapsed"], (full["elapsed"], thinned["elapsed"])


def test_length_profiles_parse_and_draw_their_shape():
    assert LengthProfile.parse("") is None and LengthProfile.parse("uniform:4096") == LengthProfile("uniform", 4096)
    for bad in ("lognormal", "lognormal:0", "gamma:10", "uniform:-3", "uniform:1k"):
        with pytest.raises(ValueError, match="'uniform:N' or 'lognormal:N'"):
            LengthProfile.parse(bad)
    rng = random.Random(0)
    draws = sorted(LengthProfile("lognormal", 8192).draw(rng) for _ in range(20000))
    median, capped = draws[len(draws) // 2], sum(d == 8192 for d in draws) / len(draws)
    assert 1900 <= median <= 2200 and 0.025 <= capped <= 0.06 and draws[0] >= 1
    assert {LengthProfile("uniform", 300).draw(rng) for _ in range(10)} == {300}


def test_a_profile_longer_than_the_limit_is_refused_in_one_line():
    from asyncrl.rl.config.sampler import SamplerConfig

    with pytest.raises(ValueError, match="reaches past max_new_tokens 1024: raise --sampler.max_new_tokens"):
        SamplerConfig(lengths="lognormal:2048", max_new_tokens=1024)
    assert SamplerConfig(lengths="lognormal:2048").length_limit == 2048
