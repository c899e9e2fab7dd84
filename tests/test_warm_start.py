"""The embedded model's warm start: the same weights whatever the thread count, threads from the
cores the process may use, a stop that ends a build within seconds and caches nothing; on any task
with demonstrations (Countdown keeps its cache key and training rows; an environment's replies are
context, not targets). Small configurations keep the file to seconds."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.rl.config.model import ModelConfig, WarmStartConfig
from asyncrl.rl.model import evaluation, warm_start
from asyncrl.rl.model.demonstrations import demonstration_rows
from asyncrl.rl.model.evaluation import StoppedError
from asyncrl.rl.model.warm_start import default_model
from asyncrl.rl.tasks.base import Environment, Task, TaskError, as_prompt

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=64)
SHORT = WarmStartConfig(steps=12, batch_size=64, warmup_steps=2, n_examples=256, heldout_reserve=16, eval_problems=0)


def weights(path: str) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def test_warm_start_is_the_same_on_any_thread_count(tmp_path):
    """The cache key does not name the thread count, so the weights must not depend on it. Three
    threads is the case that differed (by 1 ulp, then more) before training was pinned to one:
    elementwise kernels split across 3 threads end chunks off the vector width."""
    built = {
        t: weights(default_model(SMALL, SHORT, cache_dir=str(tmp_path / str(t)), threads=t, log=lambda _: None))
        for t in (1, 2, 3)
    }
    for t in (2, 3):
        assert built[t].keys() == built[1].keys()
        assert [k for k in built[1] if not built[1][k].equal(built[t][k])] == [], f"{t} threads"


def test_threads_come_from_the_cpu_affinity_not_the_load(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0), raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert warm_start._usable_cores() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert warm_start._usable_cores() == 4  # capped: a 1M-parameter model gains little beyond


def build_in_thread(cache: str, stop: threading.Event, warm: WarmStartConfig, started: threading.Event):
    result: dict = {}

    def log(line: str) -> None:
        if "warm-starting" in line:
            started.set()

    def run() -> None:
        try:
            result["path"] = default_model(SMALL, warm, cache_dir=cache, threads=1, log=log, stop=stop)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e
        result["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_stop_ends_a_warm_start_within_seconds_and_caches_nothing(tmp_path):
    stop, started = threading.Event(), threading.Event()
    long = WarmStartConfig(
        steps=100_000, batch_size=32, warmup_steps=2, n_examples=256, heldout_reserve=16, eval_problems=0
    )
    thread, result = build_in_thread(str(tmp_path), stop, long, started)
    assert started.wait(60), "the warm start never began training"
    time.sleep(0.5)  # a few steps in
    stop.set()
    asked = time.monotonic()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(result.get("error"), StoppedError), result
    assert result["ended"] - asked < 2.0
    assert os.listdir(tmp_path / "models") == []  # no partial entry, no leftover .tmp-* directory


def test_stop_before_training_raises_too(tmp_path):
    stop = threading.Event()
    stop.set()
    with pytest.raises(StoppedError):
        default_model(SMALL, SHORT, cache_dir=str(tmp_path), threads=1, log=lambda _: None, stop=stop)
    assert os.listdir(tmp_path / "models") == []


def test_stop_during_the_evaluation(tmp_path, monkeypatch):
    """The last long loop, the greedy evaluation, stops too (between its batches, and before saving)."""
    stop = threading.Event()
    real = evaluation._generate_rows

    def generate_then_stop(*args, **kwargs):
        stop.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "_generate_rows", generate_then_stop)
    warm = WarmStartConfig(steps=1, batch_size=8, warmup_steps=1, n_examples=64, heldout_reserve=16, eval_problems=4)
    with pytest.raises(StoppedError):
        default_model(SMALL, warm, cache_dir=str(tmp_path), threads=1, log=lambda _: None, stop=stop)
    assert os.listdir(tmp_path / "models") == []


# --- on a GPU (--warm_start.device) -----------------------------------------------------------------


def test_the_warm_start_device_follows_the_run():
    assert warm_start.warm_start_device("cpu", "cuda") == "cpu"
    assert warm_start.warm_start_device("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda, not 'gpu'"):
        WarmStartConfig(device="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_gpu.py trains one on this host's GPU")
def test_a_warm_start_where_this_process_sees_no_gpu():
    from asyncrl.rl.config.parse import ConfigError

    assert warm_start.warm_start_device("auto", "cuda") == "cpu"  # a plan on other nodes' GPUs
    with pytest.raises(ConfigError, match=r"--warm_start.device cuda, but this process sees no CUDA device.*or cpu"):
        warm_start.warm_start_device("cuda", "cuda")


def test_a_gpu_warm_start_is_cached_apart_from_the_cpu_ones_and_per_gpu_model():
    """What was asked is not in the key (auto and cpu that both train on the CPU share one), where it
    trained is, except for the CPU (whose keys are those of before)."""
    keys = {
        where: warm_start.cache_key(ModelConfig(), WarmStartConfig(device=asked), None, where)
        for asked, where in (("auto", "cpu"), ("cuda", "cuda:NVIDIA H200"), ("auto", "cuda:NVIDIA H100 80GB HBM3"))
    }
    assert keys["cpu"] == COUNTDOWN_DEFAULT_KEY == warm_start.cache_key(ModelConfig(), WarmStartConfig(device="cpu"))
    assert len(set(keys.values())) == 3


# --- any task -------------------------------------------------------------------------------------

COUNTDOWN_DEFAULT_KEY = "1cfa1c5b452e000bbf3c"
"""cache_key(ModelConfig(), WarmStartConfig(), countdown) as computed before tasks were public
(from {"version", "model", "warm", "countdown", "tokenizer", "probe"}): the user's cached default
model stays valid, and so do the default run's first-step metrics."""


def test_countdown_keeps_its_cache_key():
    from asyncrl.rl.config.task import CountdownConfig
    from asyncrl.rl.tasks.countdown import Countdown

    for task in (Countdown(), Countdown(CountdownConfig()), None):
        assert warm_start.cache_key(ModelConfig(), WarmStartConfig(), task) == COUNTDOWN_DEFAULT_KEY
    assert (
        warm_start.cache_key(ModelConfig(), WarmStartConfig(), Countdown(CountdownConfig(max_count=5)))
        != COUNTDOWN_DEFAULT_KEY
    )


def test_countdown_trains_on_prompt_reference_and_eos():
    """The training rows are the ones Countdown trained on before tasks were public, token for token."""
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.tasks.countdown import Countdown, format_prompt_compact, format_reference

    tok, task = build_tokenizer(), Countdown()
    problems = list(task.splits(0, 8, 4).train)
    ids, labels, lengths, longest_turn = demonstration_rows(tok, task, problems, 64)
    for i, p in enumerate(problems):
        prompt = tok(format_prompt_compact(p), add_special_tokens=False)["input_ids"]
        completion = tok(format_reference(p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids[i, : lengths[i]].tolist() == prompt + completion
        assert labels[i, : lengths[i]].tolist() == [-100] * len(prompt) + completion
    assert longest_turn == max(int(lengths[i]) - len(format_prompt_compact(p)) for i, p in enumerate(problems))


class Reverse(Task):
    """Write the three digits backwards; every fourth problem has no demonstration (skipped)."""

    name = "reverse"

    def problems(self):
        return [f"{i:03d}" for i in range(200)]

    def prompt(self, problem):
        return f"{problem}>"

    def score(self, problem, completion):
        return float(completion == problem[::-1])

    def demonstration(self, problem):
        return None if int(problem) % 4 == 0 else problem[::-1]


class NoDemonstrations(Reverse):
    name = "no_demonstrations"

    def demonstration(self, problem):
        return None


def test_a_task_with_demonstrations_warm_starts(tmp_path):
    warm = WarmStartConfig(steps=3, batch_size=16, warmup_steps=1, n_examples=100, heldout_reserve=8, eval_problems=4)
    path = default_model(SMALL, warm, Reverse(), cache_dir=str(tmp_path), threads=1, log=lambda _: None)
    with open(os.path.join(path, "asyncrl_model.json")) as f:
        marker = json.load(f)
    train = Reverse().splits(warm.data_seed, warm.n_examples, warm.heldout_reserve).train
    assert len(train) == 100 and marker["task"] == "reverse"
    assert marker["train_examples"] == sum(int(p) % 4 != 0 for p in train)  # those without one are skipped
    assert marker["max_new_tokens_hint"] == 3 + 1 + 8  # the longest turn, its eos, the slack
    assert 0.0 <= marker["heldout_greedy_solve_rate"] <= 1.0
    assert os.path.basename(path) == warm_start.cache_key(SMALL, warm, Reverse())
    assert warm_start.cache_key(SMALL, warm, Reverse()) != warm_start.cache_key(SMALL, warm, None)
    # Its template (which final/ and best/ copy) renders the task's prompt and answer as trained,
    # not Countdown's "numbers -> target" form.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    chat = [{"role": "user", "content": "123>"}, {"role": "assistant", "content": "321"}]
    assert tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True) == "123>"
    assert tok.apply_chat_template(chat, tokenize=False) == "123>321<|im_end|>"


class SlowReverse(Reverse):
    name = "slow_reverse"

    def score(self, problem, completion):
        time.sleep(5)  # a reward waiting on a service that is down
        return 0.0


def test_a_reward_that_hangs_ends_the_warm_starts_check_at_its_budget(tmp_path):
    """The solve rate after the warm start runs the reward under the run's deadline and budget: a
    reward that hangs gives no rate (one line) within seconds, not one deadline per hung worker
    and problem (200 problems of a reward sleeping 60 s: 13 minutes)."""
    warm = WarmStartConfig(steps=1, batch_size=8, warmup_steps=1, n_examples=64, heldout_reserve=60, eval_problems=60)
    lines: list[str] = []
    trained: list[float] = []  # when training began (transformers' first import comes before)

    def log(line: str) -> None:
        lines.append(line)
        trained.extend([time.monotonic()] * ("warm-starting" in line))

    path = default_model(
        SMALL, warm, SlowReverse(), cache_dir=str(tmp_path), threads=1, log=log, score_calls=(0.2, 0.2)
    )
    assert time.monotonic() - trained[0] < 10  # 1.4 s on the loaded 2-core machine
    with open(os.path.join(path, "asyncrl_model.json")) as f:
        assert json.load(f)["heldout_greedy_solve_rate"] is None
    assert (
        "[model] no solve rate after the warm start: task slow_reverse: 50 of 50 score/step calls failed "
        "(100%, more than --task.max_failure_rate 0.2); the first failure:"
    ) in lines


def test_a_task_without_demonstrations_needs_a_checkpoint(tmp_path):
    with pytest.raises(TaskError, match="no demonstrations.*--model_path"):
        default_model(SMALL, SHORT, NoDemonstrations(), cache_dir=str(tmp_path), threads=1, log=lambda _: None)
    assert os.listdir(tmp_path / "models") == []


class Tool(Environment):
    """A call, the environment's result, the answer."""

    name = "tool"
    stop = ["</calc>"]

    def problems(self):
        return ["2+3"]

    def prompt(self, problem):
        return f"{problem}?"

    def demonstration(self, problem):
        return [f"<calc>{problem}</calc>", "<result>5</result>", "<answer>5</answer>"]


def test_an_environments_replies_carry_no_labels():
    from asyncrl.rl.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    ids, labels, lengths, longest_turn = demonstration_rows(tok, Tool(), ["2+3"], 64)
    pieces = [
        tok(t, add_special_tokens=False)["input_ids"]
        for t in ("2+3?", "<calc>2+3</calc>", "<result>5</result>", "<answer>5</answer>")
    ]
    prompt, call, result, answer = pieces
    eos = tok.eos_token_id
    # A turn ended by a stop string has no eos (generation stops there); the answer's has one.
    assert ids[0, : lengths[0]].tolist() == prompt + call + result + answer + [eos]
    assert labels[0, : lengths[0]].tolist() == [-100] * len(prompt) + call + [-100] * len(result) + answer + [eos]
    assert longest_turn == len(call)


class Replay:
    """A fake `Generate`: a model that has learnt the warm start's rows by heart. Each context must
    be the start of one of them; the model writes that row's next tokens and stops where a backend
    would: after a stop token, at a stop string (its text cut before it), or at ``max_new_tokens``.
    The first call is the problems' prompts, in order: problem i's row continues it (prompts may
    be alike, as Guess's are, when only the problem knows the first move)."""

    def __init__(self, tok, rows: list[list[int]]):
        self.tok, self.rows, self.first = tok, rows, True

    async def __call__(self, prompts, n, params):
        from asyncrl.rl.generation import Completion

        out = []
        first, self.first = self.first, False
        for i, context in enumerate(prompts):
            rows = [self.rows[i]] if first else self.rows
            row = next((r for r in rows if r[: len(context)] == context), None)
            assert row is not None, f"a context the warm start never trained on: {self.tok.decode(context)!r}"
            got = []
            for token in row[len(context) : len(context) + params.max_new_tokens]:
                got.append(token)
                text = self.tok.decode(got, skip_special_tokens=True)
                if token in params.stop_token_ids or any(s in text for s in params.stop):
                    break
            hits = [text.find(s) for s in params.stop if s in text]
            finish = "stop" if got[-1] in params.stop_token_ids or hits else "length"
            out.append([Completion(got, [0.0] * len(got), text[: min(hits)] if hits else text, finish)] * n)
        return out


def environments(tmp_path) -> list:
    """docs/tasks.md's Guess and examples/guess.py (turns end on eos), examples/calculator.py (a
    tool call ends on its stop string, the answer on eos)."""
    from asyncrl.rl.tasks import TaskSpec, load_task
    from test_examples import EXAMPLES, calculator_module, doc_files

    return [
        load_task(TaskSpec(name=f"{doc_files(tmp_path)['guess.py']}:Guess")),
        load_task(TaskSpec(name=f"{EXAMPLES}/guess.py:Guess")),
        calculator_module().Calculator(),
    ]


def test_an_environments_warm_start_rows_are_its_episodes_token_for_token(tmp_path):
    """For the same demonstration, the warm start trains on exactly the tokens (and the mask) an
    episode produces: a model that learnt the rows by heart plays each problem's episode through the
    runner as demonstrated, and the saved chat template renders the same conversation to the same
    tokens. (Before: the warm start wrote eos after the last turn only, so every episode's turns,
    which keep their eos before the reply, were sequences it had never seen.)"""
    import asyncio

    from asyncrl.rl.generation import SamplingParams
    from asyncrl.rl.model.policy import PromptFormat
    from asyncrl.rl.model.tokenizer import build_tokenizer
    from asyncrl.rl.tasks.episodes import EpisodeRunner
    from asyncrl.rl.tasks.scoring import UserCalls

    tok = build_tokenizer()
    eos = tok.eos_token_id
    for task in environments(tmp_path):
        problems = [p for p in task.problems()[:20] if len(task.demonstration(p)) > 1]
        ids, labels, lengths, _ = demonstration_rows(tok, task, problems, 128)
        rows = [ids[i, : lengths[i]].tolist() for i in range(len(problems))]
        fmt = PromptFormat("compact", tok, [eos], 40)
        calls = UserCalls(task.task_name(), 5.0, 1.0)
        try:
            params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[eos])
            groups = asyncio.run(
                EpisodeRunner(task, fmt, calls, max_context=128).run(problems, 1, params, Replay(tok, rows))
            )
        finally:
            calls.close()
        tok.chat_template = warm_start.chat_template(task)
        for i, ((sample,), problem) in enumerate(zip(groups, problems)):
            prompt = fmt.render_ids(as_prompt(task.prompt(problem)))
            assert prompt + sample.token_ids == rows[i], task.task_name()
            assert sample.action_mask == [int(x != -100) for x in labels[i, len(prompt) : lengths[i]].tolist()]
            assert (
                sample.correct
                and not sample.error
                and sample.metrics["turns"] == (len(task.demonstration(problem)) + 1) // 2
            )
            turns = task.demonstration(problem)
            messages = [{"role": "user", "content": task.prompt(problem)}] + [
                {"role": "user" if j % 2 else "assistant", "content": t} for j, t in enumerate(turns)
            ]
            assert tok.apply_chat_template(messages, tokenize=True, return_dict=False) == rows[i]
            assert tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == task.prompt(
                problem
            )


def test_a_stop_string_inside_a_demonstrated_turn_is_one_line():
    from asyncrl.rl.model.tokenizer import build_tokenizer

    class Early(Tool):
        def demonstration(self, problem):
            return ["<calc>2+3</calc> and more", "<result>5</result>", "<answer>5</answer>"]

    with pytest.raises(TaskError, match="stop string '</calc>' before its end.*split it into two turns"):
        demonstration_rows(build_tokenizer(), Early(), ["2+3"], 64)


@pytest.mark.parametrize(
    "demonstration, error",
    [
        (["<calc>1</calc>", "<result>1</result>"], "odd length"),  # ends on the environment's turn
        ([1], "odd length"),
    ],
)
def test_a_malformed_demonstration_is_one_line(demonstration, error):
    from asyncrl.rl.model.tokenizer import build_tokenizer

    class Bad(Tool):
        def demonstration(self, problem):
            return demonstration

    with pytest.raises(TaskError, match=error):
        demonstration_rows(build_tokenizer(), Bad(), ["2+3"], 64)
    with pytest.raises(TaskError, match="must return a str or None"):
        demonstration_rows(
            build_tokenizer(), type("ListDemo", (Reverse,), {"demonstration": lambda self, p: [p]})(), ["001"], 64
        )


# --- the reserve: a held-out file, a small task (model/reserve.py) --------------------------------


def rows_task(tmp_path, n_rows: int, n_heldout_rows: int):
    """A data file and a reward function, as a user gives them, with a held-out file."""
    from asyncrl.rl.tasks import TaskSpec, load_task

    def rows(n, start):
        return "".join(
            json.dumps({"prompt": f"{i:03d}>", "answer": f"{i:03d}"[::-1], "demonstration": f"{i:03d}"[::-1]}) + "\n"
            for i in range(start, start + n)
        )

    (tmp_path / "rows.jsonl").write_text(rows(n_rows, 0))
    (tmp_path / "heldout.jsonl").write_text(rows(n_heldout_rows, 500))
    (tmp_path / "reward.py").write_text("def reward(row, completion):\n    return float(completion == row['answer'])\n")
    return load_task(
        TaskSpec(
            name="",
            data=str(tmp_path / "rows.jsonl"),
            heldout_data=str(tmp_path / "heldout.jsonl"),
            reward=f"{tmp_path / 'reward.py'}:reward",
        )
    )


def test_a_heldout_file_is_the_warm_starts_reserve(tmp_path):
    """A held-out file of exactly --run.n_heldout rows (fewer than the reserve) warm-starts: the
    reserve is the file's rows, said in one line. (Before: a traceback blaming --run.n_heldout.)"""
    task = rows_task(tmp_path, 60, 8)
    warm = WarmStartConfig(steps=2, batch_size=8, warmup_steps=1, n_examples=60, heldout_reserve=16, eval_problems=16)
    lines = []
    path = default_model(SMALL, warm, task, cache_dir=str(tmp_path / "cache"), threads=1, log=lines.append)
    with open(os.path.join(path, "asyncrl_model.json")) as f:
        marker = json.load(f)
    assert marker["warm"]["heldout_reserve"] == marker["warm"]["eval_problems"] == 8
    assert marker["train_examples"] == 60  # the file's rows: none is held out of them
    assert (
        "[model] the warm start of task reward.py:reward reserves the 8 rows of --task.heldout_data (not "
        "--warm_start.heldout_reserve 16): it never trains on that file" in lines
    )


def test_a_heldout_file_lets_n_heldout_exceed_the_reserve():
    from asyncrl.rl.config.grpo import GRPOConfig, check_heldout_unseen
    from asyncrl.rl.config.parse import ConfigError, parse_overrides

    with pytest.raises(ConfigError, match="--run.n_heldout 1500 is more than --warm_start.heldout_reserve 1000"):
        check_heldout_unseen(parse_overrides(GRPOConfig(), ["--run.n_heldout", "1500"]))
    check_heldout_unseen(parse_overrides(GRPOConfig(), ["--run.n_heldout", "1500", "--task.heldout_data", "h.jsonl"]))


def test_a_small_task_keeps_most_of_its_problems_for_the_warm_start():
    """Reverse has 200 problems: a reserve of 150 would leave the warm start 50; it holds out the
    run's 20 held-out problems instead, and says how many problems the full reserve needs."""
    from asyncrl.rl.model.reserve import fitted_warm_start
    from asyncrl.rl.tasks.countdown import Countdown

    warm = WarmStartConfig(heldout_reserve=150, eval_problems=40)
    fitted, line = fitted_warm_start(warm, Reverse(), 20)
    assert (fitted.heldout_reserve, fitted.eval_problems) == (20, 20)
    assert line == (
        "task reverse has 200 problems: the warm start holds out --run.n_heldout 20 of them, not "
        "--warm_start.heldout_reserve 150, and trains on the other 180; a task needs 300 problems or "
        "more for the full reserve (or give --task.heldout_data)"
    )
    train, heldout = Reverse().splits(0, 1000, fitted.heldout_reserve)
    assert heldout == Reverse().splits(0, 1000, 20).heldout and len(train) == 180  # the run's held-out set: unseen
    enough = WarmStartConfig(heldout_reserve=100, eval_problems=20)  # 200 problems: twice the reserve
    assert fitted_warm_start(enough, Reverse(), 20) == (enough, "")
    assert fitted_warm_start(warm, Reverse(), None) == (warm, "")  # no run: as configured
    assert fitted_warm_start(WarmStartConfig(), Countdown(), 500) == (WarmStartConfig(), "")  # its own splits
