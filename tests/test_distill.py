"""On-policy distillation, in process (no run): a student that hesitates between four answers is
pulled toward each prompt's answer by a teacher that knows it, and away from it by a teacher that
knows other answers, in either form (the sampled token's log-prob, or the teacher's top-K); no
teacher term, no move. And a teacher with another tokenizer is refused before anything is spawned.

The learning tests assert directions against that control, not distances (issue 44). How far a few
steps move so tiny a model is no property of the method: it changes with the CPU's floating-point
path (AVX-512, AVX2 or the scalar kernels, forced with ATEN_CPU_CAPABILITY) and with the sampling
seed. Over 10 seeds on 4 such paths, what held every time is asserted; what the runs measured is
said beside it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import NamedTuple

import msgspec
import pytest
import torch

from asyncrl.rl.config.parse import ConfigError
from asyncrl.rl.config.trainer import GRPOLossConfig, TrainerConfig
from asyncrl.rl.driver.teacher import check_tokenizers
from asyncrl.rl.model.policy import load_policy
from asyncrl.rl.rollout import RolloutGroup
from asyncrl.rl.scorer.actor import ScorerActor, ScorerError
from asyncrl.rl.scorer.specs import TeacherSpec, scorer_spec
from asyncrl.rl.trainer.actor import TrainerActor
from sampler_support import write_tiny

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

PROMPTS = [[52, 53, 46, 54], [55, 56, 57, 46], [58, 52, 59, 60], [53, 53, 54, 61]]
CANDIDATES = [[60, 61], [62, 63], [64, 65], [66, 67]]  # the same four answers for every prompt
ANSWER = [0, 1, 2, 3]  # the right one, per prompt
ROTATED = [1, 2, 3, 0]  # the control teacher's: every prompt's answer is another's
GROUP = 8
FIT_STEPS = 150
"""To convergence: the student's four answers then have 1/4 each within 0.003 on every CPU path
tried. At 40 steps (the fit before issue 44) it was still on its way, somewhere between 0.18 and
0.24 by the path, and the first distillation steps mostly finished its fit, whatever the teacher."""


def fitted(path: str, targets: list[list[list[int]]], steps: int = FIT_STEPS) -> str:
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
def p_answer(model, answer: list[int] = ANSWER) -> float:
    """The mean over prompts of the model's probability of the prompt's whole answer. Since every
    candidate is one prompt's answer, a move common to all prompts leaves it where it was: only
    telling the prompts apart moves it."""
    x = torch.tensor([p + CANDIDATES[a] for p, a in zip(PROMPTS, answer)])
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


class Checkpoints(NamedTuple):
    student: str  # hesitates: each prompt's four answers alike
    teacher: str  # knows each prompt's answer (ANSWER)
    rotated: str  # knows other answers (ROTATED): the control


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Iterator[Checkpoints]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("distill")
    made = Checkpoints(
        student=fitted(str(root / "student"), [CANDIDATES] * len(PROMPTS)),
        teacher=fitted(str(root / "teacher"), [[CANDIDATES[a]] for a in ANSWER]),
        rotated=fitted(str(root / "rotated"), [[CANDIDATES[a]] for a in ROTATED]),
    )
    student = load_policy(made.student)[0]
    assert p_answer(student) == pytest.approx(0.25, abs=0.01) == p_answer(student, ROTATED)  # it hesitates
    assert p_answer(load_policy(made.teacher)[0]) > 0.9 and p_answer(load_policy(made.rotated)[0], ROTATED) > 0.9
    yield made
    torch.set_num_threads(threads)


async def with_logprobs(scorer: ScorerActor, group: RolloutGroup) -> RolloutGroup:
    """``group`` with the teacher's log-prob of each sampled token (``--teacher.top_k 0``)."""
    logprobs = await asyncio.wait_for(scorer.teacher_logprobs(group.prompt_ids, group.completion_ids), timeout=60)
    return msgspec.structs.replace(group, teacher_logprobs=logprobs)


async def with_topk(scorer: ScorerActor, group: RolloutGroup) -> RolloutGroup:
    """``group`` with the teacher's top-K at each sampled position (``--teacher.top_k K``)."""
    topk = await asyncio.wait_for(scorer.teacher_topk(group.prompt_ids, group.completion_ids), timeout=60)
    return msgspec.structs.replace(
        group, teacher_top_k=topk.k, teacher_topk_ids=topk.ids, teacher_topk_logprobs=topk.logprobs
    )


async def distilled(student_path: str, teacher_path: str, top_k: int, steps: int, lr: float, seed: int = 0):
    """The student after ``steps`` on-policy steps toward the teacher at ``lr`` (every reward 0),
    and each step's metrics."""
    scorer = ScorerActor(teacher_path, TeacherSpec(top_k=top_k))
    await scorer.on_start()
    try:
        trainer = TrainerActor(student_path, TrainerConfig(lr=lr, loss=GRPOLossConfig(distill_coef=0.3)))
        generator, annotate, metrics = torch.Generator().manual_seed(seed), with_topk if top_k else with_logprobs, []
        for _ in range(steps):
            groups = [await annotate(scorer, g) for g in sampled_groups(trainer.model, generator)]
            metrics.append(trainer.train_share(groups))
        return trainer.model, metrics
    finally:
        await scorer.on_stop()


async def test_a_teacher_that_knows_the_answers_pulls_the_student_toward_them(checkpoints):
    """The sampled token's form, 10 steps at lr 1e-3: the student's probability of the answers goes
    up with the teacher that knows them, and less far or down with the rotated one. Measured over 10
    seeds on 4 CPU paths, from 0.249: up by 0.007 at the least (by 0.025 to 0.050 on the mean of a
    path); with the rotated teacher down by 0.012 to 0.030 on the mean, but up by as much as 0.021
    in one run, one sampled token being a noisy estimate; the pair, which starts from the same
    samples, 0.023 apart at the least. Past about 12 steps at this rate the tiny student begins to
    put mass on a token no answer starts with (where looked at, the answer's second token: one
    output head serves both positions), and runs diverge."""
    before = p_answer(load_policy(checkpoints.student)[0])
    toward, metrics = await distilled(checkpoints.student, checkpoints.teacher, top_k=0, steps=10, lr=1e-3)
    away, _ = await distilled(checkpoints.student, checkpoints.rotated, top_k=0, steps=10, lr=1e-3)
    moved = (before, p_answer(toward), p_answer(away), [m.distill_kl for m in metrics])
    assert p_answer(toward) > before and p_answer(toward) > p_answer(away), moved
    # the same samples, no teacher term: no task reward either, so nothing moves
    plain = TrainerActor(checkpoints.student, TrainerConfig(lr=1e-3))
    metrics = plain.train_share(sampled_groups(plain.model, torch.Generator().manual_seed(0)))
    assert metrics.grad_norm == 0.0 and p_answer(plain.model) == pytest.approx(before, abs=1e-7)


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


# --- the teacher's top-K (--teacher.top_k): the K+1-bucket reverse KL in the loss ----------------


@torch.no_grad()
def direct_topk(model, prompt: list[int], completion: list[int], k: int, temperature: float = 1.0):
    """The teacher's top-``k`` log-probs and ids at each completion position, from one plain forward."""
    x = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(x).logits[0, len(prompt) - 1 : -1].float() / temperature, -1)
    return torch.topk(logp, k, dim=-1)


def check_topk(model, prompt: list[int], completions: list[list[int]], k: int, ids, logprobs, temperature: float):
    """``ids`` / ``logprobs`` (flat per completion) are ``model``'s top-``k`` at each position."""
    assert len(ids) == len(logprobs) == len(completions)
    for top_ids, top_lps, completion in zip(ids, logprobs, completions):
        ref = direct_topk(model, prompt, completion, k, temperature)
        assert len(top_ids) == len(top_lps) == len(completion) * k
        got_ids, got_lps = torch.tensor(top_ids).view(-1, k), torch.tensor(top_lps).view(-1, k)
        torch.testing.assert_close(got_lps, ref.values, atol=1e-5, rtol=0)
        assert got_ids[:, 0].tolist() == ref.indices[:, 0].tolist()  # past it a tie may come in either order
        with torch.no_grad():
            x = torch.tensor([prompt + completion])
            logp = torch.log_softmax(model(x).logits[0, len(prompt) - 1 : -1].float() / temperature, -1)
        torch.testing.assert_close(logp.gather(-1, got_ids), got_lps, atol=1e-5, rtol=0)  # each id's own


async def test_the_scorer_answers_the_teacher_s_top_k_of_a_direct_forward(checkpoints):
    teacher_path = checkpoints.teacher
    scorer = ScorerActor(teacher_path, TeacherSpec(temperature=0.7, top_k=5))
    await scorer.on_start()
    try:
        completions = [[60, 61], [64], [66, 67, 62]]
        got = await asyncio.wait_for(scorer.teacher_topk(PROMPTS[1], completions), timeout=60)
        assert got.k == 5
        check_topk(scorer.scorer.model, PROMPTS[1], completions, 5, got.ids, got.logprobs, 0.7)
        with pytest.raises(ScorerError, match="teacher_topk"):
            await scorer.teacher_logprobs(PROMPTS[1], completions)
    finally:
        await scorer.on_stop()


async def test_the_driver_s_teacher_gets_the_whole_distribution_from_a_scorer_process_for_a_k_past_the_vocab(
    checkpoints,
):
    """--teacher.top_k 1000 on a vocabulary of 261: clamped, every id once a position, over the
    wire (`TeacherTopK`) into the group the trainer takes."""
    from asyncrl.rl.config.teacher import TeacherConfig
    from asyncrl.rl.driver.teacher import Teacher
    from asyncrl.rl.rollout import validate_group
    from asyncrl.runtime import Supervisor

    student_path, teacher_path = checkpoints.student, checkpoints.teacher
    section = TeacherConfig(model_path=teacher_path, top_k=1000, timeout_s=60)
    spec = scorer_spec(section, student_path, temperature=1.0)
    completions = [[60, 61], [64, 65]]
    group = RolloutGroup(1, PROMPTS[1], completions, [[-1.0] * len(c) for c in completions], [0.0, 0.0], version=0)
    async with Supervisor(call_timeout_s=60) as sup:
        handle = await sup.spawn(ScorerActor, teacher_path, spec, name="scorer", env={"OMP_NUM_THREADS": "1"})
        scored = await Teacher(handle, section, restart_timeout_s=60).annotate(group)
    validate_group(scored)
    assert scored.teacher_top_k == 261 and not scored.teacher_logprobs
    model, _, _ = load_policy(teacher_path)
    check_topk(model, PROMPTS[1], completions, 261, scored.teacher_topk_ids, scored.teacher_topk_logprobs, 1.0)
    for ids in scored.teacher_topk_ids:
        assert all(sorted(ids[i * 261 : (i + 1) * 261]) == list(range(261)) for i in range(2))


async def test_a_teacher_s_top_k_pulls_the_student_toward_the_answers_with_no_task_reward(checkpoints):
    """Distillation alone (every reward 0, so every group is uniform and GRPO's term is 0): the
    K+1-bucket KL in the loss is the whole signal, 4 steps at lr 2e-3. Whole distributions are a far
    less noisy estimate than one token: each run goes up with the teacher and down with the rotated
    one. Measured over 10 seeds on 4 CPU paths, from 0.249: up by 0.042 to 0.108 (the path decides
    most of that: 0.044 with AVX-512, 0.108 with the scalar kernels), down by 0.022 to 0.034, and
    distill_kl lower after the 4 steps than at the first in every run."""
    before = p_answer(load_policy(checkpoints.student)[0])
    toward, metrics = await distilled(checkpoints.student, checkpoints.teacher, top_k=8, steps=4, lr=2e-3)
    away, _ = await distilled(checkpoints.student, checkpoints.rotated, top_k=8, steps=4, lr=2e-3)
    kl = [m.distill_kl for m in metrics]
    assert all(m.pg_loss == 0.0 and m.grad_norm > 0 for m in metrics)  # the KL term alone
    assert p_answer(toward) > before > p_answer(away), (before, p_answer(toward), p_answer(away), kl)
    assert kl[-1] < kl[0], kl


def test_a_negative_top_k_is_refused_in_one_line_and_a_top_k_that_does_not_fit_its_group_too():
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import parse_overrides
    from asyncrl.rl.rollout import InvalidGroupError, validate_group

    config = parse_overrides(GRPOConfig(), ["--teacher.top_k", "261"])
    assert config.teacher.top_k == 261
    with pytest.raises(ConfigError, match=r"top_k must be an integer >= 0") as caught:
        parse_overrides(GRPOConfig(), ["--teacher.top_k", "-1"])
    assert "\n" not in str(caught.value) and "--teacher.top_k" in str(caught.value)
    group = RolloutGroup(0, [5], [[6, 7]], [[-1.0, -1.0]], [0.0], version=0)
    validate_group(
        msgspec.structs.replace(
            group, teacher_top_k=2, teacher_topk_ids=[[1, 2, 3, 4]], teacher_topk_logprobs=[[-1.0, -2.0, -1.0, -2.0]]
        )
    )
    with pytest.raises(InvalidGroupError, match=r"completion 0 has 2 token ids but 3 teacher_topk_ids \(need 2 x 2\)"):
        validate_group(
            msgspec.structs.replace(
                group, teacher_top_k=2, teacher_topk_ids=[[1, 2, 3]], teacher_topk_logprobs=[[-1.0, -2.0, -1.0, -2.0]]
            )
        )
