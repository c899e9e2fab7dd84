"""`ThrottledLog`: the first warning in full, then one summary per window, whatever the rate."""

from __future__ import annotations

import asyncio
import logging

from asyncrl.runtime.throttled_log import ThrottledLog
from virtual_time import run_virtual


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_flood_is_one_line_then_one_summary_per_window(caplog):
    clock = _Clock()
    throttled = ThrottledLog(
        logging.getLogger("test.throttled"), "actor a: refused", "a request", "requests", every_s=5.0, clock=clock
    )
    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        for i in range(1000):  # 1000 in 2 s
            clock.now += 0.002
            throttled.note(f"junk {i}")
        assert _lines(caplog) == ["actor a: refused a request: junk 0"]
        clock.now += 4.0
        throttled.note("junk 1000")  # past the window: the count so far in one line; a new window opens
        clock.now += 1.0
        throttled.note("junk 1001")
        assert _lines(caplog)[1:] == [
            "actor a: refused 999 more requests in the last 6 s (last: junk 999); 1000 in all"
        ]
        throttled.close()  # what was counted is said
        throttled.note("junk 1002")  # no window open: in full
        clock.now += 60.0
        throttled.note("junk 1003")  # its window closed without a summary: in full again
        assert _lines(caplog)[2:] == [
            "actor a: refused 2 more requests in the last 1 s (last: junk 1001); 1002 in all",
            "actor a: refused a request: junk 1002",
            "actor a: refused a request: junk 1003",
        ]
    assert throttled.total == 1004


def test_on_a_loop_the_summary_comes_when_the_flood_stops(caplog):
    """The window's timer, on a virtual clock (virtual_time.py): a wait of a minute takes none."""

    async def main() -> None:
        throttled = ThrottledLog(
            logging.getLogger("test.throttled"),
            "supervisor: dropped",
            "a message",
            "messages",
            every_s=5.0,
            clock=asyncio.get_running_loop().time,
        )
        for i in range(50):
            throttled.note(f"m{i}")
        assert len(caplog.records) == 1
        await asyncio.sleep(60.0)  # a timer ends the window (and the quiet next one): no further note is needed
        first, summary = _lines(caplog)
        assert first == "supervisor: dropped a message: m0"
        assert summary == "supervisor: dropped 49 more messages in the last 5 s (last: m49); 50 in all", summary
        throttled.note("late")
        throttled.close()  # what close() finds counted is said, and no timer is left
        assert len(caplog.records) == 3
        await asyncio.sleep(60.0)
        assert len(caplog.records) == 3

    with caplog.at_level(logging.WARNING, logger="test.throttled"):
        run_virtual(main())
