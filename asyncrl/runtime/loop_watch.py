"""`LoopWatch`: says when an event loop is blocked for seconds, and by what.

Every wait in asyncrl is awaited on its process's event loop, so one synchronous call on that loop
(a blocking socket or store call, a thread join, a long computation) freezes every deadline, every
heartbeat and the status socket of the process at once, and silently: nothing that would notice
runs. So a thread of its own watches: it hands the loop a trivial callback every ``interval_s``,
and when one has not run within ``threshold_s`` it reads the loop thread's stack
(``sys._current_frames``) and says, once per blocking, where the loop is stuck: the callback the
loop is running (the task's coroutine, or the plain callback) and the frames from it down to the
call that blocks. When the loop runs again, one more line says for how long it was blocked.

The watch itself never touches the loop's state: it only schedules its callback
(``call_soon_threadsafe``) and reads two numbers that callback writes, so it works on asyncio's
loop and on uvloop alike, and costs one wake-up of a thread per ``interval_s``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable
from types import CodeType, FrameType


def _loop_dirs() -> tuple[str, ...]:
    """The directories of the loop's own code: asyncio's, and uvloop's where it is installed
    (found, not imported)."""
    spec = importlib.util.find_spec("uvloop")
    uvloop = (os.path.dirname(spec.origin) + os.sep,) if spec is not None and spec.origin else ()
    return (os.path.dirname(asyncio.__file__) + os.sep, *uvloop)


_LOOP_DIRS = _loop_dirs()
_LOOP_RUNNER = os.path.join("asyncrl", "runtime", "loop.py")
"""The loop's own frames (these and the runner's) come first on its thread's stack: the callback
it runs is the first frame after them."""
SHOWN_FRAMES = 6
"""How many frames of the blocked callback a report shows (the innermost ones, where it blocks)."""


class LoopWatch:
    """Watches the event loop of the thread that calls `start` (see the module docstring).
    ``log(line)`` is called from the watch's thread: it must be thread-safe (``print``, the run's
    log, ``logging`` are). ``name`` says whose loop it is in the lines ("the driver")."""

    def __init__(
        self, name: str, threshold_s: float, log: Callable[[str], None], interval_s: float | None = None
    ) -> None:
        if not threshold_s > 0:
            raise ValueError(f"{name}: the loop watch's threshold_s must be > 0, not {threshold_s!r}")
        self.name, self.threshold_s, self.log = name, threshold_s, log
        self.interval_s = interval_s if interval_s is not None else min(1.0, threshold_s / 4)
        self.blocked = 0
        """How many times the loop was found blocked for more than ``threshold_s``."""
        self.longest_s = 0.0
        """The longest blocking seen so far, in seconds (counted from when the watch asked)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ran_at = 0.0  # written by the loop (`_beat`), read by the watch's thread

    def start(self) -> LoopWatch:
        """Watch the running loop (call this on it). Idempotent."""
        if self._thread is None:
            self._loop = loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            name = f"asyncrl-loop-watch-{self.name}"
            self._thread = threading.Thread(target=self._watch, args=(loop,), name=name, daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching: the thread's wait is woken, so it ends at once, after saying that a
        blocking it reported is over (close is called on the loop, which runs again). Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + 1.0)

    def _beat(self) -> None:
        self._ran_at = time.monotonic()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        asked = 0.0  # when the beat not yet run was handed to the loop (0: none is waiting)
        where = ""  # the blocked callback, once reported
        while True:
            stopping = self._stop.wait(self.interval_s)
            if asked and self._ran_at >= asked:  # the loop ran the beat
                if where:
                    took = self._ran_at - asked
                    self.longest_s = max(self.longest_s, took)
                    self.log(f"the event loop of {self.name} ran again after {took:.1f} s blocked ({where})")
                asked, where = 0.0, ""
            if stopping:
                return
            now = time.monotonic()
            if not asked:
                try:
                    loop.call_soon_threadsafe(self._beat)
                except RuntimeError:  # the loop is closed: nothing left to watch
                    return
                asked = now
            elif not where and now - asked > self.threshold_s:
                self.blocked += 1
                where = describe_stack(sys._current_frames().get(self._loop_thread))
                self.log(
                    f"the event loop of {self.name} is blocked: no callback has run for {now - asked:.1f} s "
                    f"(every deadline, heartbeat and status request of this process waits for it); in {where}"
                )


def describe_stack(frame: FrameType | None) -> str:
    """``callback (file:line) > ... > innermost (file:line)``: the callback the loop is running,
    then the innermost `SHOWN_FRAMES` frames below it (the call that blocks is the last)."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first
    first = 0
    while first < len(frames) and not _machinery(frames[first]):
        first += 1
    while first < len(frames) and _machinery(frames[first]):
        first += 1
    own = frames[first:] or frames[-1:]
    if not own:
        return "an unknown place (the loop's thread has no Python frame)"
    shown = [own[0]] + own[1:][-SHOWN_FRAMES:]
    text = [f"{_code_name(f.f_code)} ({_short(f.f_code.co_filename)}:{f.f_lineno})" for f in shown]
    if len(own) - 1 > SHOWN_FRAMES:
        text.insert(1, "...")
    return " > ".join(text)


def _code_name(code: CodeType) -> str:
    """``Class.method`` where Python keeps it (3.11+: ``co_qualname``), else the bare name (3.10)."""
    return getattr(code, "co_qualname", code.co_name)


def _machinery(frame: FrameType) -> bool:
    name = frame.f_code.co_filename
    return name.startswith(_LOOP_DIRS) or name.endswith(_LOOP_RUNNER)


def _short(path: str) -> str:
    """The path from its package down (``asyncrl/rl/driver/grpo.py``, ``zmq/sugar/poll.py``)."""
    parts = path.split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1 :])
    if "asyncrl" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("asyncrl") :])
    return "/".join(parts[-2:])
