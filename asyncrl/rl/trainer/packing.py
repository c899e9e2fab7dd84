"""Packed sequences: several ``prompt + completion`` sequences share one row of the trainer's
forward pass, so that short completions stop paying for the longest one's padding.

Layout (see `MicroBatch`): sequences are laid end to end in a row of at most ``pack_tokens``
tokens; ``position_ids`` restart at 0 at every sequence, and the row's trailing padding is one more
"sequence" of its own (so no token is left with nothing to attend to: an all-masked row of
attention is NaN in sdpa). Attention never crosses a boundary: how the forward keeps it within a
sequence, by the model's attention implementation, is ``scoring/forward.py``'s.

The loss side does not change: each sequence keeps its own ``[C]`` row of scores, mask, behaviour
log-probs and advantage (`MicroBatch.scored` reads them at ``(row, offset + P - 1 + j)``), so the
token-mean and seq-mean normalisers count what they count in the padded layout.
"""

from __future__ import annotations

import torch

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scoring.batch import (
    MicroBatch,
    Sequence,
    cut_by_budget,
    sequence_length,
)
from asyncrl.rl.trainer.batching import sequences


def packed_micro_batches(
    groups: list[RolloutGroup], advantages: torch.Tensor, budget: int, device: torch.device, pack_tokens: int
) -> list[MicroBatch]:
    """`micro_batches` with several sequences per row: the batch's sequences packed into rows of at
    most ``pack_tokens`` tokens (first fit, longest first: a
    sequence longer than that gets a row of its own), then cut the rows into micro-batches of at
    most ``budget`` tokens (rows x longest row)."""
    rows: list[list[Sequence]] = []
    fill: list[int] = []
    for seq in sorted(sequences(groups, advantages), key=sequence_length, reverse=True):
        n = sequence_length(seq)
        for r, used in enumerate(fill):
            if used + n <= pack_tokens:
                rows[r].append(seq)
                fill[r] += n
                break
        else:
            rows.append([seq])
            fill.append(n)
    rows.sort(key=_row_length)
    return [_build(chunk, device) for chunk in cut_by_budget(rows, _row_length, budget)]


def _row_length(row: list[Sequence]) -> int:
    return sum(sequence_length(s) for s in row)


def _build(rows: list[list[Sequence]], device: torch.device) -> MicroBatch:
    length = max(_row_length(r) for r in rows)
    seqs = [s for r in rows for s in r]
    width = max(max(len(s[1]) for s in seqs), 1)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    positions = torch.zeros(len(rows), length, dtype=torch.long)
    score_index = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    behaviour = torch.zeros(len(seqs), width)
    row_of = torch.zeros(len(seqs), dtype=torch.long)
    s = 0
    for r, row in enumerate(rows):
        offset = 0
        for seq in row:
            prompt, completion, lps, actions = seq.prompt_ids, seq.completion_ids, seq.behaviour, seq.action_mask
            n, p, c = len(prompt) + len(completion), len(prompt), len(completion)
            ids[r, offset : offset + n] = torch.tensor(prompt + completion)
            attention[r, offset : offset + n] = 1
            positions[r, offset : offset + n] = torch.arange(n)
            score_index[s, :c] = torch.arange(offset + p - 1, offset + p - 1 + c)
            mask[s, :c] = True if actions is None else torch.tensor(actions, dtype=torch.bool)
            behaviour[s, :c] = torch.tensor(lps)
            row_of[s] = r
            offset += n
            s += 1
        positions[r, offset:] = torch.arange(length - offset)  # the padding: a sequence of its own
    advantages = torch.tensor([seq.advantage for seq in seqs], dtype=torch.float32)
    # Rows of one sequence each are the padded layout: no position ids, so the forward needs no
    # block mask and attention runs its causal kernels (scoring/forward.py). Long sequences, a row
    # each, land here.
    single = all(len(row) == 1 for row in rows)
    batch = MicroBatch(ids, attention, score_index, mask, behaviour, advantages, row_of, None if single else positions)
    return batch.to(device, seqs, width)
