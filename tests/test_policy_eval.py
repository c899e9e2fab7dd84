"""``asyncrl eval POLICY``: a saved policy's held-out solve rates and task metrics, from the run's
own settings; on the CPU the greedy numbers are the ones the run's own evaluation logged for that
policy; on a vLLM engine (the CPU build here; skipped where vLLM is not installed, unless
``ASYNCRL_REQUIRE_VLLM=1``, see vllm_support); a path that holds no policy is one line and exit
status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_support import VLLM_ENV

pytest_plugins = ["vllm_support"]  # the vllm_required fixture; VLLM_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--run.steps",
    "2",
    "--run.groups_per_step",
    "2",
    "--sampler.group_size",
    "2",
    "--run.eval_every",
    "1",
    "--run.n_heldout",
    "16",
    "--run.n_train",
    "40",
    "--sampler.max_new_tokens",
    "24",
    "--run.eval_samples",
    "2",
    "--run.checkpoint_every",
    "2",
    "--sampler.backend",
    "hf",
    "--run.curves",
    "false",  # no curves.png: matplotlib's seconds at every run's end; test_observe.py draws it
]


def asyncrl(cwd, *args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": "1",
        "ASYNCRL_CACHE_DIR": str(cwd / "cache"),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_eval_of_a_saved_policy_gives_the_numbers_the_run_s_own_evaluation_logged(model_path, tmp_path):
    run_dir = tmp_path / "run"
    countdown = os.path.join(ROOT, "examples", "grpo_countdown.py")
    done = asyncrl(tmp_path, "launch", countdown, "--model_path", model_path, *TINY, "--run.run_dir", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "learning rate 1e-06 (--trainer.lr auto: a checkpoint's; docs/grpo.md)" in done.stdout
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and "heldout_solve_rate" in last

    evaluated = asyncrl(tmp_path, "eval", str(run_dir / "final"), "--out", "final.json")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((tmp_path / "final.json").read_text())
    # the run's task and evaluation settings, from its config.json (the script's temperature too)
    assert (result["task"], result["heldout_problems"], result["eval_samples"]) == ("countdown", 16, 2)
    assert (result["temperature"], result["engine"], result["device"]) == (0.7, "hf", "cpu")
    assert result["run_dir"] == str(run_dir) and set(result["heldout"]) == {"greedy", "sampled"}
    # the same numbers as the run's final evaluation of the same policy: the greedy solve rate and
    # the task's metrics of the greedy episodes (the sampled rate is a draw: from --seed here, from
    # the trainer's RNG there)
    assert result["heldout"]["greedy"] == last["heldout_solve_rate"]
    logged = {k: v for k, v in last.items() if k.startswith("heldout/")}
    assert result["heldout_task"] == logged and logged["heldout/task/well_formed"] > 0  # not all zeros
    assert f"held-out solve rate (16 problems): {result['heldout']['greedy']:.3f} greedy" in evaluated.stdout
    assert "asyncrl eval: greedy: 16/16 prompts" in evaluated.stderr  # the progress line

    # the checkpoint of the last step holds the same weights: the same numbers, the sampled one
    # too (the same --seed)
    again = asyncrl(tmp_path, "eval", str(run_dir / "checkpoints" / "step-00000002"), "--out", "ckpt.json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "ckpt.json").read_text())["heldout"] == result["heldout"]


def test_eval_of_a_path_without_a_policy_or_a_bad_flag_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"run": {"steps": 3}}')
    (tmp_path / "run" / "final").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("")
    lora = tmp_path / "step" / "model"
    lora.mkdir(parents=True)
    (lora / "adapter_config.json").write_text("{}")
    for args, line in [
        (["empty"], "asyncrl eval: empty holds no policy (no config.json, nor model/config.json); give RUN_DIR/final"),
        (["missing"], "asyncrl eval: missing: no such directory; give RUN_DIR/final"),
        (["file.txt"], "asyncrl eval: file.txt is a file, not a directory"),
        (["run"], "asyncrl eval: run is a run directory, not a policy: evaluate run/final"),
        (["step"], "asyncrl eval: step holds LoRA adapters only"),
        ([], "asyncrl eval: no POLICY given: asyncrl eval POLICY"),
        (["run/final", "--engine", "tpu"], "asyncrl eval: --engine tpu: expected one of auto, hf, vllm"),
        (["run/final", "--config", "nope.toml"], "asyncrl eval: --config nope.toml: no such file"),
        (["--run.n_heldout", "8", "empty"], "asyncrl eval: empty holds no policy"),  # POLICY after a flag
        (["run/final", "--out", "nowhere/x.json"], "asyncrl eval: --out nowhere/x.json: no such directory "),
    ]:
        done = asyncrl(tmp_path, "eval", *args, timeout=60)
        assert done.returncode == 2 and done.stderr.startswith(line), (args, done.stderr)
        assert done.stderr.count("\n") == 1 and not done.stdout, (args, done.stderr)


def test_an_engine_from_the_samplers_factory_evaluates_on_a_loop_of_its_own(model_path):
    # vLLM's path (an engine built by make_backend, driven on an event loop of its own on a
    # thread, closed at the end), run with the factory's HF backend where vLLM is not installed
    import threading

    import torch

    from asyncrl.rl.config import GRPOConfig, parse_overrides
    from asyncrl.rl.policy_eval.evaluation import PolicyGenerator, evaluate_policy
    from asyncrl.rl.sampler.factory import make_backend

    opened = []

    def engine(kind, policy, device, seed):
        generator = PolicyGenerator(make_engine=lambda: make_backend("hf", policy, device=device, seed=seed))
        opened.append(generator)
        return generator

    config = parse_overrides(GRPOConfig(model_path=model_path), ["--run.n_heldout", "8", "--run.eval_samples", "2"])
    lines = []
    result = evaluate_policy(model_path, config, device="cpu", log=lines.append, open_generator=engine)
    assert torch.device(result["device"]).type == "cpu" and result["heldout_problems"] == 8
    assert set(result["heldout"]) == {"greedy", "sampled"} and all(0 <= r <= 1 for r in result["heldout"].values())
    assert set(result["heldout_task"]) == {
        "heldout/task/has_answer",
        "heldout/task/hits_target",
        "heldout/task/uses_numbers",
        "heldout/task/well_formed",
    }
    assert "asyncrl eval: greedy: 8/8 prompts" in lines and "asyncrl eval: sampled: 8/8 prompts" in lines
    (generator,) = opened
    assert generator.backend._closed and generator.loop.is_closed() and not generator.thread.is_alive()
    assert "asyncrl-eval-engine" not in {t.name for t in threading.enumerate()}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_eval_on_a_vllm_engine(model_path, tmp_path, vllm_required):
    # a policy outside any run directory: the task and settings are the flags' (and the defaults)
    args = ["eval", model_path, "--run.n_heldout", "8", "--run.eval_samples", "2", "--device", vllm_required.type]
    # the vLLM tests' engine settings: its model worker in the engine core's process (one vLLM
    # import less than the CPU build's own executor: ~15 s of CPU), one OpenMP thread
    done = asyncrl(tmp_path, *args, "--engine", "vllm", "--out", "vllm.json", timeout=360, env=VLLM_ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert (result["engine"], result["run_dir"], result["heldout_problems"], result["temperature"]) == (
        "vllm",
        "",
        8,
        1.0,
    )
    assert set(result["heldout"]) == {"greedy", "sampled"} and all(0 <= r <= 1 for r in result["heldout"].values())
    assert set(result["heldout_task"]) == {
        f"heldout/task/{k}" for k in ("has_answer", "hits_target", "uses_numbers", "well_formed")
    }
    assert "asyncrl eval: greedy: 8/8 prompts" in done.stderr and "held-out solve rate (8 problems): " in done.stdout
