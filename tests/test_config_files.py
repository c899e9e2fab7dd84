"""Config files (``--config FILE``, ``--print_config``): the flags' tree in TOML, YAML or a run's
config.json; what --print_config writes reads back to the same run; flags win over files; every
mistake is the flags' one line, naming the file, the key and its line."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys

import pytest

from asyncrl.rl.config import ConfigError, grpo_config_type, parse_overrides
from asyncrl.rl.config.files import config_file_text, read_config_file
from asyncrl.rl.config.tree import fields_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(ROOT, "examples", "grpo_countdown.py")


def countdown_config(*flags: str):
    from asyncrl.rl.tasks.countdown import Countdown

    return parse_overrides(grpo_config_type(Countdown)(), list(flags))


def from_files(*paths, flags=()):
    from asyncrl.rl.tasks.countdown import Countdown

    return parse_overrides(grpo_config_type(Countdown)(), list(flags), [read_config_file(str(p)) for p in paths])


def leaf_count(config) -> int:
    return sum(leaf_count(v) if hasattr(v, "__dataclass_fields__") else 1 for _, v in fields_of(config))


def print_config(*argv: str) -> str:
    """What ``asyncrl launch examples/grpo_countdown.py ARGV --print_config`` writes, in this process
    (the script's main, with its defaults; nothing is spawned)."""
    import importlib.util

    from asyncrl.rl.launch import grpo_main

    spec = importlib.util.spec_from_file_location("grpo_countdown", COUNTDOWN)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert asyncio.run(grpo_main([*argv, "--print_config"], defaults=script.DEFAULTS)) == 0
    return out.getvalue()


def test_print_config_writes_every_key_and_reads_back_to_the_same_run(tmp_path):
    config = countdown_config(
        "--run.steps=7",
        "--run.sync_timeout_s",  # a flat sub-section's key: in [run], as in config.json
        "30",
        "--trainer.betas",  # a tuple
        "0.8,0.9",
        "--trainer.loss.tis_cap",  # a nested section's key that may be None
        "2",
        "--trainer.compile",
        "none",
        "--countdown.max_count",  # the task's own section
        "5",
        "--sampler.temperature",
        "0.7",
        "--task.max_turns",
        "0",
    )
    text = config_file_text(config, "a header")
    assert text.startswith("# a header\n") and "\n[run]\n" in text and "\n[trainer.loss]\n" in text
    assert '\ncompile = "none"\n' in text and "\nbetas = [0.8, 0.9]\n" in text and "\n[countdown]\n" in text
    assert "\nsync_timeout_s = 30.0\n" in text and "[run.deadlines]" not in text
    keys = [line for line in text.splitlines() if line and not line.startswith(("#", "["))]
    assert len(keys) == leaf_count(config)  # every key, defaults included
    (tmp_path / "run.toml").write_text(text)
    assert from_files(tmp_path / "run.toml") == config


def test_the_script_s_print_config_is_the_effective_run_and_config_reads_it_back(tmp_path):
    written = print_config("--run.steps", "7")
    assert "\ntemperature = 0.7\n" in written  # the script's own defaults are part of the run
    (tmp_path / "run.toml").write_text(written)
    assert print_config("--config", str(tmp_path / "run.toml")) == written
    again = print_config("--run.mode", "sync", "--config", str(tmp_path / "run.toml"), "--run.steps=9")
    assert "\nsteps = 9\n" in again and '\nmode = "sync"\n' in again  # flags win, before or after it


def test_a_run_s_config_json_is_a_config_file_too(tmp_path):
    from asyncrl.rl.config.stored import write_run_config

    config = countdown_config("--run.steps", "7", "--trainer.betas", "0.8,0.9", "--countdown.max_count", "5")
    write_run_config(config, str(tmp_path))
    assert from_files(tmp_path) == from_files(tmp_path / "config.json") == config  # the directory or the file
    assert from_files(tmp_path, flags=["--run.steps", "8"]).run.steps == 8


def test_yaml_and_layered_files(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "base.yaml").write_text("run:\n  steps: 7\n  mode: sync\ntrainer:\n  lr: 1e-5\n  betas: [0.8, 0.9]\n")
    (tmp_path / "more.toml").write_text("[run]\nsteps = 8\n")
    config = from_files(tmp_path / "base.yaml", tmp_path / "more.toml")
    # YAML reads 1e-5 as a string: it is read as the flag's text would be
    assert (config.run.steps, config.run.mode, config.trainer.lr, config.trainer.betas) == (8, "sync", 1e-5, (0.8, 0.9))


def test_a_file_and_a_flag_set_a_section_s_keys_together(tmp_path):
    # generate_timeout_s must stay below queue_timeout_s: one from the file, one from a flag
    (tmp_path / "run.toml").write_text("[run]\ngenerate_timeout_s = 2000.0\n")
    config = from_files(tmp_path / "run.toml", flags=["--run.queue_timeout_s", "3000"])
    assert (config.run.deadlines.generate_timeout_s, config.run.deadlines.queue_timeout_s) == (2000.0, 3000.0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[run]\nsteps = 3\nstepz = 4\n", r"^run\.toml:3: unknown key run\.stepz; did you mean run\.steps\?$"),
        ("steps = 3\n", r"^run\.toml:1: unknown key steps; did you mean run\.steps or warm_start\.steps\?$"),
        ("[trainr]\nlr = 1e-5\n", r"^run\.toml:1: unknown key trainr; did you mean trainer\?$"),
        ("[run]\nzzz = 1\n", r"^run\.toml:2: unknown key run\.zzz; RunConfig has: check_weights, checkpoint_every, "),
        ('[run]\nsteps = "seven"\n', r'^run\.toml:2: run\.steps = "seven": expected an integer, e\.g\. run\.steps'),
        ("[run]\nsteps = 7.5\n", r"^run\.toml:2: run\.steps = 7\.5: expected an integer, e\.g\. run\.steps = 500$"),
        ("[trainer]\nbetas = [0.9]\n", r"^run\.toml:2: trainer\.betas = \[0\.9\]: expected 2 comma-separated values"),
        ("[run.steps]\nx = 1\n", r"^run\.toml:1: run\.steps = a table: expected an integer"),
        ("run = 3\n", r"^run\.toml:1: run is a section, not a value: give its keys in a table \(\[run\] in TOML\)"),
        ("[run]\nsteps = 0\n", r"^run\.toml:2: run\.steps = 0: steps must be >= 1, not 0$"),
        ("[run]\nsteps == 3\n", r"^run\.toml:2:8: not valid TOML: "),
        ("[run]\nsteps = 3\n[run]\n", r"^run\.toml:3:\d+: not valid TOML: "),
    ],
)
def test_a_mistake_in_a_file_is_one_line_naming_the_file_the_key_and_its_line(tmp_path, monkeypatch, text, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        from_files("run.toml")
    assert "\n" not in str(caught.value)


def test_a_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^--config nope\.toml: no such file$"):
        read_config_file("nope.toml")
    (tmp_path / "run.ini").write_text("")
    with pytest.raises(ConfigError, match=r"^--config run\.ini: its suffix tells its format: \.toml, \.yaml"):
        read_config_file("run.ini")
    (tmp_path / "mem.toml").symlink_to("/proc/self/mem")  # opens, but no read of it succeeds (root included)
    with pytest.raises(ConfigError, match=r"^--config mem\.toml: cannot read it: Input/output error$"):
        read_config_file("mem.toml")
    (tmp_path / "latin.toml").write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"^--config latin\.toml: not UTF-8 text \(byte 0xe9 at offset 5\)$"):
        read_config_file("latin.toml")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^--config empty: a directory without config\.json"):
        read_config_file("empty")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"^list\.json: holds a list, not a table"):
        read_config_file("list.json")
    (tmp_path / "bad.json").write_text('{"run": {"steps": }}')
    with pytest.raises(ConfigError, match=r"^bad\.json:1:19: not valid JSON: Expecting value$"):
        read_config_file("bad.json")


def test_yaml_without_pyyaml_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    (tmp_path / "run.yaml").write_text("run:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"YAML needs PyYAML, which is not installed: pip install pyyaml") as caught:
        read_config_file(str(tmp_path / "run.yaml"))
    assert "\n" not in str(caught.value)


def test_a_yaml_mistake_names_its_line(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text("run:\n  steps: 3\n  sync_every: x\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: run\.sync_every = \"x\": expected an integer"):
        from_files(tmp_path / "run.yaml")
    (tmp_path / "run.yaml").write_text("run:\n  steps: [3\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3:1: not valid YAML: expected ',' or ']'"):
        from_files(tmp_path / "run.yaml")


ECHO_TASK = """\
from dataclasses import dataclass

from asyncrl.rl.tasks import Task


@dataclass(frozen=True, kw_only=True)
class EchoConfig:
    length: int = 3
    \"\"\"Letters per word.\"\"\"


class Echo(Task):
    name = "echo"
    Config = EchoConfig

    def problems(self):
        return ["x" * self.config.length + str(i) for i in range(2000)]

    def prompt(self, word):
        return word

    def score(self, word, completion):
        return float(completion == word)
"""


def test_the_file_names_the_task_and_sets_its_own_section(tmp_path):
    # [task] picks the config's type, so the file's [echo] is a section; a flag picks another task
    (tmp_path / "echo.py").write_text(ECHO_TASK)
    (tmp_path / "run.toml").write_text(f'[task]\nname = "{tmp_path / "echo.py"}:Echo"\n[echo]\nlength = 5\n')
    written = print_config("--config", str(tmp_path / "run.toml"))
    assert "\n[echo]\n# Letters per word.\nlength = 5\n" in written and "[countdown]" not in written
    (tmp_path / "again.toml").write_text(written)
    assert print_config("--config", str(tmp_path / "again.toml")) == written
    with pytest.raises(ConfigError, match=r"run\.toml:3: unknown key echo; GRPOConfig has: countdown, model, "):
        print_config("--config", str(tmp_path / "run.toml"), "--task.name", "countdown")


def test_the_example_config_is_the_readme_s_default_run():
    example = os.path.join(ROOT, "examples", "grpo_countdown.toml")
    assert print_config("--config", example) == print_config()


def test_the_gpu_example_config_is_the_gpu_learning_command_of_docs_gpu_md():
    example = os.path.join(ROOT, "examples", "grpo_countdown_gpu.toml")
    flags = (
        "--model.hidden_size 896 --model.num_layers 24 --model.num_heads 14 --model.num_kv_heads 2 "
        "--model.intermediate_size 4864 --warm_start.lr 3e-4 --sampler.backend vllm "
        "--trainer.lr 1.5e-5 --run.steps 900 --run.eval_every 50"
    )
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        assert " ".join(f.read().replace("\\\n", " ").split()).count(flags) == 1  # the command it stands for
    assert print_config("--config", example) == print_config(*flags.split())
    assert print_config("--config", example) != print_config()


@pytest.mark.e2e
def test_config_errors_through_asyncrl_launch_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "run.toml").write_text("[run]\nsteps = 3\nsteps_ = 4\n")
    (tmp_path / "syntax.toml").write_text("[run\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for args, line in [
        (["--config", "missing.toml"], "grpo_countdown.py: --config missing.toml: no such file"),
        (["--config", "syntax.toml"], "grpo_countdown.py: syntax.toml:1:5: not valid TOML: "),
        (["--config", "run.toml"], "grpo_countdown.py: run.toml:3: unknown key run.steps_; did you mean run.steps?"),
        (["--config"], "grpo_countdown.py: --config needs a value: --config FILE"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "asyncrl.cli", "launch", COUNTDOWN, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr
        assert not (tmp_path / "runs").exists()
    printed = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", COUNTDOWN, "--print-config", "--run.steps", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0 and "\nsteps = 3\n" in printed.stdout and not printed.stderr, printed.stderr
    assert not (tmp_path / "runs").exists()  # nothing was run, nothing written
