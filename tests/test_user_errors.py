"""Every user error of the main command is one line on stderr and exit status 2, found before
anything is spawned or written: the real `asyncrl launch examples/grpo_countdown.py` is run with
each bad input, in an empty directory that must still be empty afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncrl.rl import preflight
from asyncrl.rl.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "grpo_countdown.py")
pytestmark = pytest.mark.timeout(120)


def launch(cwd, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ASYNCRL_CACHE_DIR=str(cwd / "cache"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "launch", EXAMPLE, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def tree(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), path) for d, dirs, files in os.walk(path) for n in dirs + files}


def fake_checkpoint(path, max_positions: int = 64):
    """A directory that passes the cheap checks of a Hugging Face checkpoint (never loaded here)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": max_positions}))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


def a_run(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"run": {"steps": 3}}))
    (path / "metrics.jsonl").write_text("")
    return path


CASES = [
    (["--trainer.lrr", "1e-4"], "unknown config key --trainer.lrr; did you mean --trainer.lr?"),
    (["--trainer.lr", "abc"], "--trainer.lr abc: expected a number, e.g. --trainer.lr 0.0001"),
    (["--run.steps", "-5"], "--run.steps -5: steps must be >= 1, not -5"),
    (["--run.mode", "foo"], "--run.mode foo: mode must be 'async' or 'sync', not 'foo'"),
    (["steps=3"], "unexpected argument 'steps=3'; did you mean --run.steps 3 or --warm_start.steps 3?"),
    (["--run.max_staleness", "-1", "--run.steps", "20"], "--run.max_staleness -1: max_staleness must be >= 0, not -1"),
    (["--run.steps"], "--run.steps needs a value, e.g. --run.steps 500"),
    (["--resume"], "--resume needs a value: --resume RUN_DIR"),
    (["--resume", "runs/nonexistent"], "--resume runs/nonexistent: no such directory"),
    (["--resume", "{tmp}/empty"], "no config.json there, so not a run directory"),
    (["--model_path", "/nonexistent/path"], "--model_path /nonexistent/path: no such directory"),
    (["--model_path", "{tmp}/empty"], "no config.json there, so not a Hugging Face checkpoint directory"),
    (["--model", "/path"], "--model is a section (shape of the embedded default model), not a value: set its keys, "
                           "e.g. --model.hidden_size 128; a local Hugging Face checkpoint directory is given with "
                           "--model_path /path"),
    (["--sampler.max_new_tokens", "100000"], "--sampler.max_new_tokens 100000: the embedded model "
                                              "(--model.max_positions) has 128 positions"),
    (["--model_path", "{tmp}/ckpt", "--sampler.max_new_tokens", "100"], "has 64 positions for prompt and completion"),
    (["--run.run_dir", "/proc/asyncrl-run"], "--run.run_dir /proc/asyncrl-run: /proc is a kernel pseudo-filesystem"),
    (["--run.run_dir", "{tmp}/a-file"], "is a file, not a directory"),
    (["--run.run_dir", "{tmp}/a-file/run"], "cannot be made: {tmp}/a-file is a file"),
    (["--run.run_dir", "{tmp}/old"], "holds an earlier run that wrote no checkpoint (config.json, metrics.jsonl), so "
                                      "nothing to resume: remove that directory, or choose another --run.run_dir"),
    (["--run.data_seed", "3"], "could be among the warm start's training problems"),
    (["--run.check_weights", "true", "--sampler.backend", "vllm"], "--run.check_weights true needs samplers"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_bad_input_is_one_line_and_exit_2_with_nothing_left_on_disk(tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    fake_checkpoint(tmp_path / "ckpt")
    a_run(tmp_path / "old")
    before = tree(tmp_path)
    done = launch(tmp_path, *(a.format(tmp=tmp_path) for a in args))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo_countdown.py: "), done.stderr
    assert message.format(tmp=tmp_path) in lines[0]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert tree(tmp_path) == before  # no run directory, no runs/, no cache


def test_help_lists_the_keys_and_exits_0(tmp_path):
    done = launch(tmp_path, "--help")
    assert done.returncode == 0 and "--trainer.lr 0.0001" in done.stdout and "Exit status" in done.stdout
    assert tree(tmp_path) == set()


# --- the checks themselves, without a process ------------------------------------------------------


def _config(**run):
    from asyncrl.rl.config import parse_overrides
    from asyncrl.rl.grpo import GRPOConfig

    return parse_overrides(GRPOConfig(), [x for k, v in run.items() for x in (f"--run.{k}", str(v))])


def test_check_run_names_the_default_run_dir_and_makes_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = fake_checkpoint(tmp_path / "ckpt", max_positions=4096)
    from asyncrl.rl.config import parse_overrides

    checked = preflight.check_run(parse_overrides(_config(), ["--model_path", "ckpt"]))
    assert checked.model_path == str(ckpt) and checked.run.run_dir.startswith(str(tmp_path / "runs" / "grpo-"))
    assert os.listdir(tmp_path) == ["ckpt"]  # nothing created
    assert preflight.check_run(checked) == checked  # train() checks again: same answer


def test_a_directory_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    # A read-only directory cannot be made as root (who may write anyway): the probe is refused instead.
    monkeypatch.setattr(preflight.tempfile, "mkdtemp", refuse)
    with pytest.raises(ConfigError, match=r"--run.run_dir .*/run: cannot create it in .* \(Permission denied\)"):
        preflight.check_run(_config(run_dir=tmp_path / "run"))
    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match=r"--run.run_dir .*/run: cannot write in it \(Permission denied\)"):
        preflight.check_run(_config(run_dir=tmp_path / "run"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 directory")
def test_a_read_only_directory_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="cannot create it in"):
        preflight.check_run(_config(run_dir=tmp_path / "ro" / "run"))


def test_resume_needs_a_run_and_a_new_run_an_unused_directory(tmp_path):
    run = a_run(tmp_path / "run")
    assert preflight.check_run(_config(run_dir=run), resume=True).run.run_dir == str(run)
    with pytest.raises(ConfigError, match="wrote no checkpoint .*nothing to resume"):  # stopped before one
        preflight.check_run(_config(run_dir=run))
    (tmp_path / "ckpts" / "checkpoints" / "step-00000002").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds checkpoints of an earlier run: continue it with --resume"):
        preflight.check_run(_config(run_dir=tmp_path / "ckpts"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a run's config"):
        preflight.check_run(_config(run_dir=tmp_path / "other"), resume=True)
    assert preflight.check_run(_config(run_dir=tmp_path / "empty-to-be")).run.run_dir == str(tmp_path / "empty-to-be")


@pytest.mark.parametrize("files, message", [
    ({"config.json": "{not json"}, "cannot read its config.json"),
    ({"config.json": "{}"}, "names no model_type"),
    ({"config.json": '{"model_type": "qwen2"}'}, "no weights there"),
    ({"config.json": '{"model_type": "qwen2"}', "model.safetensors": ""}, "no tokenizer there"),
])
def test_a_model_path_that_is_not_a_checkpoint_is_refused(tmp_path, files, message):
    (tmp_path / "m").mkdir()
    for name, text in files.items():
        (tmp_path / "m" / name).write_text(text)
    from asyncrl.rl.config import parse_overrides

    with pytest.raises(ConfigError, match=message):
        preflight.check_run(parse_overrides(_config(run_dir=tmp_path / "run"), ["--model_path", str(tmp_path / "m")]))
