"""The train step's model FLOPs (trainer/flops.py): the counts a hand computation gives."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.trainer.flops import PEAK_BF16_FLOPS, decoder_parameters, peak_flops, step_flops


def tiny(tied: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config)


def group(prompt: int, completions: list[int]) -> RolloutGroup:
    return RolloutGroup(
        prompt_id=0,
        prompt_ids=[1] * prompt,
        completion_ids=[[2] * n for n in completions],
        behaviour_logprobs=[[0.0] * n for n in completions],
        rewards=[0.0] * len(completions),
        version=0,
    )


@pytest.mark.parametrize("tied", [True, False])
def test_decoder_parameters_leave_out_the_embedding_and_the_head(tied):
    model = tiny(tied)
    layers = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    assert decoder_parameters(model) == layers


def test_step_flops_match_a_hand_count():
    model = tiny(True)
    body = decoder_parameters(model)
    g = group(3, [5, 2])  # sequences of 8 and 5 tokens; 7 scored tokens
    h, layers, vocab = 16, 2, 100
    attention = 3 * 2 * (8 * 8 + 5 * 5) * h * layers  # causal: 2 s^2 H per layer forward, x3 with backward
    full = 6 * body * 13 + attention + 6 * vocab * h * 7
    frozen = 4 * body * 13 + attention + 4 * vocab * h * 7
    assert step_flops(model.config, body, [g], weights_train=True) == pytest.approx(full)
    assert step_flops(model.config, body, [g], weights_train=False) == pytest.approx(frozen)


def test_peak_flops_known_only_on_known_gpus():
    assert peak_flops(torch.device("cpu")) == 0.0
    assert PEAK_BF16_FLOPS["H100"] == 989e12
