"""A user's own task, defined in this file, trained end to end through ``asyncrl launch
examples/grpo.py --task.name tests/test_user_task.py:Class``: every process (the driver's checks,
the samplers, the trainer's evaluation) imports it from here. And the user's code failing in each
way it can: the run goes on, counting the failures, until too many fail; then it stops naming the
task and the first traceback."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import zlib

from asyncrl.rl.tasks.base import Score, Task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)
TINY = [
    "--model.hidden_size",
    "32",
    "--model.num_layers",
    "1",
    "--model.num_heads",
    "1",
    "--model.num_kv_heads",
    "1",
    "--model.intermediate_size",
    "64",
    "--model.max_positions",
    "32",
    "--warm_start.n_examples",
    "200",
    "--warm_start.heldout_reserve",
    "16",
    "--warm_start.eval_problems",
    "0",
    "--run.n_heldout",
    "16",
    "--run.n_train",
    "150",
    "--sampler.max_new_tokens",
    "4",
    "--sampler.backend",
    "hf",
    "--run.mode",
    "sync",
    "--run.eval_samples",
    "0",
    "--run.checkpoint_every",
    "0",
    "--run.curves",
    "false",  # no curves.png: matplotlib's seconds at every run's end; test_observe.py draws it
]


class YesNo(Task):
    """Answer a question with "yes" or "no"; the reward wants "yes". The warm start teaches both
    answers, half and half, so GRPO starts from a coin and has one thing to learn."""

    name = "yesno"

    def problems(self):
        return [{"q": f"q{i}"} for i in range(200)]

    def prompt(self, problem):
        return f"{problem['q']}?"

    def score(self, problem, completion):
        return Score(1.0 if completion.startswith("yes") else 0.0, metrics={"said_no": completion.startswith("no")})

    def demonstration(self, problem):  # a coin per problem that the prompt does not give away
        return "yes" if zlib.crc32(problem["q"].encode()) % 2 else "no"


class Flaky(YesNo):
    """Scores every way a user's code can fail, in turn: raises, hangs past the deadline, returns
    NaN, returns a string; and scores right in between."""

    name = "flaky"

    def score(self, problem, completion):
        kind = int(problem["q"][1:]) % 5
        if kind == 0:
            raise ZeroDivisionError("the user's bug")
        if kind == 1:
            time.sleep(1.5)  # blocks its thread, past --task.score_timeout_s
        if kind == 2:
            return math.nan
        if kind == 3:
            return "1.0"
        return 1.0


class Broken(YesNo):
    """A score that always raises: the run must stop, naming the task and the traceback."""

    name = "broken"

    def score(self, problem, completion):
        return {"reward": 1.0}["rewrd"]


class Sleepy(YesNo):
    """A score that sleeps far past any deadline (a user's reward waiting on a dead service)."""

    name = "sleepy"

    def score(self, problem, completion):
        time.sleep(60)
        return 1.0


def launch(tmp_path, *args, timeout=300, cache: str | None = None):
    """examples/grpo.py through `asyncrl launch`; its model cached in ``cache`` (conftest's
    ``model_cache``: test_lora.py's YesNo run warm-starts the same model), else in ``tmp_path``."""
    env = dict(os.environ, ASYNCRL_CACHE_DIR=cache or str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", os.path.join(ROOT, "examples", "grpo.py"), *TINY, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_task_defined_in_a_test_file_learns(tmp_path, model_cache):
    run_dir = tmp_path / "run"
    done = launch(
        tmp_path,
        "--task.name",
        f"{HERE}:YesNo",
        "--run.steps",
        "12",
        "--run.groups_per_step",
        "4",
        "--sampler.group_size",
        "4",
        "--trainer.lr",
        "3e-3",
        "--warm_start.steps",
        "80",
        "--warm_start.lr",
        "1e-2",
        "--warm_start.warmup_steps",
        "5",
        "--warm_start.batch_size",
        "32",
        "--run.eval_every",
        "12",
        "--run.run_dir",
        str(run_dir),
        cache=model_cache,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rewards = [r["reward_mean"] for r in records(run_dir)]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    first = records(run_dir)[0]
    assert "task/said_no" in first and 0.0 <= first["task/said_no"] <= 1.0
    assert json.loads((run_dir / "config.json").read_text())["task"]["name"] == f"{HERE}:YesNo"
    assert "task yesno" in done.stdout
    episodes = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in episodes] == list(range(1, 13))  # one trained episode per step, decoded
    assert all(e["prompt"].endswith("?") and [p["mask"] for p in e["pieces"]] == [1] for e in episodes)
    assert all(e["tokens"] == e["completion_tokens"] for e in episodes)  # single-turn: every token trained
    # final/ is prompted as the task trained: its template renders the task's prompt, not Countdown's
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(run_dir / "final"), local_files_only=True)
    chat = [{"role": "user", "content": "q7?"}, {"role": "assistant", "content": "yes"}]
    assert tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True) == "q7?"
    assert tok.apply_chat_template(chat, tokenize=False) == "q7?yes" + tok.eos_token


def test_failing_user_code_scores_zero_is_counted_and_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    done = launch(
        tmp_path,
        "--task.name",
        f"{HERE}:Flaky",
        "--task.score_timeout_s",
        "0.3",
        "--task.max_failure_rate",
        "0.95",
        "--run.steps",
        "3",
        "--run.groups_per_step",
        "5",
        "--sampler.group_size",
        "2",
        "--warm_start.steps",
        "3",
        "--run.eval_every",
        "3",
        "--run.run_dir",
        str(run_dir),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counted: dict[str, float] = {}
    for r in records(run_dir):
        for key, value in r.items():
            if key.startswith("task_errors/"):
                counted[key] = counted.get(key, 0) + value
    assert {"task_errors/raised", "task_errors/timeout", "task_errors/bad_value"} <= set(counted), counted
    assert all(r["reward_mean"] <= 0.2 + 1e-9 for r in records(run_dir))  # only 1 problem in 5 can score
    # The held-out evaluation runs the same code under the same deadline, and says what failed.
    before = next(line for line in done.stdout.splitlines() if "held-out solve rate before GRPO" in line)
    assert "; failed score/step calls, scored 0: " in before and all(
        k in before for k in ("raised", "timeout", "bad_value")
    ), before
    last = records(run_dir)[-1]
    assert {"heldout/task_errors/raised", "heldout/task_errors/timeout", "heldout/task_errors/bad_value"} <= set(last)


def test_a_task_that_always_fails_stops_the_run_naming_it_and_its_traceback(tmp_path):
    run_dir = tmp_path / "run"
    done = launch(
        tmp_path,
        "--task.name",
        f"{HERE}:Broken",
        "--run.steps",
        "20",
        "--run.groups_per_step",
        "8",
        "--sampler.group_size",
        "4",
        "--warm_start.steps",
        "3",
        "--run.run_dir",
        str(run_dir),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "broken" in done.stderr and "KeyError" in done.stderr and "rewrd" in done.stderr, done.stderr[-3000:]
    assert "--task.max_failure_rate" in done.stderr


def test_a_reward_that_hangs_stops_the_heldout_evaluation_at_its_budget(tmp_path):
    """The held-out evaluation before GRPO runs the reward under --task.score_timeout_s and
    --task.max_failure_rate, as the samplers do: a reward that sleeps 60 s stops the run there in
    one error naming the task, the deadline and where it hung. (Before: each failure scored 0
    without a word, and such a reward held the evaluation for 14 minutes while status said
    "starting".)"""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    done = launch(
        tmp_path,
        "--task.name",
        f"{HERE}:Sleepy",
        "--task.score_timeout_s",
        "0.5",
        "--run.n_heldout",
        "60",
        "--warm_start.heldout_reserve",
        "60",
        "--warm_start.steps",
        "3",
        "--run.steps",
        "5",
        "--run.run_dir",
        str(run_dir),
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "the held-out evaluation: task sleepy: 50 of 50 score/step calls failed (100%, more than "
        "--task.max_failure_rate 0.2); the first failure:"
    ) in done.stderr, done.stderr[-3000:]
    assert "ran past its 0.5 s deadline" in done.stderr and "time.sleep(60)" in done.stderr
    assert "before GRPO" not in done.stdout and not (run_dir / "metrics.jsonl").read_text().strip()
    assert took < 150, took
