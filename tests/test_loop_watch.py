"""`LoopWatch` (runtime/loop_watch.py) on real event loops, asyncio's and uvloop (the driver's):
a callback that blocks the loop is named once, with the call it blocks in, and its end is said
with its length; a loop that stays busy but keeps running is not reported; the watch's thread
ends with it. The driver's use of it (``--run.loop_watch_s``) is checked in a real run by
test_elastic.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asyncrl.rl.config.grpo import GRPOConfig
from asyncrl.rl.config.parse import ConfigError, parse_overrides
from asyncrl.runtime.loop_watch import LoopWatch, _code_name

pytestmark = pytest.mark.timeout(60)

LOOPS = ["asyncio", "uvloop"]


def run_on(kind: str, coro):
    if kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run(coro)
    return asyncio.run(coro)


def blocks_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous socket or store call does to the loop


SLEEPS_AT = f"blocks_the_loop (tests/test_loop_watch.py:{blocks_the_loop.__code__.co_firstlineno + 1})"


def blocks_the_loop_until(said: threading.Event, after_s: float, took: list[float]) -> None:
    """Hold the loop (`blocks_the_loop`, a short sleep at a time) until the watch has said it is
    blocked, then ``after_s`` longer: several of the watch's intervals, in which it must not say it
    again. Appends how long the loop was held."""
    start = time.monotonic()
    while not said.is_set() and time.monotonic() - start < 10.0:
        blocks_the_loop(0.01)
    blocks_the_loop(after_s)
    took.append(time.monotonic() - start)


@pytest.mark.parametrize("kind", LOOPS)
def test_a_blocked_loop_is_named_once_with_the_call_and_its_end_with_its_length(kind):
    """Each blocking lasts until the watch (threshold 0.3 s, a look every 0.05 s) has said so, and
    0.15 s more (three looks): no fixed length to wait out, and its line's length is checked against the
    blocking's own, measured."""
    lines: list[str] = []
    said = [threading.Event() for _ in range(4)]
    held: list[float] = []

    def log(line: str) -> None:
        lines.append(line)
        if len(lines) <= len(said):  # a fifth line fails the count below
            said[len(lines) - 1].set()

    async def until(event: threading.Event) -> None:
        for _ in range(1000):  # the watch's thread sets it; at most 10 s
            if event.is_set():
                return
            await asyncio.sleep(0.01)

    async def main() -> LoopWatch:
        watch = LoopWatch("the test", 0.3, log, interval_s=0.05).start()
        await asyncio.sleep(0.1)
        blocks_the_loop_until(said[0], 0.15, held)  # from a task: the coroutine it runs is the callback
        await until(said[1])
        asyncio.get_running_loop().call_soon(blocks_the_loop_until, said[2], 0.15, held)  # a plain callback
        await asyncio.sleep(0)
        await until(said[3])
        watch.close()
        return watch

    watch = run_on(kind, main())
    assert len(lines) == 4, lines
    blocked, ran, blocked2, ran2 = lines
    assert blocked.startswith("the event loop of the test is blocked: no callback has run for "), blocked
    # the task's coroutine, then the frames down to the one that blocks
    assert " in test_a_blocked_loop_is_named_once_with_the_call_and_its_end_with_its_length.<locals>.main (" in blocked
    assert blocked.endswith(f" > {SLEEPS_AT}"), blocked
    assert blocked2.endswith(f" > {SLEEPS_AT}") and " in blocks_the_loop_until (" in blocked2, blocked2
    assert len(held) == 2 and all(0.45 <= s < 5.0 for s in held), held  # the threshold, then 0.15 s more
    for line, seconds in ((ran, held[0]), (ran2, held[1])):
        assert line.startswith("the event loop of the test ran again after "), line
        took = float(line.split(" after ")[1].split(" s ")[0])
        assert seconds - 0.2 <= took <= seconds + 1.0, line  # from when the watch asked, to when the loop answered
    assert watch.blocked == 2 and 0.3 <= watch.longest_s
    assert not [t for t in threading.enumerate() if t.name.startswith("asyncrl-loop-watch")]


@pytest.mark.parametrize("kind", LOOPS)
def test_a_busy_loop_that_keeps_running_is_not_reported(kind):
    lines: list[str] = []

    async def main() -> LoopWatch:
        watch = LoopWatch("the test", 0.6, lines.append, interval_s=0.05).start()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # 0.1 s of work at a time, far longer in all
            blocks_the_loop(0.1)
            await asyncio.sleep(0)
        watch.close()
        return watch

    watch = run_on(kind, main())
    assert lines == [] and watch.blocked == 0


def test_the_threshold_is_checked():
    with pytest.raises(ValueError, match="the loop watch's threshold_s must be > 0, not 0"):
        LoopWatch("the driver", 0, print)
    with pytest.raises(ConfigError, match="loop_watch_s must be a finite number of seconds >= 0"):
        parse_overrides(GRPOConfig(), ["--run.loop_watch_s", "-1"])
    assert parse_overrides(GRPOConfig(), ["--run.loop_watch_s", "0"]).run.observe.loop_watch_s == 0


def test_a_frame_is_named_on_python_3_10_too():
    """``co_qualname`` came in 3.11; on 3.10 (which asyncrl supports) the bare name is shown."""

    class Code310:  # a 3.10 code object: a name, no qualified name
        co_name = "step"

    class Code311(Code310):
        co_qualname = "Trainer.step"

    assert _code_name(Code310()) == "step"
    assert _code_name(Code311()) == "Trainer.step"
