"""A generative judge as the reward model (rl/scorer/judge.py): the template filled in one pass;
a verdict read as p(yes) / (p(yes) + p(no)) after the templated text, batched or not the same;
a generated verdict parsed, and one that does not parse counted (the scorer's stats, the
driver's metric and its failure budget), never raised."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from asyncrl.rl.config.teacher import RewardModelConfig
from asyncrl.rl.scorer.judge import Judge, parse_verdict, render
from asyncrl.rl.scorer.specs import JudgeSpec
from sampler_support import ONE_THREAD, write_tiny

pytestmark = pytest.mark.usefixtures("actor_zygote")  # tests/conftest.py: its supervisors fork actors from a zygote

# (prompt, completion, verdict word for "{prompt}={completion}?", generated verdict for "...!")
CASES = [
    ("2+3", "5", "y", "score:1"),
    ("2+3", "6", "n", "score:0"),
    ("4+1", "5", "y", "score:1"),
    ("4+1", "3", "n", "score:0"),
    ("1+1", "7", "n", "what?!!"),
]
ASK, GRADE = "{prompt}={completion}?", "{prompt}={completion}!"


def test_the_template_is_filled_in_one_pass_and_verdicts_parse_to_finite_numbers():
    filled = render("Q: {prompt}\nA: {completion}\n{x}", "1+{completion}", "{prompt}")
    assert filled == "Q: 1+{completion}\nA: {prompt}\n{x}"
    pattern = re.compile(r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)")
    assert [parse_verdict(pattern, t) for t in ("Score: 7", "score=-0.5 then score:3", "score: x", "7")] == [
        7.0,
        -0.5,
        None,
        None,
    ]
    assert parse_verdict(re.compile(r"\d+"), "grade 12/20") == 12.0  # no group: the whole match
    assert parse_verdict(re.compile(r"(\S+)"), "inf") is None  # a number, but not a finite one


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory) -> str:
    """A tiny judge trained to answer each case: its verdict word after ASK, its grade after GRADE."""
    from asyncrl.rl.model.policy import load_policy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = write_tiny(str(tmp_path_factory.mktemp("judge")))
    model, tok, _ = load_policy(path)
    model.train()
    # one token a character: the rows of each kind are as long
    ask = torch.tensor([tok.encode(render(ASK, p, c) + v) for p, c, v, _ in CASES])
    grade = torch.tensor([tok.encode(render(GRADE, p, c) + g) for p, c, _, g in CASES])
    n = len(tok.encode(render(ASK, "2+3", "5")))  # the text before the verdict, of both kinds
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):
        loss = torch.nn.functional.cross_entropy(
            model(ask).logits[:, n - 1], ask[:, n]
        ) + torch.nn.functional.cross_entropy(model(grade).logits[:, n - 1 : -1].flatten(0, 1), grade[:, n:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    yield path
    torch.set_num_threads(threads)


def requests(path: str) -> list[tuple[list[int], list[list[int]]]]:
    """The cases as the scorer gets them: the student's token ids, a request per prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    by_prompt: dict[str, list[str]] = {}
    for p, c, _, _ in CASES:
        by_prompt.setdefault(p, []).append(c)
    return [(tok.encode(p), [tok.encode(c) for c in cs]) for p, cs in by_prompt.items()]


def test_a_logprob_verdict_is_one_forward_s_yes_against_no_batched_or_not(judge_path):
    judge = Judge(judge_path, judge_path, ASK, verdict_tokens=("y", "n"))
    reqs = requests(judge_path)
    scores, forwards = judge.score(reqs, budget=10_000)
    assert forwards == 1
    flat = [s for row in scores for s in row]
    assert [s > 0.5 for s in flat] == [v == "y" for _, _, v, _ in CASES], flat  # the judge knows the answers
    # each equals sigmoid(logit yes - logit no) of one unpadded forward; one row a forward: the same
    yes, no = judge.tokenizer.convert_tokens_to_ids(["y", "n"])
    with torch.no_grad():
        for (p, c, _, _), s in zip(CASES, flat):
            last = judge.model(torch.tensor([judge.tokenizer.encode(render(ASK, p, c))])).logits[0, -1]
            assert s == pytest.approx(float(torch.sigmoid(last[yes] - last[no])), abs=1e-5)
    again, forwards = judge.score(reqs, budget=1)
    assert forwards == 5
    for row, other in zip(scores, again):
        assert row == pytest.approx(other, abs=1e-5)


def test_verdict_words_must_each_be_one_token_of_the_judge(judge_path):
    from asyncrl.rl.scorer.actor import ScorerActor, ScorerError

    with pytest.raises(ScorerError, match=r"--reward_model\.verdict_tokens yes,no: two words, each one token"):
        ScorerActor(judge_path, JudgeSpec(student_path=judge_path, template=ASK))


async def test_a_token_id_outside_the_students_tokenizer_is_refused_naming_what_the_judge_reads_it_with(judge_path):
    """A judge reads the student's ids with the student's tokenizer: an id outside it names that
    tokenizer, not a teacher's vocabulary (which there is none of)."""
    from transformers import AutoTokenizer

    from asyncrl.rl.scorer.actor import ScorerActor, ScorerError

    vocab = len(AutoTokenizer.from_pretrained(judge_path))
    scorer = ScorerActor(judge_path, JudgeSpec(student_path=judge_path, template=ASK, verdict_tokens=("y", "n")))
    with pytest.raises(ScorerError) as err:
        await scorer.rewards([1, 2], [[vocab]])
    assert str(err.value) == (
        f"scorer: token id {vocab} is outside the vocabulary of {vocab} of the student's tokenizer, "
        "which the judge decodes completions with"
    )


async def test_generated_verdicts_are_parsed_and_an_unparsed_one_is_counted_not_raised(judge_path):
    from asyncrl.rl.scorer.actor import ScorerActor

    scorer = ScorerActor(
        judge_path,
        JudgeSpec(student_path=judge_path, template=GRADE, read="generate", max_new_tokens=7),
        batch_tokens=10_000,
    )
    await scorer.on_start()
    try:
        results = [await asyncio.wait_for(scorer.rewards(p, cs), timeout=60) for p, cs in requests(judge_path)]
        assert [s for row in results for s in row] == [1.0, 0.0, 1.0, 0.0, None]
        stats = await scorer.stats()
        assert (stats["unparsed"], stats["requests"]) == (1, 3)
    finally:
        await scorer.on_stop()


async def test_the_driver_sums_a_judge_s_verdicts_counts_the_unparsed_and_stops_past_its_budget(judge_path):
    from asyncrl.rl.driver.teacher import RewardModel, UnparsedVerdictsError
    from asyncrl.rl.rollout import RolloutGroup
    from asyncrl.rl.scorer.actor import ScorerActor
    from asyncrl.runtime import Supervisor

    ((prompt, completions),) = [r for r in requests(judge_path) if len(r[1]) == 1]  # "1+1": unparsed
    right = requests(judge_path)[0]  # "2+3": 5 (right) and 6
    lines = []
    async with Supervisor(call_timeout_s=60) as sup:
        spec = JudgeSpec(student_path=judge_path, template=GRADE, read="generate", max_new_tokens=7)
        handle = await sup.spawn(ScorerActor, judge_path, spec, name="reward_model", env=ONE_THREAD)
        config = RewardModelConfig(timeout_s=60, weight=2.0, rule_weight=0.5, max_unparsed_rate=0.4)
        rm = RewardModel(
            handle, config, judge=spec.parses_verdicts, min_verdicts=3, restart_timeout_s=60, log=lines.append
        )
        group = RolloutGroup(1, right[0], right[1], [[0.0] * len(c) for c in right[1]], [1.0, 0.0], version=0)
        assert (await rm.annotate(group)).rewards == [0.5 * 1.0 + 2.0 * 1.0, 0.0]
        one = RolloutGroup(2, prompt, completions, [[0.0]], [1.0], version=0)
        assert (await rm.annotate(one)).rewards == [0.5]  # unparsed: the rule reward alone
        assert "1 of the judge's verdicts on prompt 2 did not parse" in lines[0]
        assert rm.take_counts() == {"judged": 3, "judge_unparsed": 1} and rm.take_counts()["judged"] == 0
        with pytest.raises(
            UnparsedVerdictsError,
            match=r"2 of the judge's 4 verdicts did not parse \(50%, more than "
            r"--reward_model\.max_unparsed_rate 0\.4\)",
        ):
            await rm.annotate(one)


def test_a_judge_s_flags_and_template_are_checked_before_anything_is_spawned(judge_path, tmp_path, monkeypatch):
    from asyncrl.rl.config.grpo import GRPOConfig
    from asyncrl.rl.config.parse import ConfigError, parse_overrides
    from asyncrl.rl.driver.preflight import check_run
    from asyncrl.rl.scorer.specs import scorer_spec

    monkeypatch.chdir(tmp_path)
    judge = ["--reward_model.model_path", judge_path, "--reward_model.kind", "judge"]
    with pytest.raises(ConfigError, match=r"kind judge needs a template: set --reward_model\.template FILE"):
        parse_overrides(GRPOConfig(), judge)
    with pytest.raises(ConfigError, match=r"template t\.txt is read by a judge only: add --reward_model\.kind judge"):
        parse_overrides(GRPOConfig(), ["--reward_model.template", "t.txt"])
    with pytest.raises(ConfigError, match=r"verdict '\(a\)\(b\)' has 2 groups"):
        parse_overrides(GRPOConfig(), [*judge, "--reward_model.template", "t.txt", "--reward_model.verdict", "(a)(b)"])
    config = parse_overrides(GRPOConfig(), [*judge, "--reward_model.template", "t.txt", "--run.run_dir", "run"])
    with pytest.raises(ConfigError, match=r"^--reward_model\.template t\.txt: cannot be read \(FileNotFoundError"):
        check_run(config)
    (tmp_path / "t.txt").write_text("Is {prompt} right?")
    with pytest.raises(ConfigError, match=r"^--reward_model\.template t\.txt has no \{completion\}"):
        check_run(config)
    (tmp_path / "t.txt").write_text("{prompt}={completion}?")
    section = check_run(config).reward_model
    # every scorer's checkpoint is checked by the same code, named by its own flag
    for flags in (
        ["--teacher.model_path", "nowhere", "--trainer.loss.distill_coef", "1"],
        ["--reward_model.model_path", "nowhere"],
    ):
        with pytest.raises(ConfigError, match=rf"^{flags[0]} nowhere"):
            check_run(parse_overrides(GRPOConfig(), [*flags, "--run.run_dir", "run"]))
    assert section.template == str(tmp_path / "t.txt") and not section.shares_tokenizer
    assert scorer_spec(section, "/student", temperature=1.0) == JudgeSpec(
        student_path="/student",
        template="{prompt}={completion}?",
        read="logprob",
        verdict_tokens=("yes", "no"),
        verdict=section.verdict,
        max_new_tokens=16,
    )
