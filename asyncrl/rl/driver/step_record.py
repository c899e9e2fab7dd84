"""A step's record (`StepRecord`, a line of metrics.jsonl) assembled from what the step did, given
as a few values: its batch (`StepBatch`), its timings (`StepTimes`), what the trainer and the sync
answered (`StepResults`), the run's totals so far (`RunTotals`) and the samplers' side
(`SamplersAfter`); and the task's metrics of a batch (`task_metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.rl.driver.pacing import Pacer
from asyncrl.rl.observe.lengths import batch_lengths
from asyncrl.rl.observe.record import FleetEvents, StepRecord
from asyncrl.rl.observe.sync_metrics import SyncPhases
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.trainer.metrics import TrainStepMetrics


@dataclass(frozen=True)
class StepBatch:
    """What step ``step`` trained: ``groups``, into ``version``; ``skipped``: the groups of one
    reward left out of it (no signal), sampled for the step all the same."""

    step: int
    version: int
    groups: list[RolloutGroup]
    skipped: list[RolloutGroup]

    @property
    def samples(self) -> int:
        """Completions trained on."""
        return sum(len(g.rewards) for g in self.groups)

    @property
    def completion_tokens(self) -> int:
        """Completion tokens trained on (after the prompts)."""
        return sum(len(c) for g in self.groups for c in g.completion_ids)


@dataclass(frozen=True)
class StepTimes:
    """When (``time.monotonic``) the step began, when its batch was there and when it was trained."""

    began: float
    batch_ready: float
    trained: float

    @property
    def wait_s(self) -> float:
        return self.batch_ready - self.began

    @property
    def train_s(self) -> float:
        return self.trained - self.batch_ready


@dataclass(frozen=True)
class StepResults:
    """What the step's calls answered: the trainer's metrics, the weight sync's phases (all 0 but
    ``sync_s`` when it did not sync) and each member's weights digest (empty: not checked)."""

    train: TrainStepMetrics
    sync: SyncPhases
    digests: dict[str, str]


@dataclass(frozen=True)
class RunTotals:
    """The run's totals so far, this step's included."""

    samples: int
    tokens: int
    elapsed_s: float
    """Training wall time, over every segment of the run."""
    dropped_stale: int
    task_keys: set[str]
    """The task's metric keys of the steps so far: this step's record adds its own (`task_metrics`)."""


@dataclass(frozen=True)
class SamplersAfter:
    """The samplers' side after the step: the rollout queue's depth, the pacer (async mode; None:
    none), what happened to the fleet since the last step (`SamplerPool.take_events`) and what
    the queue dropped, by length."""

    queue_depth: int
    pacer: Pacer | None
    fleet: dict[str, Any]
    dropped_lengths: dict[str, int] | None = None
    """The queue's stale drops so far, by completion length bucket (`RolloutQueueStats`)."""


def step_record(
    batch: StepBatch,
    times: StepTimes,
    results: StepResults,
    totals: RunTotals,
    samplers: SamplersAfter,
    *,
    correct_reward: float,
) -> StepRecord:
    """The record of the step that trained ``batch``. ``correct_reward``: the reward from which a
    completion counts as solved, for groups from a sampler that sends no verdicts."""
    groups, version = batch.groups, batch.version
    # Rates over everything sampled for the step, the groups left out as uniform included: the
    # batch holds only groups with a signal, which would bias them towards 50%.
    sampled = groups + batch.skipped
    rewards = [r for g in sampled for r in g.rewards]
    correct = [c for g in sampled for c in (g.correct or [r >= correct_reward for r in g.rewards])]
    staleness = [version - 1 - g.version for g in groups]
    pacer = samplers.pacer
    peaks = pacer.take_peaks() if pacer else None
    elapsed_s = totals.elapsed_s
    return StepRecord(
        step=batch.step,
        version=version,
        reward_mean=sum(rewards) / len(rewards),
        train_solve_rate=sum(correct) / len(correct),
        staleness_mean=sum(staleness) / len(staleness),
        staleness_hist={str(s): staleness.count(s) for s in sorted(set(staleness))},
        dropped_stale=totals.dropped_stale,
        uniform_skipped=len(batch.skipped),
        queue_depth=samplers.queue_depth,
        paced_wait_s=pacer.waited_s if pacer else None,
        paced_streams=peaks[0] if peaks else None,
        paced_in_flight_peak=peaks[1] if peaks else None,
        completion_tokens=batch.completion_tokens,
        samples_per_s=totals.samples / max(elapsed_s, 1e-9),
        tokens_per_s=totals.tokens / max(elapsed_s, 1e-9),
        time_s=elapsed_s,
        wait_s=times.wait_s,
        train_s=times.train_s,
        sync=results.sync,
        generate_s=sum(g.generate_s for g in groups) / len(groups),
        train=results.train.recorded(),
        task=task_metrics(groups, totals.task_keys),
        fleet=FleetEvents(**samplers.fleet),
        group_ids=[g.uid for g in groups],
        weights_digests=results.digests or None,
        lengths=batch_lengths(groups, version - 1),
        dropped_lengths=samplers.dropped_lengths or None,
    )


def task_metrics(batch: list[RolloutGroup], seen: set[str] | None = None) -> dict[str, float]:
    """The task's metrics of a batch: its named ones and the environment's counts as means over
    the completions, failed user calls (``task_errors/<kind>``) as counts. ``seen``: the keys of
    the run's earlier steps, updated here; one no completion of this batch reported is 0, not
    missing (a task that reports ``no_guess`` only when it happens: a step without one is 0)."""
    completions = sum(g.group_size for g in batch)
    sums: dict[str, float] = dict.fromkeys(seen or (), 0.0)
    for g in batch:
        for key, value in g.metrics.items():
            sums[key] = sums.get(key, 0.0) + value
    if seen is not None:
        seen.update(sums)
    return {k: (v if k.startswith("task_errors/") else v / completions) for k, v in sorted(sums.items())}
