"""A step's record (`StepRecord`, a line of metrics.jsonl) assembled from what the step did: its
batch, the groups left out as uniform, the train step's metrics, the sync, the timings and the
run's totals so far; and the task's metrics of a batch (`task_metrics`)."""

from __future__ import annotations

from typing import Any

from asyncrl.rl.driver.pacing import Pacer
from asyncrl.rl.observe.record import FleetEvents, StepRecord, TrainMetrics
from asyncrl.rl.observe.sync_metrics import SyncPhases
from asyncrl.rl.rollout import RolloutGroup


def step_record(
    step: int,
    version: int,
    batch: list[RolloutGroup],
    skipped: list[RolloutGroup],
    *,
    trained: dict[str, Any],
    synced: SyncPhases,
    digests: dict[str, str],
    times: tuple[float, float, float],
    correct_reward: float,
    samples: int,
    tokens: int,
    completion_tokens: int,
    elapsed_s: float,
    dropped_stale: int,
    queue_depth: int,
    pacer: Pacer | None,
    task_keys: set[str],
    fleet: dict[str, Any],
) -> StepRecord:
    """The record of ``step``, which trained ``batch`` into ``version``. ``times``: when the step
    began, when its batch was there and when it was trained (``time.monotonic``); ``samples``,
    ``tokens``: the run's totals with this step's; ``completion_tokens``: this step's."""
    # Rates over everything sampled for the step, the groups left out as uniform included: the
    # batch holds only groups with a signal, which would bias them towards 50%.
    rewards = [r for g in batch + skipped for r in g.rewards]
    correct = [c for g in batch + skipped for c in (g.correct or [r >= correct_reward for r in g.rewards])]
    staleness = [version - 1 - g.version for g in batch]
    peaks = pacer.take_peaks() if pacer else None
    t0, t1, t2 = times
    return StepRecord(
        step=step,
        version=version,
        reward_mean=sum(rewards) / len(rewards),
        train_solve_rate=sum(correct) / len(correct),
        staleness_mean=sum(staleness) / len(staleness),
        staleness_hist={str(s): staleness.count(s) for s in sorted(set(staleness))},
        dropped_stale=dropped_stale,
        uniform_skipped=len(skipped),
        queue_depth=queue_depth,
        paced_wait_s=pacer.waited_s if pacer else None,
        paced_streams=peaks[0] if peaks else None,
        paced_in_flight_peak=peaks[1] if peaks else None,
        completion_tokens=completion_tokens,
        samples_per_s=samples / max(elapsed_s, 1e-9),
        tokens_per_s=tokens / max(elapsed_s, 1e-9),
        time_s=elapsed_s,
        wait_s=t1 - t0,
        train_s=t2 - t1,
        sync=synced,
        generate_s=sum(g.generate_s for g in batch) / len(batch),
        train=TrainMetrics.of(trained),
        task=task_metrics(batch, task_keys),
        fleet=FleetEvents(**fleet),
        group_ids=[g.uid for g in batch],
        weights_digests=digests or None,
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
