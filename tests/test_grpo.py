"""End-to-end smoke runs of examples/grpo_countdown.py through `asyncrl launch` (tiny model, CPU):
the run directory holds the config, one metrics record per step, the summary, the console's log,
and a final policy that plain `transformers` loads (and best/ when an evaluation beat the start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--run.steps",
    "3",
    "--run.groups_per_step",
    "2",
    "--sampler.group_size",
    "2",
    "--run.eval_every",
    "2",
    "--run.n_heldout",
    "8",
    "--run.n_train",
    "40",
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
    "--warm_start.steps",
    "3",
    "--warm_start.n_examples",
    "100",
    "--warm_start.eval_problems",
    "8",
    "--warm_start.heldout_reserve",
    "10",
    "--sampler.max_new_tokens",
    "12",
    "--run.eval_samples",
    "1",
    "--sampler.backend",
    "hf",
    "--run.curves",
    "false",  # no curves.png: matplotlib's seconds at every run's end; test_observe.py draws it
]  # the HF backend end to end everywhere; test_vllm_actor.py runs vLLM's


def check_sync_phases(r: dict) -> None:
    """A step's weight sync, split by phase (docs/observability.md): every key there, none
    negative, each side's phases within its own total, each side's total within the driver's."""
    from asyncrl.rl.observe.sync_metrics import SYNC_METRICS

    assert all(r[k] >= 0 for k in SYNC_METRICS), {k: r.get(k) for k in SYNC_METRICS}
    eps = 1e-6
    assert r["sync_trainer_pack_s"] + r["sync_trainer_transfer_s"] <= r["sync_trainer_s"] + eps, r
    assert r["sync_trainer_vote_s"] <= r["sync_trainer_s"] + eps, r
    for k in ("sync_sampler_pause_s", "sync_sampler_transfer_s", "sync_sampler_load_s", "sync_sampler_resume_s"):
        assert r[k] <= r["sync_sampler_s"] + eps, (k, r)
    assert max(r["sync_trainer_s"], r["sync_sampler_s"]) + r["sync_rpc_s"] <= r["sync_s"] + eps, r
    assert r["sync_trainer_s"] > 0 and r["sync_sampler_s"] > 0 and r["sync_bytes"] > 0, r


def launch(tmp_path, *args, cache: str | None = None):
    """The example through `asyncrl launch` in ``tmp_path``; its embedded model cached in ``cache``
    (conftest's ``model_cache``, shared by the session's runs), else in a cache of its own."""
    env = dict(os.environ, ASYNCRL_CACHE_DIR=cache or str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "launch", os.path.join(ROOT, "examples", "grpo_countdown.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_tiny_run_writes_metrics_and_a_loadable_checkpoint(tmp_path, mode, model_cache):
    run_dir = tmp_path / "run"
    # The async run also distils from a teacher and adds a generative judge's verdict to the reward
    # (random checkpoints with the embedded tokenizer, each served by a scorer actor), and its
    # sampler keeps two paced batches of half a step in flight (room for two steps ahead with
    # max_staleness 2): the same run, rather than runs of their own.
    extra = []
    if mode == "async":
        extra = ["--run.max_staleness", "2", "--sampler.prompts_per_batch", "1", "--sampler.streams", "2"]
        from sampler_support import write_tiny

        (tmp_path / "judge.txt").write_text("{prompt}{completion} ok?")
        extra += [
            "--teacher.model_path",
            write_tiny(str(tmp_path / "teacher"), hidden_size=32),
            "--trainer.loss.distill_coef",
            "1",
            "--reward_model.kind",
            "judge",
            "--reward_model.model_path",
            write_tiny(str(tmp_path / "judge"), hidden_size=32),
            "--reward_model.template",
            "judge.txt",
            "--reward_model.verdict_tokens",
            "y,n",
            "--reward_model.weight",
            "0.5",
        ]
    else:  # the sync run also sends deltas (issue 50), each checked against the trainer's digest
        extra = ["--run.sync_delta", "on", "--run.check_weights", "true"]
    done = launch(tmp_path, *TINY, "--run.mode", mode, "--run.run_dir", str(run_dir), *extra, cache=model_cache)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    if mode == "async":  # every group was scored by the teacher; none left out for equal rewards (they still teach)
        assert all("distill_kl" in r and r["uniform_skipped"] == 0 for r in records), records
        # Both batches in flight at once, and with one sampler and no losses every group trained
        # (driver/pacing.py's invariant).
        assert "1 prompts x 2 completions at once, 2 paced batches in flight (--sampler.streams)" in done.stdout
        assert max(r["paced_streams"] for r in records) == 2, records
        assert all(r["paced_in_flight_peak"] <= 2 for r in records), records  # two batches of one group
        assert not any(r["dropped_stale"] for r in records), records
        assert f"; teacher {tmp_path / 'teacher'}; reward model {tmp_path / 'judge'}" in done.stdout
        # every completion trained on was judged (p(y) against p(n): nothing to parse)
        assert sum(r["judged"] for r in records) >= 3 * 2 * 2 and not any(r["judge_unparsed"] for r in records)
    for r in records:
        for key in (
            "reward_mean",
            "train_solve_rate",
            "staleness_hist",
            "dropped_stale",
            "loss",
            "grad_norm",
            "wait_s",
            "train_s",
            "sync_s",
            "samples_per_s",
            "queue_depth",
            "entropy",
            "lr",
            "uniform_skipped",
        ):
            assert key in r, key
        if mode == "sync":
            assert r["staleness_hist"] == {"0": 2}
            # a delta after the group's first (full) sync: fewer bytes or changes measured (a
            # batch of uniform groups changes nothing: the count alone goes); a full one would
            # send at least sync_bytes and measure nothing
            assert r["sync_sent_bytes"] < r["sync_bytes"] or r["sync_changed"] > 0, r
        check_sync_phases(r)
    assert "heldout_solve_rate" in records[1] and "heldout_sampled_solve_rate" in records[2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == mode and summary["steps"] == 3
    # Groups of 2 from a barely trained model: many score the same and are left out, each counted
    # once (async samplers may leave out more after the last step's record). A sync run is
    # repeatable, and its left-out groups are a fixed, non-zero count.
    skipped = sum(r["uniform_skipped"] for r in records)
    assert skipped <= summary["uniform_skipped"]
    if mode == "sync":
        assert 0 < skipped == summary["uniform_skipped"]
    assert set(summary["heldout_before"]) == set(summary["heldout_after"]) == {"greedy", "sampled"}
    assert json.loads((run_dir / "config.json").read_text())["run"]["mode"] == mode

    # The summary: a heading, before -> after with the change, and where the results are.
    assert "GRPO finished: 3 steps in " in done.stdout
    assert done.stdout.count("held-out solve rate before GRPO (8 problems): ") == 1  # one number, one problem set
    for kind in ("greedy", "sampled"):
        before, after = summary["heldout_before"][kind], summary["heldout_after"][kind]
        change = f"{before:.3f} -> {after:.3f}  ({100 * (after - before):+.1f} points)"
        assert any(
            line.split()[:2] == ["held-out", kind] and line.endswith(change) for line in done.stdout.splitlines()
        )
    assert summary["final"] == str(run_dir / "final") and summary["metrics"] == str(run_dir / "metrics.jsonl")
    evals = [r["heldout_solve_rate"] for r in records if "heldout_solve_rate" in r]
    if max(evals) > summary["heldout_before"]["greedy"]:  # best/: the first evaluation that beat all before it
        best = json.loads((run_dir / "best" / "best.json").read_text())
        assert summary["best"]["step"] == best["step"] and best["heldout"]["greedy"] == max(evals)
    else:
        assert summary["best"] is None and not (run_dir / "best").exists() and "the starting one" in done.stdout
    log_txt = (run_dir / "log.txt").read_text()  # the console, kept: the driver's lines, the actors', the summary
    assert "held-out solve rate before GRPO" in log_txt and "[sampler0]: " in log_txt and "GRPO finished" in log_txt

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(summary["checkpoint"], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(summary["checkpoint"], local_files_only=True)
    assert model.config.hidden_size == 32 and tokenizer("12+3")["input_ids"]


def test_help_lists_every_key_and_a_bad_key_is_a_clear_error(tmp_path):
    done = launch(tmp_path, "--help")
    assert done.returncode == 0
    assert "--trainer.lr 0.0" in done.stdout and "AdamW's peak learning rate. 0 (auto)" in done.stdout
    assert "--run.max_staleness 1" in done.stdout and "--trainer.loss.eps_high 0.28" in done.stdout
    assert "--sampler.temperature 0.7" in done.stdout  # the example's own default (DEFAULTS), not the config's 1.0
    done = launch(tmp_path, "--trainer.lrr", "1")
    assert done.returncode != 0 and "unknown config key --trainer.lrr" in done.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--run.data_seed", "3"], "could be among the warm start's training problems"),
        (["--run.n_heldout", "1001"], "beyond it were trained on in the warm start"),
    ],
)
def test_a_heldout_set_the_warm_start_may_have_seen_is_refused(overrides, message):
    from asyncrl.rl.config.grpo import GRPOConfig, check_heldout_unseen
    from asyncrl.rl.config.parse import ConfigError, parse_overrides

    check_heldout_unseen(GRPOConfig())  # the defaults are fine
    with pytest.raises(ConfigError, match=message):
        check_heldout_unseen(parse_overrides(GRPOConfig(), overrides))


@pytest.mark.parametrize("seed", [0, 3])
def test_the_driver_s_heldout_split_is_train_and_heldout_s_whatever_n_train(seed):
    """The driver draws only the held-out split (`heldout_split`); the samplers draw the train split
    with `train_and_heldout`. Both must see the same held-out problems, or the train split could
    hold a problem the run is scored on."""
    from asyncrl.rl.config.task import CountdownConfig
    from asyncrl.rl.tasks.countdown import heldout_split, train_and_heldout

    for config in (CountdownConfig(), CountdownConfig(min_count=3, max_count=3, max_number=20)):
        heldout = heldout_split(seed, 60, config)
        assert len(heldout) == 60
        for n_train in (1, 40, 500):
            assert train_and_heldout(seed, n_train, 60, config)[1] == heldout, n_train


def test_the_default_run_s_heldout_split_is_the_one_it_had():
    from asyncrl.rl.config.run import DataConfig
    from asyncrl.rl.tasks.countdown import heldout_split, train_and_heldout

    data = DataConfig()
    heldout = heldout_split(data.data_seed, data.n_heldout)
    assert heldout == train_and_heldout(data.data_seed, data.n_train, data.n_heldout)[1]


def test_a_batchs_task_metrics_are_means_per_completion_and_errors_are_counts():
    from asyncrl.rl.driver.step_record import task_metrics
    from asyncrl.rl.rollout import RolloutGroup

    def g(metrics, n=2):
        return RolloutGroup(0, [1], [[2]] * n, [[-0.1]] * n, [0.0] * n, version=0, metrics=metrics)

    batch = [g({"task/hits": 2.0, "task_errors/timeout": 1.0}), g({"task/hits": 1.0}, n=4)]
    assert task_metrics(batch) == {"task/hits": 0.5, "task_errors/timeout": 1.0}
    assert task_metrics([g({})]) == {}
    seen: set[str] = set()  # a run's: a key of an earlier step is 0 in a step without it, not missing
    assert task_metrics(batch, seen) == {"task/hits": 0.5, "task_errors/timeout": 1.0}
    assert task_metrics([g({"task/other": 1.0})], seen) == {
        "task/hits": 0.0,
        "task/other": 0.5,
        "task_errors/timeout": 0.0,
    }
