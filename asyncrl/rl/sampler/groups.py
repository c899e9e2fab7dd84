"""The `RolloutGroup` a sampler streams, made from one problem's scored samples (the episodes of a
single-turn task, an environment or an agent alike)."""

from __future__ import annotations

from asyncrl.rl.generation import VersionSpan
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.tasks.episodes import Sample


def rollout_group(
    sampler: str, index: int, prompt: list[int], samples: list[Sample], version: int, seconds: float, finished: float
) -> RolloutGroup:
    """The wire form of one problem's samples, tagged with the ``sampler`` that made them;
    ``metrics`` sums what the driver averages. ``version``: the oldest version the generation
    began under, where the samples do not say their versions themselves."""
    metrics: dict[str, float] = {}
    for s in samples:
        for key, value in s.metrics.items():
            metrics[f"task/{key}"] = metrics.get(f"task/{key}", 0.0) + value
        if s.error:
            metrics[f"task_errors/{s.error}"] = metrics.get(f"task_errors/{s.error}", 0.0) + 1
    masked = any(s.action_mask for s in samples)
    if all(s.version_spans for s in samples):  # the oldest token's version, exactly
        version = min(s.version_spans[0].version for s in samples)
    spanned = any(len(s.version_spans) > 1 for s in samples)  # else every token is of `version`
    return RolloutGroup(
        prompt_id=index,
        prompt_ids=prompt,
        completion_ids=[s.token_ids for s in samples],
        behaviour_logprobs=[s.logprobs for s in samples],
        rewards=[s.reward for s in samples],
        version=version,
        sampler=sampler,
        generate_s=seconds,
        finished_at=finished,
        action_mask=[s.action_mask or [1] * len(s.token_ids) for s in samples] if masked else [],
        correct=[s.correct for s in samples],
        metrics=metrics,
        version_spans=[s.version_spans or [VersionSpan(0, version)] for s in samples] if spanned else [],
    )
