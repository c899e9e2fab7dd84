"""Splitting one batch over the trainer's ranks, and the counts its loss is normalised by.

Every rank receives the whole batch (a few hundred KB of token ids) and computes the same split,
so no rank needs to hear from another to know its share or the global counts. The invariant that
makes N ranks compute what one rank would: advantages are computed over whole groups BEFORE the
split, and every rank divides its loss by the WHOLE batch's count of scored tokens (token_mean)
or of scored sequences (seq_mean). Summed across ranks (FSDP's reduce-scatter with a divide
factor of 1), the gradients are those of the whole batch. A per-rank mean would weigh each
rank's tokens by 1 / (its own count): the classic data-parallel GRPO bug.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch

from asyncrl.rl.rollout import RolloutGroup


def batch_counts(groups: list[RolloutGroup]) -> tuple[int, int]:
    """Scored tokens and scored sequences (those with at least one) of the whole batch: what
    ``micro_batches``' masks hold, counted without building them. Tokens an environment wrote
    (``action_mask`` 0) are not scored."""
    tokens = sequences = 0
    for g in groups:
        masks: Iterable[list[int] | None] = g.action_mask or [None] * len(g.completion_ids)
        for ids, actions in zip(g.completion_ids, masks):
            n = len(ids) if actions is None else sum(1 for a in actions if a)
            tokens += n
            sequences += n > 0
    return tokens, sequences


def rank_share(
    groups: list[RolloutGroup], advantages: torch.Tensor, rank: int, world_size: int
) -> tuple[list[RolloutGroup], torch.Tensor]:
    """This rank's sequences (as groups holding only them) and their advantages. Sequences go to
    ranks balanced by length (prompt + completion tokens: the forward's cost), longest first, each
    to the rank with the fewest tokens so far (ties to the lowest rank): the same split on every
    rank, since it depends only on the batch."""
    lengths = []
    for g in groups:
        lengths += [len(g.prompt_ids) + len(c) for c in g.completion_ids]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    load = [(0, r) for r in range(world_size)]
    mine: set[int] = set()
    for i in order:
        tokens, r = heapq.heappop(load)
        if r == rank:
            mine.add(i)
        heapq.heappush(load, (tokens + lengths[i], r))
    share, picked, index = [], [], 0
    for g in groups:
        rows = [j for j in range(len(g.completion_ids)) if index + j in mine]
        if rows:
            share.append(_subset(g, rows))
            picked += [index + j for j in rows]
        index += len(g.completion_ids)
    return share, advantages[picked] if picked else advantages[:0]


def _subset(g: RolloutGroup, rows: list[int]) -> RolloutGroup:
    """``g`` with only the completions ``rows`` (their rewards kept for the record; the
    advantages were computed from the whole group before)."""

    def pick(values):
        return [values[j] for j in rows] if values else values

    import msgspec

    return msgspec.structs.replace(
        g,
        completion_ids=pick(g.completion_ids),
        behaviour_logprobs=pick(g.behaviour_logprobs),
        rewards=pick(g.rewards),
        action_mask=pick(g.action_mask),
        **{name: pick(getattr(g, name)) for name in _PER_COMPLETION_EXTRA if getattr(g, name, None)},
    )


_PER_COMPLETION_EXTRA = ("correct", "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs", "version_spans")
