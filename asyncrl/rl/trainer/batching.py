"""A batch of rollout groups as padded micro-batches within a token budget (the trainer's input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.rl.rollout import RolloutGroup


@dataclass
class MicroBatch:
    """One micro-batch of sequences: right-padded ``prompt + completion`` rows and, per row, where
    the completion's scores sit in ``token_logprobs``' output (index ``prompt_len - 1 + j``)."""

    input_ids: torch.Tensor  # [B, L]
    attention: torch.Tensor  # [B, L]
    score_index: torch.Tensor  # [B, C] positions in the [B, L-1] log-prob matrix
    mask: torch.Tensor  # [B, C] completion token j exists and is the policy's (not an environment's)
    behaviour: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]


def micro_batches(groups: list[RolloutGroup], advantages: torch.Tensor, budget: int, device: torch.device) -> list[MicroBatch]:
    """Cut the batch's sequences into micro-batches of at most ``budget`` padded tokens (a single
    sequence longer than the budget goes alone). Tokens an environment wrote (``action_mask`` 0)
    are context only: outside ``mask``, so they carry no loss and count in no normaliser."""
    rows = []
    a = 0
    for g in groups:
        masks = g.action_mask or [None] * len(g.completion_ids)
        for ids, lps, actions in zip(g.completion_ids, g.behaviour_logprobs, masks):
            rows.append((g.prompt_ids, ids, lps, float(advantages[a]), actions))
            a += 1
    rows.sort(key=lambda r: len(r[0]) + len(r[1]))  # similar lengths together: less padding
    out, chunk, longest = [], [], 0
    for row in rows:
        length = len(row[0]) + len(row[1])
        if chunk and max(longest, length) * (len(chunk) + 1) > budget:
            out.append(_pack(chunk, device))
            chunk, longest = [], 0
        chunk.append(row)
        longest = max(longest, length)
    if chunk:
        out.append(_pack(chunk, device))
    return out


def _pack(rows: list, device: torch.device) -> MicroBatch:
    length = max(len(r[0]) + len(r[1]) for r in rows)
    width = max(max(len(r[1]) for r in rows), 1)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    score_index = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    behaviour = torch.zeros(len(rows), width)
    for i, (prompt, completion, lps, _, actions) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        c = len(completion)
        score_index[i, :c] = torch.arange(len(prompt) - 1, len(prompt) - 1 + c)
        mask[i, :c] = True if actions is None else torch.tensor(actions, dtype=torch.bool)
        behaviour[i, :c] = torch.tensor(lps)
    advantages = torch.tensor([r[3] for r in rows])
    return MicroBatch(*(t.to(device) for t in (ids, attention, score_index, mask, behaviour, advantages)))
