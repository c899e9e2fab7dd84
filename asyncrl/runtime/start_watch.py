"""The supervisor's judgement of one starting incarnation: is it making progress, or is it hung?

A start is not judged by one fixed deadline. It has ``start_timeout_s`` from the last thing the
actor reported (its spawn, then each ``StartPhase``); a phase with a budget gets
max(start_timeout_s, budget). Heartbeats, which the worker sends from its own thread from the
moment it has its ``Init``, say the process is alive, not that it progresses: they never move the
deadline, but their silence for ``heartbeat_timeout_s`` (a frozen or stopped process) fails the
start before the deadline would. The worker's ``Hello`` counts as its first beat: the thread
starts as soon as our ``Init`` answers it. ``Incarnations.start`` waits on ``changed`` and on the process's
exit, with ``seconds_left`` as its timeout, and asks ``verdict`` each time it wakes.
"""

from __future__ import annotations

import asyncio
import time

from asyncrl.runtime import wire

_HINT = "asyncrl launch --start_timeout_s (or Supervisor(start_timeout_s=...))"


class StartWatch:
    def __init__(self, actor: str, start_timeout_s: float, heartbeat_timeout_s: float) -> None:
        self.actor = actor
        self.start_timeout_s = start_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.began = self.phase_since = time.monotonic()
        self.deadline = self.began + start_timeout_s
        self.phase = ""
        self.budget_s = 0.0
        self.knob = ""
        self.last_beat: float | None = None  # None until the worker's Hello
        self.changed = asyncio.Event()

    def on_phase(self, msg: wire.StartPhase) -> None:
        now = time.monotonic()
        self.phase, self.budget_s, self.knob, self.phase_since = msg.phase, msg.budget_s, msg.knob, now
        self.deadline = now + max(self.start_timeout_s, msg.budget_s)
        self.last_beat = now  # a report is a sign of life as good as a beat
        self.changed.set()

    def on_beat(self) -> None:
        self.last_beat = time.monotonic()

    def seconds_left(self) -> float:
        """Until the next moment a verdict may change: the deadline, or the heartbeats' silence."""
        end = self.deadline
        if self.last_beat is not None:
            end = min(end, self.last_beat + self.heartbeat_timeout_s)
        return max(0.0, end - time.monotonic())

    def verdict(self) -> str | None:
        """Why the start has failed (one line, without the actor's name), or None while it may
        still succeed."""
        now = time.monotonic()
        if self.last_beat is not None and now - self.last_beat > self.heartbeat_timeout_s:
            doing = f" while {self.phase!r}" if self.phase else ""
            return (
                f"not ready: no heartbeat for {now - self.last_beat:.1f} s{doing} (frozen or stopped?), "
                f"{now - self.began:.0f} s after its start"
            )
        if now < self.deadline:
            return None
        if not self.phase:
            return (
                f"not ready within start_timeout_s={self.start_timeout_s:g} (no start phase reported); "
                f"raise it with {_HINT}"
            )
        took = now - self.phase_since
        if self.budget_s > self.start_timeout_s:
            knob = f"{self.knob} or {_HINT}" if self.knob else _HINT
            return (
                f"not ready: still {self.phase!r} after {took:.0f} s (its budget {self.budget_s:g} s); "
                f"raise it with {knob}"
            )
        return (
            f"not ready: still {self.phase!r} after {took:.0f} s (start_timeout_s={self.start_timeout_s:g}); "
            f"raise it with {_HINT}" + (f" or {self.knob}" if self.knob else "")
        )
