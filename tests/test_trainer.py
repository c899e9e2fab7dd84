"""The trainer's batching: micro-batches by token budget, and completion scores read at the right
(causally shifted) positions of sequences with different prompt lengths."""

from __future__ import annotations

import torch

from asyncrl.rl.loss import group_advantages, token_logprobs
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.trainer import micro_batches


def group(prompt_id, prompt, completions, rewards):
    return RolloutGroup(prompt_id, prompt, completions, [[-1.0 - 0.1 * j for j in range(len(c))] for c in completions],
                        rewards, version=0)


GROUPS = [group(0, [5, 6, 7], [[1, 2], [3], [4, 4, 4, 4]], [1.0, 0.0, 0.1]),
          group(1, [9], [[2, 2, 2], [8]], [0.0, 1.0])]


def test_every_completion_token_is_scored_by_the_logit_before_it():
    torch.manual_seed(0)
    adv = group_advantages([list(g.rewards) for g in GROUPS])
    (batch,) = micro_batches(GROUPS, adv, budget=10_000, device=torch.device("cpu"))
    logits = torch.randn(*batch.input_ids.shape, 11)
    scored = token_logprobs(logits, batch.input_ids).gather(1, batch.score_index)
    seen = 0
    for row in range(batch.input_ids.shape[0]):
        ids = batch.input_ids[row][batch.attention[row].bool()].tolist()
        for g in GROUPS:
            for c in g.completion_ids:
                if ids == g.prompt_ids + c:
                    p = len(g.prompt_ids)
                    for j, token in enumerate(c):
                        manual = torch.log_softmax(logits[row, p - 1 + j], -1)[token]
                        assert torch.isclose(scored[row, j], manual)
                        assert batch.mask[row, j]
                    assert not batch.mask[row, len(c):].any()
                    seen += 1
    assert seen == 5 and int(batch.mask.sum()) == 2 + 1 + 4 + 3 + 1


def test_micro_batches_respect_the_token_budget_and_keep_every_sequence_once():
    adv = group_advantages([list(g.rewards) for g in GROUPS])
    batches = micro_batches(GROUPS, adv, budget=8, device=torch.device("cpu"))
    assert len(batches) > 1
    for b in batches:
        assert b.input_ids.numel() <= 8 or b.input_ids.shape[0] == 1
    assert sum(b.input_ids.shape[0] for b in batches) == 5
    got = sorted(float(a) for b in batches for a in b.advantages)
    assert got == sorted(float(a) for a in adv)
    # the behaviour log-probs travel with their tokens
    for b in batches:
        for row in range(b.mask.shape[0]):
            n = int(b.mask[row].sum())
            assert torch.allclose(b.behaviour[row, :n], torch.tensor([-1.0 - 0.1 * j for j in range(n)]))
