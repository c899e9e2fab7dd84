"""On-policy distillation, in process (no run): a teacher that knows the answers pulls a student
that hesitates between four of them toward the right one within a few steps; no teacher term, no
move. And a teacher with another tokenizer is refused before anything is spawned."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.trainer import GRPOLossConfig, TrainerConfig
from asyncrl.rl.driver.teacher import check_tokenizers
from asyncrl.rl.model.policy import load_policy
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scorer.actor import ScorerActor
from asyncrl.rl.trainer.actor import TrainerActor

pytest.register_assert_rewrite("sampler_support")
from sampler_support import write_tiny  # noqa: E402

PROMPTS = [[52, 53, 46, 54], [55, 56, 57, 46], [58, 52, 59, 60], [53, 53, 54, 61]]
CANDIDATES = [[60, 61], [62, 63], [64, 65], [66, 67]]  # the same four answers for every prompt
ANSWER = [0, 1, 2, 3]  # the right one, per prompt
GROUP = 8


def fitted(path: str, targets: list[list[list[int]]], steps: int = 40) -> str:
    """A tiny checkpoint trained (cross-entropy, full batch) to answer each prompt with its targets."""
    write_tiny(path, hidden_size=32)
    model, _, _ = load_policy(path)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.tensor([p + t for p, ts in zip(PROMPTS, targets) for t in ts])
    for _ in range(steps):
        loss = -torch.log_softmax(model(x).logits[:, 3:5], -1).gather(2, x[:, 4:6, None]).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path


@torch.no_grad()
def p_answer(model) -> float:
    """The student's mean probability of the whole right answer."""
    x = torch.tensor([p + CANDIDATES[a] for p, a in zip(PROMPTS, ANSWER)])
    return float(
        torch.log_softmax(model(x).logits[:, 3:5], -1).gather(2, x[:, 4:6, None]).squeeze(-1).sum(-1).exp().mean()
    )


@torch.no_grad()
def sampled_groups(model, generator) -> list[RolloutGroup]:
    """``GROUP`` two-token completions of each prompt sampled from ``model``, with their log-probs
    (on-policy: the behaviour policy is the trained one); no task reward."""
    groups = []
    for i, prompt in enumerate(PROMPTS):
        x, logprobs = torch.tensor([prompt] * GROUP), []
        for _ in range(2):
            logp = torch.log_softmax(model(x).logits[:, -1], -1)
            token = torch.multinomial(logp.exp(), 1, generator=generator)
            logprobs.append(logp.gather(1, token))
            x = torch.cat([x, token], 1)
        groups.append(
            RolloutGroup(i, prompt, x[:, 4:].tolist(), torch.cat(logprobs, 1).tolist(), [0.0] * GROUP, version=0)
        )
    return groups


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill")
    teacher = fitted(str(root / "teacher"), [[CANDIDATES[a]] for a in ANSWER])
    student = fitted(str(root / "student"), [CANDIDATES] * len(PROMPTS))
    yield student, teacher
    torch.set_num_threads(threads)


async def test_a_teacher_that_knows_the_answers_pulls_the_student_toward_them(checkpoints):
    student_path, teacher_path = checkpoints
    scorer = ScorerActor(teacher_path)
    await scorer.on_start()
    try:
        # measured (this 2-core machine): 0.16 -> 0.23 after one step, 0.29 after six
        trainer = TrainerActor(student_path, TrainerConfig(lr=3e-3, loss=GRPOLossConfig(distill_coef=0.3)))
        before, generator, kl = p_answer(trainer.model), torch.Generator().manual_seed(0), []
        for _ in range(6):
            groups = [
                msgspec.structs.replace(
                    g,
                    teacher_logprobs=await asyncio.wait_for(
                        scorer.teacher_logprobs(g.prompt_ids, g.completion_ids), timeout=60
                    ),
                )
                for g in sampled_groups(trainer.model, generator)
            ]
            kl.append(trainer._train_step(groups)["distill_kl"])
        after = p_answer(trainer.model)
        assert after > before + 0.08, (before, after, kl)
        # the same samples, no teacher term: no task reward either, so nothing moves
        plain = TrainerActor(student_path, TrainerConfig(lr=3e-3))
        metrics = plain._train_step(sampled_groups(plain.model, torch.Generator().manual_seed(0)))
        assert metrics["grad_norm"] == 0.0 and p_answer(plain.model) == pytest.approx(before, abs=1e-7)
    finally:
        await scorer.on_stop()


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    from transformers import AutoTokenizer

    student = write_tiny(str(tmp_path / "student"))
    check_tokenizers(student, student)
    other = write_tiny(str(tmp_path / "other"))
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(
        ConfigError,
        match=r"^--teacher\.model_path .* has another tokenizer than the student .* "
        r"\(262 vs 261 tokens; e\.g\. '<extra>'=261\): ",
    ) as caught:
        check_tokenizers(student, other)
    assert "\n" not in str(caught.value)
