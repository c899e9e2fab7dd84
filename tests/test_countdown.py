"""The Countdown task: the solver (against a brute force), the generator's solvability and
determinism, disjoint splits, prompts, a reward that never raises and never dawdles on
adversarial or random text, and Countdown as a `Task` of the public API."""

from __future__ import annotations

import random
import time
from fractions import Fraction

import msgspec
import pytest

from asyncrl.rl.config.task import CountdownConfig
from asyncrl.rl.tasks.arith import evaluate, numbers_used, parse
from asyncrl.rl.tasks.base import Message, Prompt, Score, Splits, Task, TaskInputError, as_prompt
from asyncrl.rl.tasks.countdown import (
    CORRECT_REWARD,
    FORMAT_REWARD,
    Countdown,
    CountdownProblem,
    extract_answer,
    format_prompt,
    format_prompt_compact,
    format_reference,
    generate,
    problem_key,
    reward,
    score,
    solve,
    train_and_heldout,
)

P = CountdownProblem(numbers=[3, 7, 25], target=46, solution="25 + 7 * 3")


def makes(text: str, numbers: list[int], target: int) -> bool:
    """``text`` uses each of ``numbers`` exactly once and equals ``target``."""
    expr = parse(text)
    return evaluate(expr) == target and sorted(numbers_used(expr)) == sorted(numbers)


# --- solver -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "numbers, target",
    [
        ([3, 7, 25], 46),
        ([3, 3, 8, 8], 24),
        ([1, 5, 5, 5], 24),
        ([2, 3], 6),
        ([5], 5),
        ([0, 0], 0),
        ([4, 4, 4, 4], 17),
        ([99, 98, 97, 96], 1),
    ],
)
def test_solver_finds_known_solutions(numbers, target):
    found = solve(numbers, target)
    assert found is not None and makes(found, numbers, target)


@pytest.mark.parametrize("numbers, target", [([1, 1, 1], 100), ([5], 6), ([2, 2], 5), ([1, 1, 1, 1], 50)])
def test_solver_returns_none_when_unsolvable(numbers, target):
    assert solve(numbers, target) is None


def _reachable(values: list[Fraction]) -> set[Fraction]:
    """Every value of every expression over ``values``, signed intermediates included."""
    if len(values) == 1:
        return {values[0]}
    out: set[Fraction] = set()
    for i, a in enumerate(values):
        for j, b in enumerate(values):
            if i != j:
                rest = [v for k, v in enumerate(values) if k not in (i, j)]
                for made in {a + b, a - b, a * b} | ({a / b} if b else set()):
                    out |= _reachable(rest + [made])
    return out


def test_solver_is_exhaustive_against_brute_force():
    # The solver only subtracts smaller from larger; this checks that loses no target.
    rng = random.Random(3)
    for _ in range(12):
        numbers = [rng.randint(0, 9) for _ in range(rng.randint(1, 4))]
        reachable = _reachable([Fraction(x) for x in numbers])
        for target in range(40):
            found = solve(numbers, target)
            assert (found is not None) == (target in reachable), (numbers, target, found)
            assert found is None or makes(found, numbers, target)


def test_solver_is_fast_and_deterministic():
    rng = random.Random(11)
    cases = [([rng.randint(1, 99) for _ in range(4)], rng.randint(1, 1000)) for _ in range(100)]
    start = time.process_time()  # this process's CPU seconds: what the work costs, whatever else runs
    results = [solve(numbers, target) for numbers, target in cases]
    assert time.process_time() - start < 0.5  # mostly unsolvable, i.e. full searches: ~1 ms each
    assert results == [solve(numbers, target) for numbers, target in cases]


@pytest.mark.parametrize("numbers, target", [([], 1), ([1] * 7, 1), ([1, -2], 1), ([1, 2], -1), ([1.0, 2], 3)])
def test_solver_refuses_bad_input(numbers, target):
    with pytest.raises(ValueError):
        solve(numbers, target)


# --- generator and splits -----------------------------------------------------------------------


def test_generator_emits_only_solvable_problems_in_range():
    problems = generate(0, 300)
    assert len({problem_key(p) for p in problems}) == 300
    for p in problems:
        assert 3 <= len(p.numbers) <= 4 and all(1 <= x <= 99 for x in p.numbers) and 1 <= p.target <= 100
        assert makes(p.solution, p.numbers, p.target)
        found = solve(p.numbers, p.target)
        assert found is not None and makes(found, p.numbers, p.target)


def test_problems_cross_the_wire():
    problems = generate(4, 20)
    data = msgspec.msgpack.encode(problems)
    assert msgspec.msgpack.decode(data, type=list[CountdownProblem]) == problems
    breakdown = score(P, "<answer>25 + 21</answer>")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(breakdown), type=type(breakdown)) == breakdown


def test_generator_is_deterministic_and_a_stream():
    assert generate(7, 50) == generate(7, 50)
    assert generate(7, 20) == generate(7, 50)[:20]
    assert generate(7, 50) != generate(8, 50)
    assert generate(7, 0) == []


def test_generator_respects_config_and_exclude():
    config = CountdownConfig(min_count=4, max_count=4, max_number=10, min_target=10, max_target=20)
    problems = generate(1, 100, config)
    for p in problems:
        assert len(p.numbers) == 4 and max(p.numbers) <= 10 and 10 <= p.target <= 20
        assert makes(p.solution, p.numbers, p.target)
    excluded = {problem_key(p) for p in problems[:50]}
    assert not excluded & {problem_key(p) for p in generate(1, 100, config, exclude=excluded)}


def test_generator_refuses_what_it_cannot_make():
    tiny = CountdownConfig(min_count=2, max_count=2, max_number=1)  # only [1, 1] -> 1 or 2
    assert len(generate(0, 2, tiny)) == 2
    with pytest.raises(ValueError, match="only 2 of 3"):
        generate(0, 3, tiny)
    with pytest.raises(ValueError):
        generate(0, -1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_count=1),
        dict(min_count=4, max_count=3),
        dict(max_count=7),
        dict(max_number=0),
        dict(min_target=0),
        dict(min_target=5, max_target=4),
    ],
)
def test_config_refuses_bad_values(kwargs):
    with pytest.raises(ValueError):
        CountdownConfig(**kwargs)


def test_splits_are_disjoint_deterministic_and_stable():
    train, heldout = train_and_heldout(0, 500, 100)
    assert len(train) == 500 and len(heldout) == 100
    train_keys, heldout_keys = {problem_key(p) for p in train}, {problem_key(p) for p in heldout}
    assert len(train_keys) == 500 and len(heldout_keys) == 100 and not train_keys & heldout_keys
    assert train_and_heldout(0, 500, 100) == (train, heldout)
    assert train_and_heldout(0, 50, 100)[1] == heldout  # held-out set does not depend on n_train
    assert train_and_heldout(1, 500, 100) != (train, heldout)
    for seed in range(5):  # small spaces make collisions likely: still never shared
        config = CountdownConfig(max_count=3, max_number=6, max_target=20)
        tr, ho = train_and_heldout(seed, 100, 40, config)
        assert not {problem_key(p) for p in tr} & {problem_key(p) for p in ho}


# --- prompt and reward --------------------------------------------------------------------------


def test_prompt_and_reference():
    prompt = format_prompt(P)
    assert "[3, 7, 25]" in prompt and "46" in prompt and "<answer>" in prompt and "exactly once" in prompt
    assert format_reference(P) == "<answer>25 + 7 * 3</answer>"
    for p in generate(2, 200):
        assert reward(p, format_reference(p)) == CORRECT_REWARD


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>25 + 7 * 3</answer>", CORRECT_REWARD),
        ("Let me think. 7*3 = 21, 21+25 = 46.\n<answer> (3 * 7) + 25 </answer>", CORRECT_REWARD),
        ("<answer>3*7+25 = 46</answer>", CORRECT_REWARD),  # a stated result is allowed if right
        ("<answer>3*7+25 = 45</answer>", FORMAT_REWARD),  # ... and wrong if wrong
        ("<answer>25 + 7 + 3</answer>", FORMAT_REWARD),  # wrong value
        ("<answer>25 + 21</answer>", FORMAT_REWARD),  # right value, numbers missing
        ("<answer>25 + 7 * 3 + 7 - 7</answer>", FORMAT_REWARD),  # a number reused
        ("<answer>25 + 7 * 3 * 1</answer>", FORMAT_REWARD),  # an extra number
        ("<answer>1 + 1</answer> then <answer>25 + 7 * 3</answer>", CORRECT_REWARD),  # last wins
        ("<answer>25 + 7 * 3</answer> then <answer>1 + 1</answer>", FORMAT_REWARD),
        ("<answer>25 + 7 * 3</answer> then <answer>oops</answer>", 0.0),  # even when it is worse
        ("<answer>25 + 7 * 3</answer><answer>", CORRECT_REWARD),  # an unclosed tag is no answer
        ("<answer><answer>25 + 7 * 3</answer></answer>", CORRECT_REWARD),
        ("25 + 7 * 3", 0.0),
        ("<answer>25 + 7 * 3", 0.0),
        ("<answer></answer>", 0.0),
        ("</answer>25 + 7 * 3<answer>", 0.0),
        ("<ANSWER>25 + 7 * 3</ANSWER>", 0.0),
        ("<answer>25 + 7 * 3 = 40 + 6</answer>", 0.0),
        ("<answer>25 + 7 * 3 = 46 = 46</answer>", 0.0),
        ("<answer>1 / 0</answer>", 0.0),
        ("<answer>\u0662\u0665 + 7 * 3</answer>", 0.0),  # Arabic-Indic 25
        ("<answer>25 + 7 * -3</answer>", 0.0),
    ],
)
def test_reward_cases(completion, expected):
    assert reward(P, completion) == expected


def test_reward_with_repeated_numbers_needs_each_copy():
    p = CountdownProblem(numbers=[5, 5, 12], target=13, solution="5 * 5 - 12")
    assert reward(p, "<answer>5*5-12</answer>") == CORRECT_REWARD
    assert reward(p, "<answer>(12 + 5*5 + 1) / 2</answer>") == FORMAT_REWARD


def test_score_breakdown():
    right = score(P, "<answer>25 + 3 * 7</answer>")
    assert (
        right.reward,
        right.has_answer,
        right.well_formed,
        right.uses_numbers,
        right.hits_target,
        right.correct,
        right.error,
    ) == (1.0, True, True, True, True, True, "")
    short = score(P, "<answer>25 + 21</answer>")
    assert (short.well_formed, short.uses_numbers, short.hits_target, short.correct) == (True, False, True, False)
    bad = score(P, "<answer>2 ** 3</answer>")
    assert (bad.reward, bad.has_answer, bad.well_formed) == (0.0, True, False) and "power" in bad.error
    missing = score(P, "no tags")
    assert (missing.reward, missing.has_answer) == (0.0, False) and missing.error
    assert extract_answer("x<answer> a </answer>y<answer>b</answer>z") == "b"
    assert extract_answer("<answer>") is None and extract_answer("</answer><answer>") is None


def _adversarial() -> list[str]:
    tag = "<answer>{}</answer>".format
    return [
        "",
        "<answer>",
        "</answer>",
        "<answer></answer>" * 5000,
        tag("9**9**9"),
        tag("1/0"),
        tag("0/0"),
        tag("(" * 100_000),
        "(" * 100_000,
        tag("(" * 50_000 + "1" + ")" * 50_000),
        tag("9" * 1_000_000),
        "9" * 1_000_000,
        tag("1+" * 500_000 + "1"),
        "<answer>" * 20_000 + "1" + "</answer>" * 20_000,
        "<answer" * 20_000,
        "</answer" * 20_000,
        tag("\u0663\u0663"),
        tag("\uff13 + 1"),
        tag("\x00"),
        tag("\ud800"),
        tag("\n" * 300 + "46"),
        "x" * 100_000 + tag("25 + 7 * 3"),
        tag("25 + 7 * 3") + "y" * 100_000,
        tag("1" * 10),
        tag("99999999 * 99999999 / 99999999"),
        tag("=" * 1000),
        tag("1 = "),
        tag("= 46"),
        tag("1 " * 128),
        tag("((((((((((((((((((((((((((((((((((1))))))))))))))))))))))))))))))))))"),
        "\U0001f600" * 100_000 + tag("46"),
    ]


def test_reward_survives_adversarial_text_quickly():
    start = time.process_time()  # this process's CPU seconds: what the work costs, whatever else runs
    rewards = [reward(P, text) for text in _adversarial()]
    assert time.process_time() - start < 1.0
    assert all(type(r) is float and 0.0 <= r <= 1.0 for r in rewards)
    padded = "<answer>25 + 7 * 3</answer>"
    assert reward(P, "x" * 100_000 + padded) == reward(P, padded + "y" * 100_000) == CORRECT_REWARD
    assert reward(P, "\U0001f600" * 100_000 + "<answer>46</answer>") == FORMAT_REWARD  # numbers missing


def test_reward_fuzz_never_raises():
    rng = random.Random(2024)
    pieces = [
        "0",
        "1",
        "3",
        "7",
        "25",
        "46",
        "99",
        "+",
        "-",
        "*",
        "/",
        "**",
        "(",
        ")",
        " ",
        "\n",
        "=",
        ".",
        "<answer>",
        "</answer>",
        "<answer",
        "answer>",
        "\u0663",
        "\uff13",
        "\u00e9",
        "\ud800",
        "x",
        "%",
    ]
    start = time.process_time()  # this process's CPU seconds: what the work costs, whatever else runs
    seen = set()
    for _ in range(4000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        for completion in (text, f"<answer>{text}</answer>"):
            got = reward(P, completion)
            assert got in (0.0, FORMAT_REWARD, CORRECT_REWARD)
            seen.add(got)
    assert time.process_time() - start < 2.0
    assert seen == {0.0, FORMAT_REWARD}  # the fuzz does reach the parser's success path


# --- the task on the public API -------------------------------------------------------------------


def test_countdown_is_a_task_whose_splits_are_train_and_heldout():
    task = Countdown(CountdownConfig(max_count=3))
    assert isinstance(task, Task)
    assert (task.task_name(), task.correct_reward, task.Config) == ("countdown", CORRECT_REWARD, CountdownConfig)
    assert Countdown().config == CountdownConfig()
    splits = task.splits(5, 300, 40)
    assert isinstance(splits, Splits) and tuple(splits) == train_and_heldout(5, 300, 40, task.config)
    train, heldout = splits
    assert (len(train), len(heldout)) == (300, 40)
    assert not {problem_key(p) for p in train} & {problem_key(p) for p in heldout}
    assert task.splits(5, 20, 40).heldout == heldout  # the held-out split does not depend on n_train
    assert all(len(p.numbers) == 3 for p in train)  # the config is the task's


def test_the_prompt_is_one_user_turn_with_a_compact_form():
    prompt = Countdown().prompt(P)
    assert prompt == Prompt([Message("user", format_prompt(P))], compact=format_prompt_compact(P))
    assert as_prompt(prompt) is prompt
    assert prompt.text == format_prompt(P) and prompt.compact == "3 7 25 -> 46:"
    two_turns = Prompt([Message("system", "Be brief."), Message("user", "3 7 25 -> 46")])
    assert two_turns.text == "Be brief.\n3 7 25 -> 46" and two_turns.compact == ""


def test_the_tasks_score_is_the_reward_with_its_parts_as_metrics():
    task = Countdown()
    for completion in (
        "<answer>25 + 7 * 3</answer>",
        "<answer>25 + 7 + 3</answer>",
        "<answer>3 +</answer>",
        "no answer",
        "",
    ):
        got, parts = task.score(P, completion), score(P, completion)
        assert isinstance(got, Score) and (got.reward, got.correct) == (parts.reward, parts.correct)
        assert got.metrics == {
            "has_answer": float(parts.has_answer),
            "well_formed": float(parts.well_formed),
            "uses_numbers": float(parts.uses_numbers),
            "hits_target": float(parts.hits_target),
        }
        assert got.correct == (got.reward >= task.correct_reward)
    assert task.score(P, format_reference(P)).correct


def test_the_demonstration_is_the_reference_and_scores_correct():
    task = Countdown()
    for problem in task.splits(0, 20, 5).train:
        assert task.demonstration(problem) == format_reference(problem)
        assert task.score(problem, task.demonstration(problem)).correct


def test_the_fingerprint_keeps_the_warm_start_cache_key_of_before():
    """The cache key of the embedded model's warm start is made of the task's fingerprint: for
    Countdown it must stay the key computed before tasks were public (pinned here, from the old
    ``cache_key(ModelConfig(), WarmStartConfig(), CountdownConfig())``), so the cached default
    model is reused."""
    from asyncrl.rl.config import ModelConfig, WarmStartConfig
    from asyncrl.rl.model.warm_start import cache_key

    assert Countdown().fingerprint() == {
        "countdown": {"min_count": 3, "max_count": 4, "max_number": 99, "min_target": 1, "max_target": 100},
        "probe": ["3 7 25 -> 46:", "<answer>25 + 7 * 3</answer>"],
    }
    assert cache_key(ModelConfig(), WarmStartConfig(), Countdown()) == "1cfa1c5b452e000bbf3c"
    assert (
        cache_key(ModelConfig(), WarmStartConfig(), Countdown(CountdownConfig(max_count=5))) == "ce90a6495700317cea5e"
    )


@pytest.mark.parametrize("completion", [b"<answer>25 + 7 * 3</answer>", None, 46, ["<answer>46</answer>"]])
def test_a_completion_that_is_not_text_is_a_typed_error(completion):
    with pytest.raises(TaskInputError, match="countdown: a completion must be a str, not "):
        Countdown().score(P, completion)
    with pytest.raises(TypeError):  # TaskInputError is a TypeError too
        reward(P, completion)


@pytest.mark.parametrize("problem", [None, {"numbers": [3, 7, 25], "target": 46, "solution": ""}, (3, 7, 25)])
def test_a_problem_of_another_kind_is_a_typed_error(problem):
    with pytest.raises(TaskInputError, match="countdown: a problem must be a CountdownProblem"):
        Countdown().score(problem, "<answer>25 + 7 * 3</answer>")
    with pytest.raises(TaskInputError, match="countdown: a problem must be a CountdownProblem"):
        Countdown().prompt(problem)


def test_a_huge_completion_scores_zero_quickly():
    huge = [
        "x" * 50_000_000,
        "<answer>" + "1 + " * 5_000_000 + "1</answer>",
        "<answer>" + "9" * 20_000_000 + "</answer>",
        "<answer>" * 2_000_000 + "</answer>" * 2_000_000,
        "\U0001f600" * 5_000_000 + "<answer>" + "(" * 5_000_000,
    ]
    start = time.process_time()  # this process's CPU seconds: what the work costs, whatever else runs
    scores = [score(P, text) for text in huge]
    assert time.process_time() - start < 2.0
    assert [s.reward for s in scores] == [0.0] * len(huge) and all(s.error for s in scores)
    assert "characters long" in scores[1].error


def test_every_drawn_solution_makes_its_target_and_the_draw_does_not_parse_it_back(monkeypatch):
    """A solution is written from the tree its target was computed on, with whole intermediates;
    here every one of 3000 problems of two streams parses back to its target from its numbers.
    Drawing does not check it again: the check per problem (parse, exact evaluation) was 70% of
    drawing the default 50,000 (14 s of 19 s on the loaded 2-core VM), paid by every process that
    builds the split, each sampler's start included."""
    import asyncrl.rl.tasks.countdown as countdown

    for seed in (0, "countdown/0/train"):
        assert all(makes(p.solution, p.numbers, p.target) for p in generate(seed, 3000))
    parsed: list[str] = []
    monkeypatch.setattr(countdown, "parse", lambda text: parsed.append(text))
    assert len(generate(1, 200)) == 200 and parsed == []
