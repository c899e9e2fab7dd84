"""A reward model on a scorer actor: a sequence-classification checkpoint's scalar, read at each
completion's last real token in padded passes; combined with the task's reward by the documented
weighted sum in the driver."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scorer.reward import load_reward_model, sequence_rewards
from asyncrl.runtime import Supervisor

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

PROMPTS = [[5, 9, 7, 3], [4, 4]]
COMPLETIONS = [[8, 12, 6], [7], [9, 9, 9, 9, 9, 0]]  # the last ends with the pad id (0)


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from asyncrl.rl.model.policy import MARKER_FILE
    from asyncrl.rl.model.tokenizer import build_tokenizer

    path = str(tmp_path_factory.mktemp("rm"))
    tok = build_tokenizer()
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(
        Qwen2Config(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=1,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=None,
        )
    ).save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, MARKER_FILE), "w") as f:
        json.dump({"prompt_style": "compact", "max_new_tokens_hint": 24}, f)
    return path


def alone(model, seq: list[int]) -> float:
    """The score head on the last hidden state of one unpadded forward."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state
        return float(model.score(hidden[0, -1]))


def test_scores_are_read_at_the_last_real_token_whatever_the_padding(reward_path):
    cpu = torch.device("cpu")
    model = load_reward_model(reward_path, cpu)
    requests = [(p, COMPLETIONS) for p in PROMPTS]
    for budget in (10_000, 8):  # one forward, or one sequence a forward
        scores, forwards = sequence_rewards(model, requests, budget, cpu)
        assert forwards == (1 if budget > 8 else 6)
        for (prompt, completions), row in zip(requests, scores):
            assert row == pytest.approx([alone(model, prompt + c) for c in completions], abs=1e-5)
    # transformers' own pooling finds the last token by the pad id: it misreads a completion that
    # ends with it (the third), which ours reads where it ends
    with torch.no_grad():
        pooled = float(model(input_ids=torch.tensor([PROMPTS[0] + COMPLETIONS[2]])).logits[0, 0])
    assert pooled != pytest.approx(scores[0][2], abs=1e-4)


async def test_a_token_id_outside_the_reward_models_vocabulary_is_refused_naming_the_reward_model(reward_path):
    from asyncrl.rl.scorer.actor import ScorerActor, ScorerError
    from asyncrl.rl.scorer.specs import RewardSpec

    scorer = ScorerActor(reward_path, RewardSpec())
    vocab = scorer.scorer.vocab
    with pytest.raises(ScorerError) as err:
        await scorer.rewards([1, 2], [[3], [vocab]])
    assert str(err.value) == (
        f"scorer: token id {vocab} is outside the reward model's vocabulary of {vocab}: "
        "reward model and student tokenizers differ"
    )


async def test_the_driver_adds_the_reward_model_s_score_to_the_task_s_by_its_weights(reward_path):
    from asyncrl.rl.config.teacher import RewardModelConfig
    from asyncrl.rl.driver.teacher import RewardModel
    from asyncrl.rl.scorer.actor import ScorerActor, ScorerError
    from asyncrl.rl.scorer.specs import RewardSpec

    model = load_reward_model(reward_path, torch.device("cpu"))
    group = RolloutGroup(3, PROMPTS[1], COMPLETIONS, [[0.0] * len(c) for c in COMPLETIONS], [1.0, 0.0, 0.1], version=0)
    async with Supervisor(call_timeout_s=60) as sup:
        handle = await sup.spawn(
            ScorerActor, reward_path, RewardSpec(), name="reward_model", env={"OMP_NUM_THREADS": "1"}
        )
        config = RewardModelConfig(timeout_s=60, weight=0.5, rule_weight=2.0)
        scored = await RewardModel(handle, config, restart_timeout_s=60).annotate(group)
        expected = [2.0 * r + 0.5 * alone(model, PROMPTS[1] + c) for r, c in zip(group.rewards, COMPLETIONS)]
        assert scored.rewards == pytest.approx(expected, abs=1e-5)
        with pytest.raises(ScorerError, match="serves a reward, not a teacher"):
            await handle.teacher_logprobs(PROMPTS[1], COMPLETIONS)
