"""Bring your own task, up to the first process spawned: rows from JSONL and Parquet files (and
every way a file can fail to give them, named by file and line), the default splits (seeded,
prefix-stable, disjoint), a task class or a reward function named on the command line (and every
way that can fail: one line, exit status 2 through `asyncrl launch examples/grpo.py`, nothing
written), and the task's own options as a section of the config (``--countdown.*``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from asyncrl.rl.config import ConfigError, GRPOConfig, config_to_dict, grpo_config_type, help_text, parse_overrides
from asyncrl.rl.tasks import (
    DatasetError,
    RewardFunctionTask,
    Score,
    Task,
    TaskError,
    TaskLoadError,
    TaskSpec,
    load_rows,
    load_task,
    task_class,
)
from asyncrl.rl.tasks.base import default_fingerprint
from asyncrl.rl.tasks.countdown import Countdown
from asyncrl.rl.tasks.dataset import read_rows
from launch_support import launch_example, tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "grpo.py")
pytestmark = pytest.mark.timeout(120)


def write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def rows_file(path, n: int) -> str:
    return write(path, "".join(json.dumps({"prompt": f"q{i}", "id": i}) + "\n" for i in range(n)))


class Rows(Task):
    """A task whose problems are ``--task.data``'s rows (the default `problems`)."""

    name = "rows"

    def prompt(self, row):
        return row["prompt"]

    def score(self, row, completion):
        return float(completion == "yes")


def rows_task(rows, heldout=None) -> Rows:
    task = Rows()
    task.data, task.heldout_data = rows, heldout
    return task


# --- rows from disk -------------------------------------------------------------------------------


def test_jsonl_rows_are_objects_and_blank_lines_are_skipped(tmp_path):
    path = write(tmp_path / "rows.jsonl", '{"prompt": "a", "n": 1}\n\n  \n{"prompt": "b", "x": [1, 2]}\n')
    assert load_rows(path) == [{"prompt": "a", "n": 1}, {"prompt": "b", "x": [1, 2]}]
    assert read_rows(path)[1] == ["line 1", "line 4"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "{path}: no such file"),
        ("", "{path}: no rows (an empty file)"),
        ("\n  \n", "{path}: no rows (an empty file)"),
        ('{"prompt": "a"}\n\n{"prompt": "b",\n', "{path}: line 3: not valid JSON ("),
        ('{"prompt": "a"}\n["prompt", "b"]\n', "{path}: line 2: a row must be a JSON object ({{...}}), not an array"),
        ('{"prompt": "a"}\n"b"\n', "{path}: line 2: a row must be a JSON object ({{...}}), not a string"),
        (b'{"prompt": "\xff"}\n', "{path}: line 1: not valid JSON ("),
    ],
)
def test_a_file_without_rows_is_one_line_naming_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError) as caught:
        load_rows(str(path))
    assert str(caught.value).startswith(message.format(path=path)) and "\n" not in str(caught.value)
    assert isinstance(caught.value, TaskError) and isinstance(caught.value, ValueError)


def test_a_directory_is_not_a_data_file(tmp_path):
    with pytest.raises(DatasetError, match=r"a directory, not a data file"):
        load_rows(str(tmp_path))


def test_parquet_rows_read_as_dicts_and_name_their_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": 1}, {"prompt": None, "answer": 2}]), path)
    assert load_rows(path) == [{"prompt": "a", "answer": 1}, {"prompt": None, "answer": 2}]
    spec = TaskSpec("", data=path, reward=f"{write(tmp_path / 'r.py', 'def reward(row, c): return 1.0')}:reward")
    with pytest.raises(DatasetError, match=rf"^--task.data {path}: row 1: no 'prompt' key"):
        load_task(spec)
    (tmp_path / "bad.pq").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"bad.pq: cannot read it as Parquet \("):
        load_rows(str(tmp_path / "bad.pq"))


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` raises ImportError
    (tmp_path / "rows.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match=r"rows.parquet: reading Parquet needs pyarrow: pip install pyarrow$"):
        load_rows(str(tmp_path / "rows.parquet"))


# --- the default splits ---------------------------------------------------------------------------


def test_default_splits_are_seeded_prefix_stable_disjoint_and_in_file_order():
    task = rows_task([{"id": i} for i in range(100)])
    train, heldout = task.splits(0, 1000, 10)
    assert (len(train), len(heldout)) == (90, 10)
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in heldout)
    assert [r["id"] for r in train] == sorted(r["id"] for r in train)  # the file's order
    assert heldout != [{"id": i} for i in range(10)]  # shuffled, not the first rows
    assert task.splits(0, 1000, 10) == (train, heldout)  # deterministic
    assert task.splits(0, 5, 10) == (train[:5], heldout)  # the held-out split does not depend on n_train
    assert task.splits(0, 1000, 25).heldout[:10] == heldout  # a prefix of a longer one
    assert task.splits(1, 1000, 10).heldout != heldout


def test_holding_out_every_problem_is_an_error_naming_the_flag():
    with pytest.raises(TaskError, match=r"^task rows: --run.n_heldout 5 holds out all 5 problems, leaving none"):
        rows_task([{"id": i} for i in range(5)]).splits(0, 10, 5)
    with pytest.raises(TaskError, match=r"no problems: give a data file with --task.data"):
        rows_task(()).splits(0, 10, 5)


def test_heldout_data_is_the_held_out_split():
    task = rows_task([{"id": i} for i in range(20)], heldout=[{"h": i} for i in range(8)])
    assert task.splits(3, 5, 4) == ([{"id": i} for i in range(5)], [{"h": i} for i in range(4)])
    with pytest.raises(TaskError, match=r"--run.n_heldout 9 is more than the 8 rows of --task.heldout_data"):
        task.splits(3, 5, 9)


def test_the_default_fingerprint_names_the_task_its_probes_and_its_data():
    task = rows_task([{"prompt": f"q{i}", "id": i} for i in range(10)])
    fingerprint = default_fingerprint(task)
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert fingerprint["task"] == "rows" and fingerprint["options"] is None
    probe = fingerprint["probe"]
    assert [p[1] for p in probe] == [None] * 3 and all(p[0].startswith("q") for p in probe)
    other = rows_task([{"prompt": f"q{i}", "id": i} for i in range(9)] + [{"prompt": "changed", "id": 9}])
    assert default_fingerprint(other)["data"] != fingerprint["data"]


# --- a data file and a reward function ------------------------------------------------------------


def test_a_reward_function_task_prompts_with_the_row_and_scores_with_the_function(tmp_path):
    data = write(
        tmp_path / "rows.jsonl",
        """\
        {"question": "2+2", "answer": "4", "demonstration": "4"}
        {"question": [{"role": "user", "content": "3+3"}], "answer": "6"}
        {"question": "1+1", "answer": "2", "demonstration": ["a", "list"]}
        {"question": "5+5", "answer": "10"}
        """,
    )
    reward = write(
        tmp_path / "my_reward.py",
        """\
        from asyncrl.rl.tasks import Score
        def exact(row, completion):
            return Score(float(completion.strip() == row["answer"]), metrics={"length": len(completion)})
        async def later(row, completion):
            return 1.0
        """,
    )
    task = load_task(TaskSpec("", data=data, reward=f"{reward}:exact", prompt_key="question"))
    assert isinstance(task, RewardFunctionTask) and task.task_name() == "my_reward.py:exact"  # the user's file
    rows = task.data
    assert task.prompt(rows[0]) == "2+2" and task.prompt(rows[1]) == [{"role": "user", "content": "3+3"}]
    assert task.score(rows[0], " 4") == Score(1.0, metrics={"length": 2})
    assert [task.demonstration(r) for r in rows] == ["4", None, None, None]
    later = load_task(TaskSpec("", data=data, reward=f"{reward}:later", prompt_key="question"))
    coroutine = later.score(rows[0], "x")
    assert hasattr(coroutine, "__await__")
    coroutine.close()
    assert later.splits(0, 10, 2) == task.splits(0, 10, 2)  # the split is the data's, whatever the reward
    assert load_task(TaskSpec("", data=data, reward=f"{reward}:exact", prompt_key="question")) is task  # cached


def test_a_row_without_its_prompt_is_named_by_line(tmp_path):
    data = write(tmp_path / "rows.jsonl", '{"prompt": "a"}\n\n{"question": "b", "answer": 1}\n')
    reward = write(tmp_path / "r.py", "def reward(row, completion):\n    return 0.0\n")
    with pytest.raises(
        DatasetError,
        match=rf"^--task.data {data}: line 3: no 'prompt' key \(--task.prompt_key "
        r"prompt\); its keys: 'question', 'answer'$",
    ):
        load_task(TaskSpec("", data=data, reward=f"{reward}:reward"))
    bad = write(tmp_path / "bad.jsonl", '{"prompt": [{"role": "user"}]}\n')
    with pytest.raises(DatasetError, match=r"line 1: 'prompt': a prompt message must be a Message or a dict"):
        load_task(TaskSpec("", data=bad, reward=f"{reward}:reward"))


# --- loading a task class -------------------------------------------------------------------------


USER_TASK = """\
    from dataclasses import dataclass
    from asyncrl.rl.tasks import Task

    @dataclass(frozen=True, kw_only=True)
    class EchoConfig:
        \"\"\"How long the words are.\"\"\"

        length: int = 3
        \"\"\"Letters per word.\"\"\"
        pair: tuple[float, float] = (0.5, 1.5)
        \"\"\"Two numbers.\"\"\"

        def __post_init__(self):
            if self.length < 1:
                raise ValueError(f"length must be >= 1, not {self.length}")

    class Echo(Task):
        \"\"\"Say the word back.\"\"\"
        name = "echo"
        Config = EchoConfig

        def problems(self):
            return ["x" * self.config.length + str(i) for i in range(50)]

        def prompt(self, word):
            return word

        def score(self, word, completion):
            return float(completion == word)

        def demonstration(self, word):
            return word

    def helper():
        pass

    NOT_A_TASK = 3
    """


def test_a_task_class_is_named_by_file_module_or_built_in_name(tmp_path):
    path = write(tmp_path / "user_task.py", USER_TASK)
    cls = task_class(f"{path}:Echo")
    assert issubclass(cls, Task) and cls.task_name() == "echo"
    assert task_class(f"{path}:Echo") is cls  # imported once
    assert task_class("countdown") is Countdown is task_class("asyncrl.rl.tasks.countdown:Countdown")
    assert task_class(f"{os.path.join(ROOT, 'asyncrl', 'rl', 'tasks', 'countdown.py')}:Countdown") is Countdown
    task = load_task(TaskSpec(f"{path}:Echo", options={"length": 5}))
    assert task.config.length == 5 and task.splits(0, 100, 10).heldout[0].startswith("xxxxx")


@pytest.mark.parametrize(
    "body, ref, message",
    [
        (None, "{path}:Echo", "--task.name {path}:Echo: no such file {path}"),
        (
            "x = 1\nraise RuntimeError('no GPU here')\n",
            "{path}:Echo",
            "--task.name {path}:Echo: importing {path} raised RuntimeError: no GPU here ({path}:2)",
        ),
        (
            "import no_such_package_xyz\n",
            "{path}:Echo",
            "--task.name {path}:Echo: importing {path} raised ModuleNotFoundError: No module named "
            "'no_such_package_xyz' ({path}:1)",
        ),
        ("def broken(:\n", "{path}:Echo", "--task.name {path}:Echo: importing {path} raised SyntaxError: "),
        (USER_TASK, "{path}:Ecco", "--task.name {path}:Ecco: {path} has no 'Ecco'; it defines: Echo"),
        (
            USER_TASK,
            "{path}:helper",
            "--task.name {path}:helper: helper is a function, not a subclass of asyncrl.rl.tasks.Task",
        ),
        (USER_TASK, "{path}:EchoConfig", "--task.name {path}:EchoConfig: EchoConfig is a class, not a subclass of"),
        (
            USER_TASK,
            "no_such_module_xyz:Echo",
            "--task.name no_such_module_xyz:Echo: no module named no_such_module_xyz",
        ),
        (USER_TASK, "countdwn", "--task.name countdwn: give a built-in task (countdown), FILE.py:NAME or MODULE:NAME"),
    ],
)
def test_a_task_that_cannot_be_loaded_is_one_line(tmp_path, body, ref, message):
    path = tmp_path / "bad_task.py"
    if body is not None:
        write(path, body)
    with pytest.raises(TaskLoadError) as caught:
        task_class(ref.format(path=path))
    assert str(caught.value).startswith(message.format(path=path)) and "\n" not in str(caught.value)
    assert isinstance(caught.value, ConfigError)


def test_a_reward_that_is_not_a_function_is_one_line(tmp_path):
    path = write(tmp_path / "r.py", USER_TASK)
    data = rows_file(tmp_path / "rows.jsonl", 5)
    for name, what in (
        ("NOT_A_TASK", "NOT_A_TASK is a value of type int"),
        ("Echo", "Echo is a class"),
        ("nothing", "has no 'nothing'; it defines: helper"),
    ):
        with pytest.raises(TaskLoadError, match=rf"^--task.reward {path}:{name}: .*{what}"):
            load_task(TaskSpec("", data=data, reward=f"{path}:{name}"))


def test_options_that_do_not_fit_the_config_are_one_line(tmp_path):
    path = write(tmp_path / "user_task.py", USER_TASK)
    with pytest.raises(
        TaskLoadError,
        match=r"^--echo.colour: task echo has no such option; its options: length, "
        r"pair$",
    ):
        load_task(TaskSpec(f"{path}:Echo", options={"colour": 1}))
    with pytest.raises(
        TaskLoadError,
        match=r"^task echo: its options \(--echo.\*\) do not fit EchoConfig: "
        r"length must",
    ):
        load_task(TaskSpec(f"{path}:Echo", options={"length": 0}))
    with pytest.raises(TaskLoadError, match=r"^task countdown has no options|^--countdown.x: task countdown has no"):
        load_task(TaskSpec("countdown", options={"x": 1}))
    with pytest.raises(TaskLoadError, match=r"^--task.max_turns 3: task echo is single-turn"):
        load_task(TaskSpec(f"{path}:Echo", max_turns=3))


# --- the task section and the task's own section ---------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--task.name", "t.py:T", "--task.reward", "r.py:f", "--task.data", "d.jsonl"],
            r"^--task.name t.py:T and --task.reward r.py:f are two ways to give the task",
        ),
        (["--task.reward", "r.py:f"], r"^--task.reward r.py:f needs --task.data"),
        (["--task.data", "d.jsonl"], r"^--task.data d.jsonl needs --task.reward .* or --task.name"),
        (["--task.score_timeout_s", "0"], r"^--task.score_timeout_s 0: score_timeout_s must be a finite number > 0"),
        (["--task.max_failure_rate", "1.5"], r"^--task.max_failure_rate 1.5: max_failure_rate must be in \[0, 1\]"),
    ],
)
def test_the_task_section_refuses_what_cannot_be_a_task(overrides, message):
    with pytest.raises(ConfigError, match=message):
        parse_overrides(GRPOConfig(), overrides)


def test_the_tasks_options_are_a_section_named_after_it(tmp_path):
    config = parse_overrides(grpo_config_type(Countdown)(), ["--countdown.max_count", "5"])
    assert config.countdown.max_count == 5 and isinstance(config, GRPOConfig)
    assert config.task_spec() == TaskSpec(
        "countdown", options={"min_count": 3, "max_count": 5, "max_number": 99, "min_target": 1, "max_target": 100}
    )
    assert grpo_config_type(Countdown) is grpo_config_type(Countdown)
    text = help_text(config)
    assert "\n  --task.name ''\n" in text and "\n  --countdown.max_count 5\n      Most numbers" in text
    assert "\n  --run.steps 500\n      Optimiser steps" in text  # the inherited keys keep their docstrings
    echo = task_class(f"{write(tmp_path / 'user_task.py', USER_TASK)}:Echo")
    text = help_text(grpo_config_type(echo)())
    assert "\necho:\n  How long the words are.\n" in text
    assert text.endswith("\n  --echo.pair 0.5,1.5\n      Two numbers.")
    assert grpo_config_type(Rows) is GRPOConfig  # no Config, no section


def test_a_task_name_that_cannot_be_a_section_is_refused():
    @dataclass(frozen=True)
    class Options:
        x: int = 1

    for name, message in (("run", "is the run's own section --run.*"), ("my-task", "cannot name its options' section")):
        cls = type("T", (Task,), {"name": name, "Config": Options})
        with pytest.raises(ConfigError, match=message):
            grpo_config_type(cls)
    with pytest.raises(ConfigError, match="its Config must be a frozen dataclass"):
        grpo_config_type(type("T", (Task,), {"name": "t", "Config": dict}))


def test_the_task_spec_has_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = parse_overrides(
        GRPOConfig(),
        [
            "--task.data",
            "d.jsonl",
            "--task.reward",
            "r.py:f",
            "--task.heldout_data",
            "~/h.jsonl",
            "--task.max_turns",
            "2",
        ],
    )
    spec = config.task_spec()
    assert (spec.name, spec.data, spec.reward) == ("", str(tmp_path / "d.jsonl"), f"{tmp_path / 'r.py'}:f")
    assert spec.heldout_data == os.path.expanduser("~/h.jsonl") and spec.max_turns == 2 and spec.options == {}
    spec = parse_overrides(GRPOConfig(), ["--task.name", "sub/t.py:T"]).task_spec()
    assert spec.name == f"{tmp_path / 'sub' / 't.py'}:T"
    assert parse_overrides(GRPOConfig(), ["--task.name", "pkg.mod:T"]).task_spec().name == "pkg.mod:T"


def test_config_json_round_trips_with_the_tasks_section(tmp_path):
    from asyncrl.rl.driver import resumed_config
    from asyncrl.rl.launch import default_config

    path = write(tmp_path / "user_task.py", USER_TASK)
    argv = ["--task.name", f"{path}:Echo", "--echo.length", "7", "--run.steps", "3"]
    config = parse_overrides(default_config(argv, ""), argv)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config_to_dict(config)))
    resumed = resumed_config(default_config([], str(tmp_path / "run")), str(tmp_path / "run"))
    assert resumed == config and resumed.echo.length == 7 and resumed.task_spec().options["length"] == 7
    # A run of Countdown written before the task section existed (no "task" key) reads as Countdown.
    old = {"run": {"steps": 3}, "countdown": {"max_count": 5}}
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    resumed = resumed_config(default_config([], str(tmp_path / "old")), str(tmp_path / "old"))
    assert resumed.countdown.max_count == 5 and resumed.task_spec().name == "countdown"


# --- through `asyncrl launch examples/grpo.py` ------------------------------------------------------


def launch(cwd, *args: str):
    return launch_example("grpo.py", cwd, *args)


CASES = [
    (["--task.name", "missing.py:T"], "--task.name missing.py:T: no such file {tmp}/missing.py"),
    (
        ["--task.name", "raises.py:T"],
        "--task.name raises.py:T: importing {tmp}/raises.py raised ZeroDivisionError: "
        "division by zero ({tmp}/raises.py:2)",
    ),
    (
        ["--task.name", "user_task.py:Nope"],
        "--task.name user_task.py:Nope: {tmp}/user_task.py has no 'Nope'; it defines: Echo",
    ),
    (["--task.name", "user_task.py:helper"], "helper is a function, not a subclass of asyncrl.rl.tasks.Task"),
    (
        ["--task.data", "rows.jsonl", "--task.reward", "user_task.py:NOT_A_TASK"],
        "--task.reward user_task.py:NOT_A_TASK: NOT_A_TASK is a value of type int, not a function fn(row, completion)",
    ),
    (
        ["--task.data", "missing.jsonl", "--task.reward", "reward.py:reward", "--model_path", "{tmp}/ckpt"],
        "--task.data {tmp}/missing.jsonl: no such file",
    ),
    (
        ["--task.data", "malformed.jsonl", "--task.reward", "reward.py:reward", "--model_path", "{tmp}/ckpt"],
        "--task.data {tmp}/malformed.jsonl: line 2: not valid JSON (",
    ),
    (
        [
            "--task.data",
            "rows.jsonl",
            "--task.reward",
            "reward.py:reward",
            "--model_path",
            "{tmp}/ckpt",
            "--run.n_heldout",
            "20",
        ],
        "--run.n_heldout 20 holds out all 20 problems, leaving none to train on",
    ),
    (
        ["--task.data", "rows.jsonl", "--task.reward", "reward.py:reward", "--run.n_heldout", "5"],
        "gives no demonstration for its problems, and the embedded model (no --model_path) is warm-started on them",
    ),
    (["--task.name", "user_task.py:Echo", "--echo.length", "0"], "--echo.length 0: length must be >= 1, not 0"),
    (["--countdown.max_count", "9"], "--countdown.max_count 9: need 2 <= min_count <= max_count <= 6"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_task_is_one_line_and_exit_2_with_nothing_written(tmp_path, args, message):
    write(tmp_path / "user_task.py", USER_TASK)
    write(tmp_path / "raises.py", "import os\nx = 1 / 0\n")
    write(tmp_path / "reward.py", "def reward(row, completion):\n    return 0.0\n")
    rows_file(tmp_path / "rows.jsonl", 20)
    write(tmp_path / "malformed.jsonl", '{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "ckpt").mkdir()  # passes preflight's cheap checkpoint checks (never loaded here)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    before = tree(tmp_path)
    done = launch(tmp_path, *(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo.py: "), done.stderr
    assert message.format(tmp=tmp_path) in lines[0]
    assert tree(tmp_path) - {"__pycache__"} - {p for p in tree(tmp_path) if "__pycache__" in p} == before


def test_help_lists_the_task_keys_and_the_user_tasks_own_section(tmp_path):
    write(tmp_path / "user_task.py", textwrap.dedent(USER_TASK) + "\nprint('imported')\n")
    done = launch(tmp_path, "--task.name", "user_task.py:Echo", "--help")
    assert done.returncode == 0, done.stderr
    assert "\n  --task.reward ''\n" in done.stdout and "\n  --echo.length 3\n      Letters per word." in done.stdout
    assert done.stdout.count("imported") == 1
    done = launch(tmp_path, "--help")
    assert "\n  --countdown.max_count 4\n" in done.stdout and "--echo." not in done.stdout


def test_a_task_in_the_launched_script_is_that_scripts_own_class(tmp_path):
    """The task file is the script `asyncrl launch` runs: its module is reused, not imported twice."""
    script = write(
        tmp_path / "my_run.py",
        textwrap.dedent(USER_TASK)
        + textwrap.dedent("""
        print("script body ran")

        async def main():
            from asyncrl.rl.tasks import task_class
            print(task_class(__file__ + ":Echo") is Echo)
        """),
    )
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "script body ran\nTrue\n"), done.stderr
