"""A run that makes no step for much longer than its recent steps took says so (rl/observe/stall.py):
the `StallWatch` on its own (a real event loop and clock, short limits), then the driver's line
with the real pool, pacer and queue (scripted sampler handles, as in test_recovery_pool.py), shown
by a real `asyncrl status` and a real /healthz, and cleared when the step ends."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import ConfigError, parse_overrides
from asyncrl.rl.driver.build import Spawned, build_driver
from asyncrl.rl.driver.fleet.membership import MemberState
from asyncrl.rl.driver.fleet.sync_group import SyncPlace
from asyncrl.rl.driver.grpo import RunFiles, Wait
from asyncrl.rl.observe.endpoint import MetricsEndpoint
from asyncrl.rl.observe.stall import StallWatch
from asyncrl.runtime.status import StatusServer
from test_observe import get
from test_recovery_pool import Scripted, answering, rollout
from test_status import status_cli

pytestmark = pytest.mark.timeout(60)


async def until(predicate, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


class Described:
    """A `describe` for the watch: counts its calls, answers a line naming the wait."""

    def __init__(self):
        self.calls: list[float] = []

    async def __call__(self, waited_s: float, limit_s: float) -> str:
        self.calls.append(waited_s)
        return f"waited {waited_s:.2f} s of {limit_s:.2f} s"


async def steps(watch: StallWatch, n: int, seconds: float) -> None:
    for _ in range(n):
        watch.step_began()
        await asyncio.sleep(seconds)
        watch.step_ended(seconds)


def test_the_limit_is_the_factor_times_the_median_or_the_floor_and_bad_settings_are_refused():
    watch = StallWatch(10, 60, describe=Described())
    assert watch.limit_s() is None  # no step yet: nothing to compare with
    for s in (5.0, 6.0, 400.0):  # one step with an evaluation in it does not move the median
        watch.recent.append(s)
    assert watch.limit_s() == 60.0 and watch.typical_s() == 6.0
    watch.recent.extend([7.0, 8.0])
    assert watch.limit_s() == 70.0
    with pytest.raises(ConfigError, match="stall_factor and stall_floor_s must be finite numbers >= 0"):
        parse_overrides(GRPOConfig(), ["--run.stall_factor", "-1"])
    assert parse_overrides(GRPOConfig(), ["--run.stall_factor", "0"]).run.observe.stall_factor == 0  # off


async def test_a_stall_is_said_as_the_wait_doubles_and_cleared_when_the_step_ends():
    logs: list[str] = []
    described = Described()
    watch = StallWatch(3, 0.3, describe=described, log=logs.append)
    task = asyncio.ensure_future(watch.run())
    try:
        watch.step_began()  # the first step: no recent steps, never judged
        await asyncio.sleep(0.6)
        watch.step_ended(0.6)
        assert not described.calls and not logs
        await steps(watch, 3, 0.02)
        watch.step_began()  # and this one never ends
        await until(lambda: watch.reason, what="the first report")
        assert logs == [f"stalled: {watch.reason}"] and 0.3 <= described.calls[0] < 3.0, (logs, described.calls)
        await until(lambda: len(logs) == 3, what="two more reports, at twice and four times the wait")
        first, second, third = described.calls
        assert second >= 2 * first and third >= 2 * second, described.calls
        watch.step_ended(watch.waited_s())
        assert watch.reason == "" and re.fullmatch(r"steps resume: the stalled step ended after \d+ s", logs[-1]), logs
        await asyncio.sleep(0.4)
        assert len(described.calls) == 3  # no step under way: nothing more is said
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_wait_for_a_restart_is_not_a_stall_and_the_clock_starts_over_after_it():
    settled: list[float | None] = [0.0]
    described = Described()
    watch = StallWatch(3, 0.3, describe=described, settled_at=lambda: settled[0], log=lambda line: None)
    task = asyncio.ensure_future(watch.run())
    try:
        await steps(watch, 3, 0.02)
        watch.step_began()
        settled[0] = None  # a sampler is lost: its restart is awaited
        await asyncio.sleep(1.0)
        assert not described.calls and not watch.reason
        settled[0] = back = time.monotonic()  # it rejoined
        await until(lambda: watch.reason, what="a report once the restart is over")
        assert time.monotonic() - back >= 0.3  # a whole limit after the group was whole again
        assert described.calls[0] >= 1.3  # the line says how long the step has waited in all
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_step_that_ends_while_its_wait_is_described_is_no_stall():
    watch: StallWatch

    async def slow(waited_s: float, limit_s: float) -> str:
        watch.step_ended(waited_s)  # the batch came while the samplers were being asked
        return "too late"

    logs: list[str] = []
    watch = StallWatch(3, 0.2, describe=slow, log=logs.append)
    task = asyncio.ensure_future(watch.run())
    try:
        await steps(watch, 2, 0.02)
        watch.step_began()
        await until(lambda: len(watch.recent) == 3, what="the step ended by describe")
        await asyncio.sleep(0.1)
        assert watch.reason == "" and logs == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_driver_names_the_wait_in_its_log_in_asyncrl_status_and_as_a_503_from_healthz(tmp_path):
    # Issue 30's state: step 40 waits for its batch, 14 of 16 groups queued, the one sampler in
    # the group and idle, nothing paced in flight. The real driver, pool, pacer and queue.
    config = parse_overrides(
        GRPOConfig(),
        [
            "--run.groups_per_step",
            "16",
            "--run.stall_factor",
            "3",
            "--run.stall_floor_s",
            "1",
            "--run.run_dir",
            str(tmp_path),
        ],
    )
    sampler = Scripted("sampler0", stats=[(0.0, answering(groups=8))])
    logs: list[str] = []
    driver = build_driver(
        config,
        Spawned(Scripted("trainer"), [sampler], [0], SyncPlace("127.0.0.1", "gloo")),
        RunFiles(str(tmp_path)),
        logs.append,
    )
    m = driver.pool.members[0]
    m.state, m.incarnation = MemberState.JOINED, 2
    driver.step_done = driver.version = 39
    for i in range(14):
        assert await driver.queue.put(rollout(39, i), timeout_s=1.0)
    server = StatusServer(
        str(tmp_path), actors=lambda: [], nodes=lambda: [], progress=lambda: driver.progress().to_dict()
    )
    server.start()
    endpoint = MetricsEndpoint(
        "127.0.0.1",
        0,
        statuses=lambda: [],
        probes=lambda: {},
        snapshot=driver.snapshot,
        timeout_s=2.0,
        loop=asyncio.get_running_loop(),
        stalled=lambda: driver.stall.reason,
    )
    base = f"http://127.0.0.1:{endpoint.port}"
    task = asyncio.ensure_future(driver.stall.run())
    try:
        await steps(driver.stall, 3, 0.05)
        code, _, body = await asyncio.to_thread(get, base + "/healthz")
        assert code == 200 and "stalled" not in json.loads(body)  # steps come
        driver.stall.step_began()
        driver.waiting = Wait.BATCH
        await until(lambda: driver.stall.reason, what="the stall")
        reason = driver.stall.reason
        line = (
            r"no step for (\d+) s \(recent steps took 0\.\d s; a stall after 1 s\): step 40 waits for "
            r"2 of 16 groups \(14 queued\); sampler0 in group, generating 0; paced in flight 0"
        )
        assert re.fullmatch(line, reason), reason
        assert f"stalled: {reason}" in logs

        code, out, err = await status_cli(str(tmp_path))  # the line is said again as the wait doubles
        assert code == 0, err
        assert any(re.fullmatch(r"  stalled +" + line, row) for row in out.splitlines()), out
        code, _, body = await asyncio.to_thread(get, base + "/healthz")
        report = json.loads(body)
        assert code == 503 and re.fullmatch(line, report["stalled"]), report
        assert report["unhealthy"] == {"driver": f"stalled: {report['stalled']}"}
        _, _, text = await asyncio.to_thread(get, base + "/metrics")
        assert "asyncrl_progress_stalled 1.0" in text

        driver.stall.step_ended(driver.stall.waited_s())  # the batch came
        code, _, body = await asyncio.to_thread(get, base + "/healthz")
        assert code == 200 and json.loads(body)["healthy"] is True
        assert "stalled" not in driver.progress().to_dict() and logs[-1].startswith("steps resume")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        endpoint.close()
        server.close()
        await driver.pool.close()
