"""The examples: the README's first command must keep working (run through `asyncrl launch`); the
task examples' data, rewards and environment score what they should (word problems: a data file and
a reward function; the calculator: a multi-turn tool-use environment, driven by a scripted policy).
The GRPO runs of the task examples are benchmarks (benchmarks/README.md), not tests."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys

import pytest

from asyncrl.rl.generation import Completion, SamplingParams
from asyncrl.rl.model.policy import PromptFormat
from asyncrl.rl.model.tokenizer import build_tokenizer
from asyncrl.rl.tasks.base import Episode, Score, as_prompt
from asyncrl.rl.tasks.dataset import load_rows
from asyncrl.rl.tasks.episodes import EpisodeRunner
from asyncrl.rl.tasks.scoring import UserCalls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hello_actors_example_runs_under_launch():
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", os.path.join(ROOT, "examples", "hello_actors.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "square: [0.0, 0.5, 2.0, 4.5]" in out.stdout
    assert "countdown: [5, 4, 3, 2, 1]" in out.stdout
    assert "as expected: actor 'squarer-1': died (killed by SIGKILL)" in out.stdout
    assert "after restart: [0.5, 0.5] 1 restart(s)" in out.stdout


# --- the task examples: word problems (a data file and a reward) and the calculator environment ----

EXAMPLES = os.path.join(ROOT, "examples")
WORD_PROBLEMS = os.path.join(EXAMPLES, "data", "word_problems.jsonl")


def example(path: str):
    """The module of an example file, imported as a user's file is (by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_word_problem_generator_is_deterministic_and_its_rows_load():
    make = example(os.path.join(EXAMPLES, "data", "make_word_problems.py"))
    assert make.render(0, 300) == make.render(0, 300) != make.render(1, 300)
    with open(WORD_PROBLEMS) as f:
        assert f.read() == make.render(0, 6000)  # the shipped file is the generator's output
    rows = load_rows(WORD_PROBLEMS)
    assert len(rows) == 6000 and len({r["prompt"] for r in rows}) == 6000
    reward = example(os.path.join(EXAMPLES, "word_problems.py")).reward
    for row in rows[:500]:
        assert set(row) == {"prompt", "answer", "demonstration"} and isinstance(row["answer"], int)
        assert len(row["prompt"]) + len(row["demonstration"]) < 120  # fits the embedded model's 128 positions
        assert reward(row, row["demonstration"]) == Score(1.0, True, {"answered": 1.0})


def test_the_word_problem_reward_wants_the_exact_answer():
    reward = example(os.path.join(EXAMPLES, "word_problems.py")).reward
    row = {"prompt": "Ann has 3 pens and gets 4 more. How many pens now?", "answer": 7}
    assert reward(row, " 3+4=<answer>7</answer>").reward == 1.0
    assert reward(row, "<answer>6</answer> <answer> 7 </answer>").reward == 1.0  # the last answer counts
    for wrong in (" 3+4=<answer>8</answer>", "7", "<answer>3+4</answer>", "<answer>7.0</answer>", "<answer>7"):
        assert reward(row, wrong).reward == 0.0, wrong
    assert reward(row, "7").metrics == {"answered": 0.0}
    assert reward({"answer": "7"}, "<answer>7</answer>").correct  # an answer given as a string


def calculator_module():
    return example(os.path.join(EXAMPLES, "calculator.py"))


def test_the_calculator_scores_a_scripted_episode():
    calc = calculator_module()
    env, problem = calc.Calculator(), calc.Arithmetic(47, "*", 38)
    assert problem.answer == 1786 and env.prompt(problem) == "47 * 38 = ?"

    def episode(*turns: str) -> list:
        e, replies = Episode(problem, as_prompt(env.prompt(problem))), []
        for turn in turns:
            replies.append(env.step(e, turn))
        return replies

    call, answer = episode("<calc>47 * 38</calc>", "<answer>1786</answer>")  # uses the tool
    assert call.text == "<result>1786</result>" and not call.done
    assert call.metrics == {"tool_used": 1.0, "tool_used_correctly": 1.0}
    assert answer.done and answer.reward == 1.0 and answer.correct
    assert answer.metrics == {"tool_used": 0.0, "tool_used_correctly": 0.0}  # counted once per episode

    bad, again, answer = episode("<calc>47 ** 38</calc>", "<calc>47 * 39</calc>", "<answer>1833</answer>")
    assert bad.text.startswith("<result>error: ") and bad.metrics == {"tool_used": 1.0, "tool_used_correctly": 0.0}
    assert again.text == "<result>1833</result>" and again.metrics["tool_used"] == 0.0
    assert answer.done and answer.reward == 0.0 and answer.correct is False

    (direct,) = episode("<answer>1786</answer>")  # right without the tool
    assert direct.done and direct.reward == 1.0 and direct.metrics == {"tool_used": 0.0, "tool_used_correctly": 0.0}
    for text in ("I think 1786", "<answer>about 1786</answer>", "<calc>47 * 38", ""):  # no answer: the end, 0
        (reply,) = episode(text)
        assert reply.done and reply.reward == 0.0, text


def test_the_calculator_demonstrations_and_problems():
    calc = calculator_module()
    problems = calc.make_problems(0, 300)
    assert problems == calc.make_problems(0, 300) and len(set(problems)) == 300
    assert {p.op for p in problems} == {"+", "-", "*"}
    env, tool = calc.Calculator(), 0
    for p in problems:
        trace = env.demonstration(p)
        assert trace[-1] == f"<answer>{p.answer}</answer>"
        if len(trace) == 3:  # a solver's trace: the call, the environment's result, the answer
            tool += 1
            assert trace[:2] == [f"<calc>{p.expression}</calc>", f"<result>{p.answer}</result>"]
        e = Episode(p, as_prompt(env.prompt(p)))
        replies = [env.step(e, turn) for turn in trace[::2]]  # the environment answers a trace as demonstrated
        assert [r.text for r in replies[:-1]] == trace[1::2] and replies[-1].reward == 1.0
    assert 0.3 < tool / len(problems) < 0.6


class Scripted:
    """A fake ``generate``: each context gets the next of ``turns`` (by the results in it), cut
    where a backend cuts it: after eos, or at a stop string (the text before it)."""

    def __init__(self, turns: list[str]):
        self.tok, self.turns = build_tokenizer(), turns

    async def __call__(self, prompts, n, params: SamplingParams):
        out = []
        for prompt in prompts:
            text = self.turns[self.tok.decode(prompt).count("<result>")]
            out.append([self.complete(text, params) for _ in range(n)])
        return out

    def complete(self, text: str, params: SamplingParams) -> Completion:
        stops = [text.find(s) + len(s) for s in params.stop if s in text]
        if stops:
            cut = self.tok(text[: min(stops)], add_special_tokens=False)["input_ids"]
            return Completion(cut, [-1.0] * len(cut), text[: min(stops) - len("</calc>")], "stop")
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return Completion(ids, [-1.0] * len(ids), text, "stop")


@pytest.mark.parametrize(
    "turns, reward, metrics",
    [
        (
            ["<calc>47 * 38</calc>", "<answer>1786</answer>"],
            1.0,
            {"tool_used": 1.0, "tool_used_correctly": 1.0, "turns": 2.0, "episodes_truncated": 0.0},
        ),
        (
            ["<calc>47*38</calc>", "<calc>47*38</calc>", "<calc>47*38</calc>"],
            0.0,  # truncated after max_turns
            {"tool_used": 1.0, "tool_used_correctly": 1.0, "turns": 3.0, "episodes_truncated": 1.0},
        ),
        (
            ["<answer>1700</answer>"],
            0.0,
            {"tool_used": 0.0, "tool_used_correctly": 0.0, "turns": 1.0, "episodes_truncated": 0.0},
        ),
    ],
)
def test_the_calculator_runs_through_the_episode_runner(turns, reward, metrics):
    calc = calculator_module()
    env, tok = calc.Calculator(), build_tokenizer()
    fmt = PromptFormat("compact", tok, [tok.eos_token_id], 32)
    calls = UserCalls(env.task_name(), 5.0, 1.0)
    try:
        params = SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=[tok.eos_token_id])
        ((sample,),) = asyncio.run(
            EpisodeRunner(env, fmt, calls).run([calc.Arithmetic(47, "*", 38)], 1, params, Scripted(turns))
        )
    finally:
        calls.close()
    assert sample.reward == reward and sample.metrics == metrics and not sample.error
    result = tok("<result>1786</result>", add_special_tokens=False)["input_ids"]
    if len(turns) > 1:  # the environment's result is context: mask 0
        call = tok(turns[0], add_special_tokens=False)["input_ids"]
        assert sample.action_mask[: len(call) + len(result)] == [1] * len(call) + [0] * len(result)


# --- docs/tasks.md: its code runs ------------------------------------------------------------------


def doc_files(tmp_path) -> dict[str, str]:
    """The code blocks of docs/tasks.md that are whole files (their first line names one:
    ``# guess.py``), written into ``tmp_path``; and the JSONL rows, as rows.jsonl."""
    import re

    with open(os.path.join(ROOT, "docs", "tasks.md")) as f:
        text = f.read()
    files = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S):
        first = body.splitlines()[0]
        name = (
            first[2:]
            if lang == "python" and first.startswith("# ") and first.endswith(".py")
            else ("rows.jsonl" if lang == "json" else None)
        )
        if name:
            (tmp_path / name).write_text(body)
            files[name] = str(tmp_path / name)
    assert set(files) == {"rows.jsonl", "my_reward.py", "digit_sum.py", "guess.py"}
    return files


def test_the_docs_tasks_load_score_their_demonstrations_and_fit_the_embedded_model(tmp_path):
    from asyncrl.rl.model.demonstrations import demonstration_rows
    from asyncrl.rl.tasks import TaskSpec, load_task

    files = doc_files(tmp_path)
    tok = build_tokenizer()
    rows = load_task(TaskSpec(name="", data=files["rows.jsonl"], reward=f"{files['my_reward.py']}:reward"))
    digit_sum = load_task(TaskSpec(name=f"{files['digit_sum.py']}:DigitSum", options={"digits": 5}))
    guess = load_task(TaskSpec(name=f"{files['guess.py']}:Guess"))
    assert digit_sum.config.digits == 5 and len(digit_sum.problems()[0]) == 5
    for task in (rows, digit_sum):
        for problem in task.problems()[:50]:
            assert as_score_of(task, problem, task.demonstration(problem)).correct
        assert not as_score_of(task, task.problems()[0], "<answer>x</answer> 99999").correct
    for problem in guess.problems()[:200]:  # the environment answers its own demonstrations as shown
        trace = guess.demonstration(problem)
        episode = Episode(problem, as_prompt(guess.prompt(problem)))
        replies = [guess.step(episode, turn) for turn in trace[::2]]
        assert [r.text for r in replies[:-1]] == trace[1::2] and replies[-1].correct
        assert len(trace[::2]) <= guess.max_turns
    for task in (rows, digit_sum, guess):  # the embedded model's positions hold every demonstration
        demonstration_rows(tok, task, task.problems(), 128)


def as_score_of(task, problem, completion):
    from asyncrl.rl.tasks import as_score

    return as_score(task.score(problem, completion), task.correct_reward)
