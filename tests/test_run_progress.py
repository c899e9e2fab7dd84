"""The run's progress (rl/driver/run_progress.py) as progress.json, ``asyncrl status`` and the
``progress_*`` metrics read it: the typed value's JSON has the keys, values and order the driver's
untyped dict had, for a driver with every part (a stall, a scaler, the pacer, an evaluation under
way, counts carried from a resumed segment) and for one with none; the real driver, pool, pacer and
queue, with scripted sampler handles (test_recovery_pool.py's)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import parse_overrides
from asyncrl.rl.driver import grpo
from asyncrl.rl.driver.build import Spawned, build_driver
from asyncrl.rl.driver.fleet.membership import MemberState
from asyncrl.rl.driver.run_progress import StartingProgress
from asyncrl.rl.driver.run_state import RunState
from asyncrl.rl.observe.eval_progress import EvalProgress
from test_recovery_pool import Scripted, rollout
from test_scaling_pool import PLACE, sampler, scaler_of

pytestmark = pytest.mark.timeout(60)

NOW, MONOTONIC = 1700000000.25, 500.0

# What the driver's progress was before it was typed, for the driver of the test below, key by key
# in order (`asyncrl status` prints them in it): written down from the untyped dict.
EVERY_PART = {
    "phase": "training",
    "step": 39,
    "steps": 500,
    "version": 39,
    "samples": 1234,
    "queue_depth": 3,
    "dropped_stale": 5,
    "uniform_skipped": 2,
    "heldout_before": {"greedy": 0.25, "sampled": 0.125},
    "elapsed_s": 112.5,
    "last_step_s": 1.235,
    "last_step_at": 1699999999.5,
    "checkpoint": "/x/checkpoints/step-00000038",
    "stalled": "no step for 10 s",
    "generation": -1,
    "sampler_losses": 2,
    "sampler_rejoins": 0,
    "rebuilds": 1,
    "samplers": {"sampler0": "in group", "sampler1": "lost"},
    "samplers_target": 1,
    "samplers_starting": ["sampler10", "sampler2"],
    "paced_in_flight": 3,
    "paced_streams": 1,
    "paced_wait_s": 2.346,
    "evaluating": {"version": 39, "on": "sampler0", "greedy": [0, 500], "sampled": [0, 500], "seconds": 7.5},
    "lengths": {"generated": {"32": 6}, "trained": {}, "dropped": {}},  # the 3 groups queued: 2 short completions each
    "updated_at": NOW,
}


def driver_of(tmp_path, monkeypatch, *args: str) -> grpo.GRPODriver:
    config = parse_overrides(GRPOConfig(), ["--run.groups_per_step", "16", "--run.run_dir", str(tmp_path), *args])
    spawned = Spawned(Scripted("trainer"), [sampler("sampler0"), sampler("sampler1")], [0, 1], PLACE)
    driver = build_driver(config, spawned, grpo.RunFiles(str(tmp_path)), lambda line: None)
    monkeypatch.setattr(grpo, "time", SimpleNamespace(time=lambda: NOW, monotonic=lambda: MONOTONIC))
    driver.segment_start = MONOTONIC - 100.0
    return driver


def written(driver: grpo.GRPODriver, tmp_path) -> dict:
    driver.write_progress()
    text = (tmp_path / "progress.json").read_text()
    assert text == json.dumps(driver.progress().to_dict(), indent=1)
    return json.loads(text)


async def test_the_progress_with_every_part_has_the_keys_values_and_order_it_always_had(tmp_path, monkeypatch):
    driver = driver_of(tmp_path, monkeypatch)
    driver.scaler = scaler_of(driver.pool, [], [], {})
    try:
        # A resumed segment's counts, 100 s into this one: the run's are the sums.
        driver.state = RunState(
            step=3,
            version=3,
            dropped_stale=5,
            uniform_skipped=2,
            train_s=12.5,
            faults={"sampler_losses": 2, "rebuilds": 1},
        )
        m = driver.pool.members[0]
        m.state, m.incarnation = MemberState.JOINED, 2
        driver.step_done = driver.version = 39
        driver.samples, driver.phase = 1234, grpo.Phase.TRAINING
        driver.heldout.before = {"greedy": 0.25, "sampled": 0.125}
        driver.last_step_s, driver.last_step_at = 1.23456, 1699999999.5
        driver.checkpoint_path = "/x/checkpoints/step-00000038"
        driver.stall.reason = "no step for 10 s"
        for i in range(3):
            assert await driver.queue.put(rollout(39, i), timeout_s=1.0)
        driver.scaler.request({"samplers": 1})
        driver.scaler.starting = {10: None, 2: None}  # names sorted as text
        under_way = EvalProgress(500, 4, 39, "sampler0", lambda line: None, clock=lambda: 10.0)
        under_way.began = 2.5
        driver.heldout.under_way = under_way
        assert driver.pacer is not None  # async mode
        driver.pacer.in_flight, driver.pacer.streams, driver.pacer.waited_s = 3, 1, 2.34567

        progress = driver.progress()
        assert list(progress.to_dict().items()) == list(EVERY_PART.items())
        assert list(written(driver, tmp_path).items()) == list(EVERY_PART.items())
        snapshot = driver.snapshot()
        assert list(snapshot)[-3:] == ["progress_updated_at", "progress_step", "progress_stalled"]
        assert snapshot["progress_sampler_losses"] == 2.0 and snapshot["progress_heldout_before/greedy"] == 0.25
        assert snapshot["progress_evaluating/seconds"] == 7.5 and "progress_evaluating/on" not in snapshot
        # The parts, typed: what the driver reads of them.
        assert progress.pool.faults == {"sampler_losses": 2, "sampler_rejoins": 0, "rebuilds": 1}
        assert driver.pool.progress().faults == {"sampler_losses": 0, "sampler_rejoins": 0, "rebuilds": 0}
        assert progress.scaling is not None and progress.scaling.samplers_starting == ["sampler10", "sampler2"]
        assert progress.evaluating is not None and progress.evaluating.greedy == [0, 500]
    finally:
        driver.scaler.starting = {}
        await driver.scaler.close()
        await driver.pool.close()


async def test_a_part_a_run_has_not_is_left_out_and_the_run_starting_has_two_keys(tmp_path, monkeypatch):
    driver = driver_of(tmp_path, monkeypatch, "--run.mode", "sync")
    try:
        assert driver.pacer is None and driver.scaler is None
        assert written(driver, tmp_path) == {
            "phase": "starting",
            "step": 0,
            "steps": 500,
            "version": 0,
            "samples": 0,
            "queue_depth": 0,
            "dropped_stale": 0,
            "uniform_skipped": 0,
            "heldout_before": {},
            "elapsed_s": 100.0,
            "last_step_s": 0.0,
            "last_step_at": 0.0,
            "checkpoint": "",
            "generation": -1,
            "sampler_losses": 0,
            "sampler_rejoins": 0,
            "rebuilds": 0,
            "samplers": {"sampler0": "lost", "sampler1": "lost"},
            "updated_at": NOW,
        }
    finally:
        await driver.pool.close()
    assert StartingProgress(steps=7).to_dict() == {"phase": "starting", "steps": 7}
