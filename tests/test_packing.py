"""Packed sequences in the trainer (``trainer/packing.py``): several sequences per row, position ids
restarting per sequence, attention kept within each; the same loss and gradients as padded rows."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from asyncrl.rl.config.trainer import GRPOLossConfig, TrainerConfig
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scoring.forward import block_causal_mask, flat_logits, masked_logits, policy_logits
from asyncrl.rl.scoring.tokens import token_logprobs
from asyncrl.rl.trainer.batching import micro_batches
from asyncrl.rl.trainer.loss import group_advantages
from asyncrl.rl.trainer.metrics import TrainStepMetrics
from asyncrl.rl.trainer.packing import packed_micro_batches

CPU = torch.device("cpu")


def random_groups(seed: int, n_groups: int = 5, group_size: int = 4, multi_turn: bool = True) -> list[RolloutGroup]:
    """Groups with prompts and completions of varied lengths; with ``multi_turn``, some completions
    carry environment tokens (action mask 0) between two model turns."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randrange(2, 12))]
        completions, lps, masks = [], [], []
        for _ in range(group_size):
            n = rng.randrange(1, 24)
            completions.append([rng.randrange(3, 40) for _ in range(n)])
            lps.append([-rng.uniform(0.5, 4.0) for _ in range(n)])
            mask = [1] * n
            if multi_turn and n > 6 and rng.random() < 0.5:
                start = rng.randrange(1, n - 3)
                mask[start : start + 3] = [0, 0, 0]
            masks.append(mask)
        groups.append(
            RolloutGroup(
                g,
                prompt,
                completions,
                lps,
                [rng.choice([0.0, 0.1, 1.0]) for _ in completions],
                version=0,
                action_mask=masks,
            )
        )
    return groups


def gradients_of_a_step(
    path: str, config: TrainerConfig, groups, expect_checkpointing: bool = False
) -> tuple[TrainStepMetrics, list[torch.Tensor]]:
    from asyncrl.rl.trainer.actor import TrainerActor

    trainer = TrainerActor(path, config)
    checkpointing = any(getattr(m, "gradient_checkpointing", False) for m in trainer.model.modules())
    assert checkpointing == expect_checkpointing
    metrics = trainer.train_share(groups)
    return metrics, [p.grad.detach().clone() for p in trainer.model.parameters() if p.grad is not None]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "loss", [GRPOLossConfig(), GRPOLossConfig(aggregation="seq_mean", kl_coef=0.05)], ids=["token_mean", "seq_mean_kl"]
)
def test_packed_rows_give_the_padded_loss_and_gradients(embedded_path, attention, loss):
    """fp32 on the embedded model, multi-turn action masks included, micro-batches cut differently
    in the two layouts: loss, metrics and every parameter's gradient agree to 1e-5."""
    torch.set_num_threads(1)
    groups = random_groups(seed=1)
    base = TrainerConfig(micro_batch_tokens=200, loss=loss, attn_implementation=attention)
    padded, grads_padded = gradients_of_a_step(embedded_path, base, groups)
    packed, grads_packed = gradients_of_a_step(embedded_path, dataclasses.replace(base, pack_tokens=96), groups)
    assert packed.micro_batches < padded.micro_batches  # the packing did pack
    for key in ("loss", "pg_loss", "tokens", "sequences", "ratio_mean", "entropy") + (("kl",) if loss.kl_coef else ()):
        assert getattr(packed, key) == pytest.approx(getattr(padded, key), rel=1e-5, abs=1e-6), key
    assert any(g.abs().max() > 1e-4 for g in grads_padded)  # a gradient worth comparing
    for a, b in zip(grads_padded, grads_packed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lora", [0, 4])
def test_activation_checkpointing_gives_the_same_loss_and_gradients(embedded_path, lora):
    """Recomputing the layers' activations in the backward changes memory, not the step: fp32,
    packed multi-turn rows, full fine-tuning and a LoRA adapter on a frozen base."""
    from asyncrl.rl.config.trainer import LoRAConfig

    torch.set_num_threads(1)
    groups = random_groups(seed=4)
    base = TrainerConfig(micro_batch_tokens=200, pack_tokens=96, lora=LoRAConfig(rank=lora))
    plain, grads_plain = gradients_of_a_step(embedded_path, base, groups)
    ckpt, grads_ckpt = gradients_of_a_step(
        embedded_path, dataclasses.replace(base, activation_checkpointing=True), groups, expect_checkpointing=True
    )
    assert ckpt.loss == pytest.approx(plain.loss, rel=1e-6, abs=1e-7)
    assert len(grads_plain) == len(grads_ckpt) and any(g.abs().max() > 1e-4 for g in grads_plain)
    for a, b in zip(grads_plain, grads_ckpt):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_flattened_varlen_layout_scores_what_the_masked_rows_and_padding_score(embedded_path):
    """The layout flash attention gets (one row, boundaries from position ids; on this CPU build
    transformers turns it into its own block mask for sdpa) gives the padded log-probs too."""
    from asyncrl.rl.model.policy import load_policy

    torch.set_num_threads(1)
    model, _, _ = load_policy(embedded_path)
    groups = random_groups(seed=2)
    adv = group_advantages([list(g.rewards) for g in groups])
    (padded,) = micro_batches(groups, adv, 10_000, CPU)
    (packed,) = packed_micro_batches(groups, adv, 10_000, CPU, pack_tokens=80)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]
    with torch.no_grad():
        want = _by_content(padded, padded.scored(token_logprobs(policy_logits(model, padded), padded.input_ids)))
        for forward in (masked_logits, flat_logits):
            got = _by_content(packed, packed.scored(token_logprobs(forward(model, packed), packed.input_ids)))
            assert got.keys() == want.keys()
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)


def _by_content(batch, scores):
    """Each sequence's scored log-probs keyed by its behaviour log-probs (unique per sequence here)."""
    return {tuple(batch.behaviour[s][batch.mask[s]].tolist()): scores[s][batch.mask[s]] for s in range(len(batch.row))}


def test_rows_pack_within_the_budget_with_positions_restarting_per_sequence():
    groups = random_groups(seed=3, n_groups=8)
    adv = group_advantages([list(g.rewards) for g in groups])
    lengths = sorted(len(g.prompt_ids) + len(c) for g in groups for c in g.completion_ids)
    batches = packed_micro_batches(groups, adv, budget=200, device=CPU, pack_tokens=64)
    seen = []
    for b in batches:
        assert b.input_ids.numel() <= 200 or b.input_ids.shape[0] == 1
        assert b.input_ids.shape[1] <= 64
        for r in range(b.input_ids.shape[0]):
            pos = b.position_ids[r].tolist()
            starts = [i for i, p in enumerate(pos) if p == 0]
            for s, e in zip(starts, starts[1:] + [len(pos)]):
                assert pos[s:e] == list(range(e - s))  # restart at each sequence, count up within it
                if b.attention[r, s:e].all():
                    seen.append(e - s)
                else:
                    assert not b.attention[r, s:e].any()  # the trailing padding, a block of its own
        for s in range(len(b.row)):  # each completion's first scored position is its prompt's last token
            assert b.position_ids[b.row[s], b.score_index[s, 0] + 1] > 0
    assert sorted(seen) == lengths  # every sequence once


def test_a_sequence_longer_than_a_row_gets_a_row_of_its_own():
    long = RolloutGroup(0, [5, 6, 7], [[1] * 40, [2, 3]], [[-1.0] * 40, [-1.0, -1.0]], [1.0, 0.0], version=0)
    (batch,) = packed_micro_batches([long], group_advantages([[1.0, 0.0]]), budget=10_000, device=CPU, pack_tokens=16)
    assert batch.input_ids.shape == (2, 43) and batch.attention.sum(1).tolist() == [5, 43]
    assert batch.position_ids is None  # rows of one sequence each: the padded layout, no block mask


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_padded_rows_without_a_mask_score_what_each_sequence_scores_alone(embedded_path, attention):
    """Padded rows go in without a mask (the causal one keeps every token from its row's trailing
    padding: `layout_inputs`); each sequence's logits are those of its forward alone, unpadded."""
    from asyncrl.rl.model.policy import load_policy

    torch.set_num_threads(1)
    model, _, _ = load_policy(embedded_path)
    model.set_attn_implementation(attention)
    groups = random_groups(seed=4, n_groups=3)
    (batch,) = micro_batches(groups, group_advantages([list(g.rewards) for g in groups]), 10_000, CPU)
    lengths = batch.attention.sum(1).tolist()
    assert min(lengths) < batch.input_ids.shape[1]  # some rows are padded
    with torch.no_grad():
        rows = policy_logits(model, batch)
        for r, n in enumerate(lengths):
            alone = model(input_ids=batch.input_ids[r : r + 1, :n], use_cache=False).logits[0]
            torch.testing.assert_close(rows[r, :n], alone, rtol=1e-5, atol=1e-5)


def test_the_block_mask_never_crosses_a_sequence_boundary():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    allowed = block_causal_mask(positions)[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_a_row_longer_than_a_forward_is_refused():
    with pytest.raises(ValueError, match="pack_tokens must be in"):
        TrainerConfig(micro_batch_tokens=100, pack_tokens=200)
