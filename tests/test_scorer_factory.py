"""Scorers as an interface and a factory (``rl/scorer/base.py``, ``factory.py``): the factory makes
the scorer of a kind and refuses a bad one before loading anything; the actor answers through
whichever scorer it holds; a scorer's requests become micro-batches that say where each row's
answer goes (``scoring/batch.py``'s `request_batches`)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from asyncrl.rl.scorer.actor import ScorerActor, ScorerError
from asyncrl.rl.scorer.base import Scored
from asyncrl.rl.scorer.factory import make_scorer
from asyncrl.rl.scorer.reward import RewardModelError
from asyncrl.rl.scorer.specs import JudgeSpec, RewardSpec, ScorerSpec, TeacherSpec, scorer_spec
from asyncrl.rl.scorer.teacher import TeacherScorer
from asyncrl.rl.scoring.batch import ScoreRequest, request_batches

pytest_plugins = ["sampler_support"]  # its fixtures: tiny_path

CPU = torch.device("cpu")


def test_request_batches_say_where_each_row_answer_goes():
    requests = [
        ScoreRequest([1, 2, 3], [[4, 5], [6], [7, 8, 9, 10]]),
        ScoreRequest([11], [[12, 13, 14], [15]]),
        ScoreRequest([16, 17, 18, 19, 20], [[21]]),
    ]
    batches = request_batches(requests, budget=10, device=CPU)
    assert len(batches) > 1  # the budget cuts them
    seen, lengths = [], []
    for batch, where in batches:
        assert len(where) == batch.row.shape[0]
        assert batch.input_ids.numel() <= 10 or batch.input_ids.shape[0] == 1  # within the budget, or alone
        for s, (r, j) in enumerate(where):
            prompt, completion = requests[r].prompt_ids, requests[r].completion_ids[j]
            n = len(prompt) + len(completion)
            assert batch.input_ids[s, :n].tolist() == prompt + completion
            # each completion token scored by the position before it
            assert batch.score_index[s, : len(completion)].tolist() == list(range(len(prompt) - 1, n - 1))
            assert batch.mask[s].sum() == len(completion)
            lengths.append(n)
        seen += where
    assert sorted(seen) == [(r, j) for r, q in enumerate(requests) for j in range(len(q.completion_ids))]
    assert lengths == sorted(lengths)  # similar lengths together


@pytest.mark.parametrize(
    "given, match",
    [
        ({"type": "critic"}, r"Invalid value 'critic' - at `\$.type`"),
        ({"type": "reward", "top_k": 4}, r"Object contains unknown field `top_k`"),  # a teacher's option
        ({"type": "teacher", "top_k": -1}, "top_k must be an integer >= 0"),
        ({"type": "teacher", "temperature": 0.0}, "temperature must be > 0"),
    ],
)
def test_a_bad_spec_is_refused_where_it_arrives_before_anything_is_loaded(given, match):
    # as the actor's process decodes its spawn arguments (`ScorerSpec`: a tagged union)
    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.convert(given, ScorerSpec)
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 0"):
        TeacherSpec(top_k=-1)


def test_each_spec_makes_its_scorer(tiny_path):
    teacher = make_scorer(TeacherSpec(temperature=0.7), tiny_path, CPU)
    assert isinstance(teacher, TeacherScorer)
    assert (teacher.kind, teacher.endpoint, teacher.top_k, teacher.temperature) == (
        "teacher",
        "teacher_logprobs",
        0,
        0.7,
    )
    top = make_scorer(TeacherSpec(top_k=10**9), tiny_path, CPU)
    assert top.endpoint == "teacher_topk" and top.top_k == top.vocab  # K past the vocabulary: all of it
    # a causal LM is not a reward model: the reward kind's own loader is the one that refuses it
    with pytest.raises(RewardModelError, match="one output"):
        make_scorer(RewardSpec(), tiny_path, CPU)


def test_the_config_s_section_picks_the_spec(tmp_path):
    from asyncrl.rl.config.teacher import RewardModelConfig, TeacherConfig

    assert scorer_spec(TeacherConfig(top_k=3), "/student", 0.5) == TeacherSpec(temperature=0.5, top_k=3)
    assert scorer_spec(RewardModelConfig(), "/student", 0.5) == RewardSpec()
    template = tmp_path / "t.txt"
    template.write_text("{prompt} {completion}")
    judge = scorer_spec(RewardModelConfig(kind="judge", template=str(template)), "/student", 0.5)
    assert isinstance(judge, JudgeSpec) and judge.template == "{prompt} {completion}" and judge.parses_verdicts


class _Lengths:
    """A scorer of its own kind: each completion's length, a None for an empty one (an unparsed
    verdict); ``fail`` makes the next pass raise."""

    kind, endpoint, vocab = "judge", "rewards", 10
    vocabulary = "the stub's vocabulary of {n}"

    def __init__(self):
        self.fail = False

    def score(self, requests: list[ScoreRequest], budget: int) -> Scored:
        if self.fail:
            self.fail = False
            raise RuntimeError("boom")
        answers = [[len(c) or None for c in r.completion_ids] for r in requests]
        return Scored(answers, forwards=2, unparsed=sum(a is None for row in answers for a in row))


async def test_the_actor_answers_through_whichever_scorer_it_holds(tiny_path):
    actor = ScorerActor(tiny_path)
    actor.scorer = stub = _Lengths()
    await actor.on_start()
    try:
        answer = await asyncio.wait_for(actor.rewards([1, 2], [[3, 4, 5], []]), timeout=60)
        assert answer == [3, None]
        stats = await actor.stats()
        assert (stats["requests"], stats["forwards"], stats["unparsed"], stats["tokens"]) == (1, 2, 1, 7)
        with pytest.raises(ScorerError, match="scorer serves a judge, not a teacher"):
            await actor.teacher_logprobs([1], [[2]])
        with pytest.raises(ScorerError, match="token id 10 is outside the stub's vocabulary of 10"):
            await actor.rewards([1], [[10]])
        stub.fail = True
        with pytest.raises(ScorerError, match=r"scoring 1 request\(s\) failed: RuntimeError: boom"):
            await asyncio.wait_for(actor.rewards([1], [[2]]), timeout=60)
        assert await asyncio.wait_for(actor.rewards([1], [[2, 3]]), timeout=60) == [2]  # serving on
        assert (await actor.stats())["failed_passes"] == 1
    finally:
        await actor.on_stop()
