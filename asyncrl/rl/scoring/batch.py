"""Sequences as micro-batches within a token budget, the input of every forward that scores them:
padded rows of one sequence each here (rows packing several: ``trainer/packing.py``). The trainer
makes its sequences from rollout groups (``trainer/batching.py``); a scorer from its requests
(`request_batches`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

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
    versions: torch.Tensor | None = None  # [S, C] the weight version that sampled each token; None: not known

    def to(self, device: torch.device, seqs: list[Sequence], width: int) -> MicroBatch:
        """This batch on ``device``, with the teacher's answers and the token versions of its
        ``seqs`` (``width`` completion positions each: `teacher_matrix`, `teacher_topk_tensors`,
        `version_matrix`)."""
        teacher_ids, teacher_topk = teacher_topk_tensors(seqs, width, device)
        moved = {
            f.name: t.to(device)
            for f in dataclasses.fields(self)
            if isinstance(t := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(
            self,
            **moved,
            teacher=teacher_matrix(seqs, width, device),
            teacher_ids=teacher_ids,
            teacher_topk=teacher_topk,
            versions=version_matrix(seqs, width, device),
        )

    def scored(self, per_position: torch.Tensor) -> torch.Tensor:
        """``[S, C, ...]``: the entries of a ``[R, L-1, ...]`` tensor (log-probs, logits) at each
        sequence's completion positions."""
        return per_position[self.row.unsqueeze(1), self.score_index]


class Sequence(NamedTuple):
    """One ``prompt + completion`` to score. What only training reads (the sampler's log-probs, the
    advantage, a teacher's answers) defaults to absent: a scorer's sequence is its two id lists."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour: list[float] | None = None  # the sampler's log-probs; None: zeros (nothing trains on them)
    advantage: float = 0.0
    action_mask: list[int] | None = None  # None: every completion token is the policy's
    teacher: list[float] | None = None  # a teacher's log-probs of the completion
    teacher_topk: tuple[int, list[int], list[float]] | None = None  # (K, top-K ids, their log-probs), flat
    versions: list[int] | None = None  # the weight version of each completion token (off-policy corrections)


class ScoreRequest(NamedTuple):
    """A scorer's request: one prompt and the completions of it to score."""

    prompt_ids: list[int]
    completion_ids: list[list[int]]


def sequence_length(seq: Sequence) -> int:
    return len(seq.prompt_ids) + len(seq.completion_ids)


def cut_by_budget(items: list[T], length: Callable[[T], int], budget: int) -> list[list[T]]:
    """Consecutive chunks of ``items`` of at most ``budget`` padded tokens (longest x count); an
    item longer than the budget goes alone. Sort ``items`` by length first: less padding."""
    out: list[list[T]] = []
    chunk: list[T] = []
    longest = 0
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


def padded_micro_batches(seqs: list[Sequence], budget: int, device: torch.device) -> list[MicroBatch]:
    """``seqs`` (in the order given: sort them by length first) cut into micro-batches of at most
    ``budget`` padded tokens (a single sequence longer than the budget goes alone), one sequence
    per row."""
    return [padded_batch(chunk, device) for chunk in cut_by_budget(seqs, sequence_length, budget)]


def request_batches(
    requests: list[ScoreRequest], budget: int, device: torch.device
) -> list[tuple[MicroBatch, list[tuple[int, int]]]]:
    """A scorer's requests as padded micro-batches of at most ``budget``
    tokens, sequences of similar length together, each with the ``(request, completion)`` index of
    its sequences in batch order: where each row's answer goes back to."""
    tagged = [
        ((r, j), Sequence(prompt, completion))
        for r, (prompt, completions) in enumerate(requests)
        for j, completion in enumerate(completions)
    ]
    tagged.sort(key=lambda t: sequence_length(t[1]))  # similar lengths together: less padding
    return [
        (padded_batch([seq for _, seq in chunk], device), [where for where, _ in chunk])
        for chunk in cut_by_budget(tagged, lambda t: sequence_length(t[1]), budget)
    ]


def padded_batch(rows: list[Sequence], device: torch.device) -> MicroBatch:
    """One micro-batch of ``rows``, one sequence per row, right-padded."""
    length = max(sequence_length(r) for r in rows)
    width = max(max(len(r.completion_ids) for r in rows), 1)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    score_index = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    behaviour = torch.zeros(len(rows), width)
    for i, seq in enumerate(rows):
        prompt, completion = seq.prompt_ids, seq.completion_ids
        n, c = len(prompt) + len(completion), len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        score_index[i, :c] = torch.arange(len(prompt) - 1, len(prompt) - 1 + c)
        mask[i, :c] = True if seq.action_mask is None else torch.tensor(seq.action_mask, dtype=torch.bool)
        if seq.behaviour is not None:
            behaviour[i, :c] = torch.tensor(seq.behaviour)
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    batch = MicroBatch(ids, attention, score_index, mask, behaviour, advantages, torch.arange(len(rows)))
    return batch.to(device, rows, width)


def teacher_matrix(seqs: list[Sequence], width: int, device: torch.device) -> torch.Tensor | None:
    """``[S, width]`` teacher log-probs of ``seqs`` (0 past each completion), or None when no
    sequence has them; a batch with some and not others is refused (a scorer left one out)."""
    teachers = [s.teacher for s in seqs if s.teacher is not None]
    if not teachers:
        return None
    if len(teachers) < len(seqs):
        raise ValueError(f"{len(seqs) - len(teachers)} of {len(seqs)} sequences have no teacher log-probs")
    out = torch.zeros(len(seqs), width)
    for i, teacher in enumerate(teachers):
        out[i, : len(teacher)] = torch.tensor(teacher)
    return out.to(device)


def version_matrix(seqs: list[Sequence], width: int, device: torch.device) -> torch.Tensor | None:
    """``[S, width]`` int64 weight versions of ``seqs``' completion tokens (0 past each
    completion), or None when no sequence has them; a batch with some and not others is refused."""
    present = [s.versions is not None for s in seqs]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"{present.count(False)} of {len(seqs)} sequences have no token versions")
    out = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        versions = s.versions or []
        out[i, : len(versions)] = torch.tensor(versions, dtype=torch.long)
    return out.to(device)


def teacher_topk_tensors(
    seqs: list[Sequence], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """``teacher_ids`` and ``teacher_topk`` (``[S, width, K]``; id 0 and log-prob 0 past each
    completion) of ``seqs``' teacher top-K, or two None when no sequence has one; a batch with some
    and not others, or two K, is refused (a scorer left one out)."""
    tops = [s.teacher_topk for s in seqs]
    if all(t is None for t in tops):
        return None, None
    ks = {t[0] if t is not None else None for t in tops}
    given = [t for t in tops if t is not None]
    if len(ks) != 1 or len(given) < len(tops):
        raise ValueError(f"the sequences' teacher top-K differ: K of {sorted(ks, key=str)} (None: no top-K)")
    k = given[0][0]
    ids = torch.zeros(len(seqs), width, k, dtype=torch.long)
    values = torch.zeros(len(seqs), width, k)
    for i, (s, (_, top_ids, top_lps)) in enumerate(zip(seqs, given)):
        n = len(s.completion_ids)
        ids[i, :n] = torch.tensor(top_ids, dtype=torch.long).view(n, k)
        values[i, :n] = torch.tensor(top_lps).view(n, k)
    return ids.to(device), values.to(device)
