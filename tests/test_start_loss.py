"""A sampler lost while it starts, in a real GRPO run (CPU, real processes, SIGKILL):

* killed as soon as its process exists, it is started again (within --run.sampler_max_restarts)
  and the run trains to the end with it;
* with no restarts, the run trains to the end with the sampler that came up, and says which one
  never did and why (the log, faults.jsonl, progress.json);
* with none up, the run stops while starting, in one line that says so.

The kill lands before the sampler is ready: it is sent the moment the supervisor shows the
sampler's process starting, and a sampler takes seconds to import torch and load its model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from asyncrl import Supervisor
from asyncrl.rl.driver.faults import NoSamplersError
from asyncrl.rl.driver.run import train
from test_fault_tolerance import check_whole, records, tiny

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("actor_zygote")]


async def kill_while_starting(sup, name: str, incarnation: int = 1, timeout_s: float = 120.0) -> float:
    """SIGKILL ``name``'s ``incarnation`` the moment its process exists, while it still starts;
    returns when (time.time())."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in sup.status():
            if s.name == name and s.state == "starting" and s.pid and s.incarnation == incarnation:
                os.kill(s.pid, signal.SIGKILL)
                return time.time()
        await asyncio.sleep(0.005)
    raise TimeoutError(f"{name} (incarnation {incarnation}) not seen starting within {timeout_s} s: {sup.status()}")


def events(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "faults.jsonl")) as f:
        return [json.loads(line) for line in f]


async def run_with_sampler0_killed(model_path: str, run_dir, restarts: int) -> tuple[dict, list[str], dict]:
    """A 6-step run of two samplers whose sampler0 is SIGKILLed while it starts; its summary, its
    log lines and each actor's (state, restarts) at the end."""
    config = tiny(
        model_path, run_dir, "--run.steps", "6", "--sampler.count", "2", "--run.sampler_max_restarts", str(restarts)
    )
    logs: list[str] = []
    async with Supervisor() as sup:
        killer = asyncio.ensure_future(kill_while_starting(sup, "sampler0"))
        summary = await train(config, sup, log=logs.append)
        await killer
        states = {s.name: (s.state, s.restarts) for s in sup.status()}
    print("\n".join(logs))
    return summary, logs, states


async def test_a_sampler_killed_while_it_starts_is_started_again_and_the_run_trains_with_it(model_path, tmp_path):
    run_dir = tmp_path / "run"
    summary, logs, restarts = await run_with_sampler0_killed(model_path, run_dir, 2)
    assert restarts["sampler0"] == ("running", 1) and restarts["sampler1"] == ("running", 0), restarts
    recs = check_whole(run_dir, 6, 4, digests=False)
    assert summary["steps"] == 6 and all(r["samplers_in_group"] == 2 for r in recs)
    assert "sampler0 came up after 1 lost start(s) (restarts 1/2 used, --run.sampler_max_restarts)" in logs, logs
    (retried,) = [e for e in events(run_dir) if e["event"] == "start_retried"]
    assert retried["sampler"] == "sampler0" and retried["restarts"] == 1, retried
    assert not [e for e in events(run_dir) if e["event"] in ("start_failed", "stopped")]


async def test_with_no_restarts_the_run_trains_with_the_sampler_that_came_up(model_path, tmp_path):
    run_dir = tmp_path / "run"
    summary, logs, _ = await run_with_sampler0_killed(model_path, run_dir, 0)
    recs = check_whole(run_dir, 6, 4, digests=False)
    assert all(r["samplers_in_group"] == 1 for r in recs)
    assert all(uid.startswith("sampler1/") for r in recs for uid in r["group_ids"])
    (line,) = [line for line in logs if "never came up" in line]
    assert line == (
        "sampler0 never came up (restarts 0/0, --run.sampler_max_restarts): process killed by SIGKILL "
        "during start; the run goes on with 1 of 2 sampler(s)"
    ), line
    (failed,) = [e for e in events(run_dir) if e["event"] == "start_failed"]
    assert failed["sampler"] == "sampler0" and failed["detail"] == "process killed by SIGKILL during start", failed
    progress = json.loads((run_dir / "progress.json").read_text())
    assert progress["phase"] == "finished" and progress["samplers"] == {"sampler0": "gone", "sampler1": "in group"}
    assert summary["steps"] == 6 and len(records(run_dir)) == 6


async def test_with_no_sampler_up_the_run_stops_in_one_line(model_path, tmp_path):
    run_dir = tmp_path / "run"
    config = tiny(model_path, run_dir, "--run.steps", "6", "--sampler.count", "1", "--run.sampler_max_restarts", "0")
    with pytest.raises(NoSamplersError) as info:
        async with Supervisor() as sup:
            killer = asyncio.ensure_future(kill_while_starting(sup, "sampler0"))
            try:
                await train(config, sup, log=lambda *a: None)
            finally:
                await killer
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(
        "run stopped while starting: no sampler came up (--run.sampler_max_restarts 0): "
        "sampler0: process killed by SIGKILL during start; "
    ), message
    (stopped,) = [e for e in events(run_dir) if e["event"] == "stopped"]
    assert stopped["cause"] == "NoSamplersError", stopped
