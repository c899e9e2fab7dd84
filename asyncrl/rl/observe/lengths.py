"""Completion lengths and token version lags, counted so a user can see what was made, trained
and dropped (docs/grpo.md, "Long generations").

Lengths go in power-of-two buckets, each named by its upper bound: "256" holds completions of
129 to 256 tokens ("32" holds everything up to 32). A token's version lag is the version the
trainer trains into less one, minus the version that sampled it (`RolloutGroup.token_versions`):
0 for a token of the weights being trained.
"""

from __future__ import annotations

import msgspec

from asyncrl.rl.rollout import RolloutGroup

SMALLEST_BUCKET = 32


def length_bucket(tokens: int) -> int:
    """The bucket of a completion of ``tokens`` tokens: the least power of two >= it, at least 32."""
    return max(SMALLEST_BUCKET, 1 << max(tokens - 1, 0).bit_length())


class LengthTally:
    """Completions counted by length bucket."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, group: RolloutGroup) -> None:
        for ids in group.completion_ids:
            bucket = length_bucket(len(ids))
            self.counts[bucket] = self.counts.get(bucket, 0) + 1

    def hist(self) -> dict[str, int]:
        """By bucket, in order, keyed as JSON keys are (the bucket's bound as text)."""
        return {str(b): self.counts[b] for b in sorted(self.counts)}


class BatchLengths(msgspec.Struct, kw_only=True, frozen=True):
    """A step's batch by completion length and by token version lag (a part of `StepRecord`,
    written flattened: the field names are the metrics.jsonl keys)."""

    length_mean: float
    """Mean completion length trained, in tokens."""
    length_max: int
    """Longest completion trained."""
    length_hist: dict[str, int]
    """Completions trained by length bucket (see the module docstring)."""
    token_lag_mean: float
    """Mean version lag of the completion tokens trained."""
    token_lag_max: int
    """Largest version lag of a completion token trained."""
    token_lag_hist: dict[str, int]
    """Completion tokens trained by version lag."""
    spanning_groups: int
    """Groups of the batch whose tokens were sampled under more than one version."""

    def to_dict(self) -> dict[str, object]:
        return msgspec.to_builtins(self)


def batch_lengths(groups: list[RolloutGroup], trained_at: int) -> BatchLengths:
    """``groups`` as the step that trains them at version ``trained_at`` (the trainer's before the
    step) sees them."""
    tally = LengthTally()
    lags: dict[int, int] = {}
    lengths: list[int] = []
    for g in groups:
        tally.add(g)
        for i, ids in enumerate(g.completion_ids):
            lengths.append(len(ids))
            if not g.version_spans or not g.version_spans[i]:
                lag = trained_at - g.version
                lags[lag] = lags.get(lag, 0) + len(ids)
                continue
            for span, following in zip(g.version_spans[i], [*g.version_spans[i][1:], None]):
                end = len(ids) if following is None else following.start
                lag = trained_at - span.version
                lags[lag] = lags.get(lag, 0) + end - span.start
    tokens = sum(lags.values())
    return BatchLengths(
        length_mean=sum(lengths) / max(len(lengths), 1),
        length_max=max(lengths, default=0),
        length_hist=tally.hist(),
        token_lag_mean=sum(lag * n for lag, n in lags.items()) / max(tokens, 1),
        token_lag_max=max((lag for lag, n in lags.items() if n), default=0),
        token_lag_hist={str(lag): lags[lag] for lag in sorted(lags)},
        spanning_groups=sum(g.newest_version != g.version for g in groups),
    )
