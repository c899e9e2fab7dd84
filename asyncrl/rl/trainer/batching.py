"""A batch of rollout groups as micro-batches within a token budget (the trainer's input): padded
rows of one sequence each here, or rows packing several sequences (``trainer/packing.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from asyncrl.rl.rollout import RolloutGroup

T = TypeVar("T")


@dataclass
class MicroBatch:
    """One micro-batch: ``R`` rows of ``L`` tokens holding ``S`` sequences ``prompt + completion``
    and, per sequence, where its completion's scores sit in ``token_logprobs``' ``[R, L-1]`` output
    (row ``row[s]``, index ``offset + prompt_len - 1 + j``). Padded: one sequence per row
    (``row[s] == s``, offset 0). Packed: several per row, ``position_ids`` restarting at 0 at each
    sequence (and at the row's trailing padding), so that attention can be kept within them."""

    input_ids: torch.Tensor  # [R, L]
    attention: torch.Tensor  # [R, L] 1 where a sequence's token is, 0 on padding
    score_index: torch.Tensor  # [S, C] positions in the [R, L-1] log-prob matrix
    mask: torch.Tensor  # [S, C] completion token j exists and is the policy's (not an environment's)
    behaviour: torch.Tensor  # [S, C]
    advantages: torch.Tensor  # [S]
    row: torch.Tensor  # [S] the row of input_ids sequence s lies in
    position_ids: torch.Tensor | None = None  # [R, L] packed rows only; None: one sequence per row
    teacher: torch.Tensor | None = None  # [S, C] a teacher's log-probs (distillation); None: no teacher
    teacher_ids: torch.Tensor | None = None  # [S, C, K] a teacher's top-K ids (--teacher.top_k); None: none
    teacher_topk: torch.Tensor | None = None  # [S, C, K] the teacher's log-probs of teacher_ids

    def scored(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[S, C, ...]``: the entries of a ``[R, L-1, ...]`` tensor (log-probs, logits) at each
        sequence's completion positions."""
        return per_position[self.row.unsqueeze(1), self.score_index]


Sequence = tuple  # (prompt_ids, completion_ids, behaviour log-probs, advantage, action mask or None,
#                    teacher log-probs or None, (K, teacher top-K ids, their log-probs) or None)


def sequences(groups: list[RolloutGroup], advantages: torch.Tensor) -> list[Sequence]:
    """Each completion of the batch as one ``Sequence``, in batch order."""
    out = []
    a = 0
    for g in groups:
        masks = g.action_mask or [None] * len(g.completion_ids)
        teachers = g.teacher_logprobs or [None] * len(g.completion_ids)
        tops = (
            [(g.teacher_top_k, i, v) for i, v in zip(g.teacher_topk_ids, g.teacher_topk_logprobs)]
            if g.teacher_top_k
            else [None] * len(g.completion_ids)
        )
        for ids, lps, actions, teacher, top in zip(g.completion_ids, g.behaviour_logprobs, masks, teachers, tops):
            out.append((g.prompt_ids, ids, lps, float(advantages[a]), actions, teacher, top))
            a += 1
    return out


def cut_by_budget(items: list[T], length: Callable[[T], int], budget: int) -> list[list[T]]:
    """Consecutive chunks of ``items`` of at most ``budget`` padded tokens (longest x count); an
    item longer than the budget goes alone. Sort ``items`` by length first: less padding."""
    out, chunk, longest = [], [], 0
    for item in items:
        n = length(item)
        if chunk and max(longest, n) * (len(chunk) + 1) > budget:
            out.append(chunk)
            chunk, longest = [], 0
        chunk.append(item)
        longest = max(longest, n)
    if chunk:
        out.append(chunk)
    return out


def micro_batches(
    groups: list[RolloutGroup], advantages: torch.Tensor, budget: int, device: torch.device
) -> list[MicroBatch]:
    """Cut the batch's sequences into micro-batches of at most ``budget`` padded tokens (a single
    sequence longer than the budget goes alone), one sequence per row (several: ``packing.py``).
    Tokens an environment wrote (``action_mask`` 0) are context only: outside ``mask``, so they
    carry no loss and count in no normaliser."""
    seqs = sequences(groups, advantages)
    seqs.sort(key=_length)  # similar lengths together: less padding
    return [_pad(chunk, device) for chunk in cut_by_budget(seqs, _length, budget)]


def _length(seq: Sequence) -> int:
    return len(seq[0]) + len(seq[1])


def _pad(rows: list[Sequence], device: torch.device) -> MicroBatch:
    length = max(_length(r) for r in rows)
    width = max(max(len(r[1]) for r in rows), 1)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    score_index = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    behaviour = torch.zeros(len(rows), width)
    for i, (prompt, completion, lps, _, actions, *_teacher) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        c = len(completion)
        score_index[i, :c] = torch.arange(len(prompt) - 1, len(prompt) - 1 + c)
        mask[i, :c] = True if actions is None else torch.tensor(actions, dtype=torch.bool)
        behaviour[i, :c] = torch.tensor(lps)
    advantages = torch.tensor([r[3] for r in rows])
    row = torch.arange(len(rows))
    return MicroBatch(
        *(t.to(device) for t in (ids, attention, score_index, mask, behaviour, advantages, row)),
        teacher=teacher_matrix(rows, width, device),
        **teacher_topk_tensors(rows, width, device),
    )


def teacher_matrix(seqs: list[Sequence], width: int, device: torch.device) -> torch.Tensor | None:
    """``[S, width]`` teacher log-probs of ``seqs`` (0 past each completion), or None when no
    sequence has them; a batch with some and not others is refused (a scorer left one out)."""
    present = [s[5] is not None for s in seqs]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"{present.count(False)} of {len(seqs)} sequences have no teacher log-probs")
    out = torch.zeros(len(seqs), width)
    for i, s in enumerate(seqs):
        out[i, : len(s[5])] = torch.tensor(s[5])
    return out.to(device)


def teacher_topk_tensors(seqs: list[Sequence], width: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``teacher_ids`` and ``teacher_topk`` (``[S, width, K]``; id 0 and log-prob 0 past each
    completion) of ``seqs``' teacher top-K, or {} when no sequence has one; a batch with some and
    not others, or two K, is refused (a scorer left one out)."""
    tops = [s[6] for s in seqs]
    if all(t is None for t in tops):
        return {}
    ks = {t[0] if t is not None else None for t in tops}
    if len(ks) != 1:
        raise ValueError(f"the sequences' teacher top-K differ: K of {sorted(ks, key=str)} (None: no top-K)")
    k = ks.pop()
    ids = torch.zeros(len(seqs), width, k, dtype=torch.long)
    values = torch.zeros(len(seqs), width, k)
    for i, (s, (_, top_ids, top_lps)) in enumerate(zip(seqs, tops)):
        n = len(s[1])
        ids[i, :n] = torch.tensor(top_ids, dtype=torch.long).view(n, k)
        values[i, :n] = torch.tensor(top_lps).view(n, k)
    return {"teacher_ids": ids.to(device), "teacher_topk": values.to(device)}
