"""`EvalProgress`: a held-out evaluation on its way, said on the console.

An evaluation of 500 problems, greedy and 4 samples each, at 256 tokens takes minutes on a large
policy, between two steps, where no step line comes and the stall watch does not judge. So while
one runs, a line every `LINE_S` seconds says how far it has got (problems solved of the total in
each pass, and how many a second), and one line when it ends says how long it took and where it
ran: the console of a run is never quiet for longer than a step's stall window (``--run.stall_floor_s``,
120 s by default) because of an evaluation. Parts count as they arrive (from the samplers'
streams); the trainer's own count is asked for before each line (``poll``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from asyncrl.rl.model.tally import HeldoutPart
from asyncrl.runtime.timeouts import timeout

LINE_S = 30.0
"""Seconds between two progress lines of an evaluation under way."""


class EvalSoFar(msgspec.Struct, kw_only=True, frozen=True):
    """How far an evaluation under way has got (`EvalProgress.progress`): ``evaluating`` in
    progress.json and ``asyncrl status``, the field names its keys."""

    version: int
    """The weights evaluated."""
    on: str
    """Who solves the problems: "the trainer", "sampler0, sampler1"."""
    greedy: list[int]
    """Problems solved greedily and the total."""
    sampled: list[int]
    """Problems solved with samples and the total (0 and 0 without ``--run.eval_samples``)."""
    seconds: float
    """Since it began (to the tenth)."""

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class EvalProgress:
    """How far the evaluation of ``version`` on ``problems`` held-out problems (greedy, and with
    ``samples`` sampled too) has got; ``where`` names who solves them ("the trainer", "sampler0,
    sampler1"). For one event loop."""

    def __init__(
        self,
        problems: int,
        samples: int,
        version: int,
        where: str,
        log: Callable[[str], None],
        *,
        interval_s: float = LINE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.totals = (problems, problems if samples else 0)
        self.samples, self.version, self.where = samples, version, where
        self.log, self.interval_s, self.clock = log, interval_s, clock
        self.done = [0, 0]  # greedy, sampled: the parts that arrived
        self.polled = [0, 0]  # the trainer's count of the call under way (not in done yet)
        self.poll: Callable[[], Awaitable[list[int]]] | None = None
        """While the trainer solves: asks it for its count (greedy, sampled) before each line."""
        self.began = clock()
        self._ended = asyncio.Event()

    def add(self, part: HeldoutPart) -> None:
        """A part arrived: its problems are solved."""
        self.done[part.sampled] += len(part.problems)

    def solved(self) -> tuple[int, int]:
        return self.done[0] + self.polled[0], self.done[1] + self.polled[1]

    def seconds(self) -> float:
        return self.clock() - self.began

    def line(self) -> str:
        """``held-out evaluation of v100 on sampler0, sampler1: greedy 500/500, sampled 120/500
        problems, 15.6 a second, 40 s``."""
        (greedy, sampled), (g_total, s_total) = self.solved(), self.totals
        passes = f"greedy {greedy}/{g_total}" + (f", sampled {sampled}/{s_total}" if s_total else "")
        seconds = self.seconds()
        rate = (greedy + sampled) / seconds if seconds > 0 else 0.0
        return (
            f"held-out evaluation of v{self.version} on {self.where}: {passes} problems, "
            f"{rate:.1f} a second, {seconds:.0f} s"
        )

    def end_line(self) -> str:
        """``held-out evaluation of v100: 500 problems greedy and 500 x 4 sampled in 32.1 s on
        sampler0, sampler1``."""
        g_total, s_total = self.totals
        sampled = f" and {s_total} x {self.samples} sampled" if s_total else ""
        return (
            f"held-out evaluation of v{self.version}: {g_total} problems greedy{sampled} "
            f"in {self.seconds():.1f} s on {self.where}"
        )

    def progress(self) -> EvalSoFar:
        """For progress.json and ``asyncrl status`` while it runs."""
        (greedy, sampled), (g_total, s_total) = self.solved(), self.totals
        return EvalSoFar(
            version=self.version,
            on=self.where,
            greedy=[greedy, g_total],
            sampled=[sampled, s_total],
            seconds=round(self.seconds(), 1),
        )

    async def tick(self) -> None:
        """One progress line, the trainer's count asked for first (`poll`, where set; a failed
        ask leaves what was known)."""
        if self.poll is not None:
            try:
                got = await self.poll()
                self.polled = [int(got[0]), int(got[1])]
            except Exception:  # the ask's own deadline bounds it; the line says what is known
                pass
        self.log(self.line())

    async def run(self) -> None:
        """A line every ``interval_s`` until `end` (or a cancel)."""
        while not self._ended.is_set():
            try:
                async with timeout(self.interval_s):
                    await self._ended.wait()
            except (asyncio.TimeoutError, TimeoutError):
                await self.tick()

    def end(self) -> None:
        """Stop the lines (`run` returns)."""
        self._ended.set()

    def trainer_done(self, parts: list[HeldoutPart]) -> None:
        """The trainer's call returned ``parts``: counted, and its polled count dropped."""
        self.poll, self.polled = None, [0, 0]
        for part in parts:
            self.add(part)
