"""`CurvesPainter`: RUN_DIR/curves.png redrawn in the background while the run goes on.

The driver asks for a redraw at every evaluation and once at the end; drawing (matplotlib, a
second or so of CPU, several on loaded cores) runs in one daemon thread, so the driver's event loop
never waits on it. Requests that come while a drawing is under way are folded into one more
drawing. The end of the run awaits its last drawing (`close`): the thread tells the loop when it is
done, so the loop goes on meanwhile (the final policy is saved beside it) and the loop watch's
blocked-loop warning is left for real stalls. A drawing
reads only metrics.jsonl and progress.json, and is bounded in size (`curves.MAX_POINTS`). A
missing matplotlib is one line at the start, and the run goes on without a picture.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading

from asyncrl.errors import first_line

CURVES_FILE = "curves.png"
CLOSE_TIMEOUT_S = 30.0
"""How long the end of a run waits for its last drawing."""


class CurvesPainter:
    """Draws RUN_DIR/curves.png on request, in a thread (see the module docstring)."""

    def __init__(self, run_dir: str, log=print, enabled: bool = True):
        self.path = os.path.join(run_dir, CURVES_FILE)
        self.run_dir, self.log = run_dir, log
        self.enabled = enabled and importlib.util.find_spec("matplotlib") is not None
        if enabled and not self.enabled:
            log("curves: matplotlib is not installed (pip install matplotlib); no curves.png")
        self.drawn = False  # at least one drawing succeeded
        self._lock = threading.Lock()
        self._wanted = False
        self._thread: threading.Thread | None = None
        self._idle: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []  # `close`s awaiting the thread
        self._failed = False

    def refresh(self) -> None:
        """Redraw soon; returns at once."""
        if not self.enabled:
            return
        with self._lock:
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="asyncrl-curves", daemon=True)
                self._thread.start()

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> str:
        """Draw once more with everything written and await it (``timeout_s`` at most) without
        blocking the event loop; returns the picture's path, or "" when there is none."""
        self.refresh()
        loop = asyncio.get_running_loop()
        idle = loop.create_future()
        with self._lock:
            if self._thread is None:  # not enabled: nothing is drawing
                return self.path if self.drawn else ""
            self._idle.append((loop, idle))
        done, _ = await asyncio.wait({idle}, timeout=timeout_s)
        if not done:
            self.log(f"curves: still drawing after {timeout_s:g} s; {self.path} may lag the last steps")
        return self.path if self.drawn else ""

    def _work(self) -> None:
        from asyncrl.rl.view.curves import draw_curves

        while True:
            with self._lock:
                if not self._wanted:
                    self._thread, idle, self._idle = None, self._idle, []
                    for loop, future in idle:
                        _wake(loop, future)
                    return
                self._wanted = False
            try:
                draw_curves([self.run_dir], self.path)
                self.drawn = True
            except Exception as exc:  # a picture is never worth the run: say it once, go on
                if not self._failed:
                    self._failed = True
                    self.log(f"curves: drawing {self.path} failed: {type(exc).__name__}: {first_line(exc)}")


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _wake(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
    """Settle ``future`` on its loop, from the drawing thread; a loop already closed has no one waiting."""
    try:
        loop.call_soon_threadsafe(_settle, future)
    except RuntimeError:
        pass
