"""A batch of rollout groups as the trainer's micro-batches within a token budget: each completion
one `Sequence` (``scoring/batch.py``) with its behaviour log-probs, advantage, teacher's answers
and each token's weight version, in padded rows of one sequence each here, or rows packing several
(``trainer/packing.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scoring.batch import MicroBatch, Sequence, padded_micro_batches, sequence_length


def sequences(groups: list[RolloutGroup], advantages: torch.Tensor) -> list[Sequence]:
    """Each completion of the batch as one ``Sequence``, in batch order."""
    out = []
    a = 0
    for g in groups:
        masks: Iterable[list[int] | None] = g.action_mask or [None] * len(g.completion_ids)
        teachers: Iterable[list[float] | None] = g.teacher_logprobs or [None] * len(g.completion_ids)
        tops = (
            [(g.teacher_top_k, i, v) for i, v in zip(g.teacher_topk_ids, g.teacher_topk_logprobs)]
            if g.teacher_top_k
            else [None] * len(g.completion_ids)
        )
        for i, (ids, lps, actions, teacher, top) in enumerate(
            zip(g.completion_ids, g.behaviour_logprobs, masks, teachers, tops)
        ):
            out.append(
                Sequence(g.prompt_ids, ids, lps, float(advantages[a]), actions, teacher, top, g.token_versions(i))
            )
            a += 1
    return out


def micro_batches(
    groups: list[RolloutGroup], advantages: torch.Tensor, budget: int, device: torch.device
) -> list[MicroBatch]:
    """Cut the batch's sequences into micro-batches of at most ``budget`` padded tokens (a single
    sequence longer than the budget goes alone), one sequence per row (several: ``packing.py``).
    Tokens an environment wrote (``action_mask`` 0) are context only: outside ``mask``, so they
    carry no loss and count in no normaliser."""
    seqs = sequences(groups, advantages)
    seqs.sort(key=sequence_length)  # similar lengths together: less padding
    return padded_micro_batches(seqs, budget, device)
