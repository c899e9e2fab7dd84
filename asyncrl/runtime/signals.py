"""SIGINT/SIGTERM as cancellation: the innermost registered task is cancelled, so ``finally``
blocks and ``async with Supervisor()`` shut everything down in order. One handler per loop is
installed while any task is registered (the launcher's, then the supervisor's inside it)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
received: list[int] = []
"""Signals received while a task was registered, in order; ``asyncrl launch`` turns the first
into its exit code (128 + signal number)."""

_stack: list[asyncio.Task] = []
_cancelled: dict[asyncio.Task, int] = {}


def _on_signal(signum: int) -> None:
    received.append(signum)
    if _stack:
        task = _stack[-1]
        _cancelled.setdefault(task, signum)
        task.cancel(f"received {signal.Signals(signum).name}")


def cancelled_by_signal(task: asyncio.Task | None) -> int | None:
    """The signal that cancelled ``task``, if one did."""
    return _cancelled.get(task)


@contextlib.contextmanager
def cancel_on_signals(task: asyncio.Task | None):
    """While inside, SIGINT and SIGTERM cancel ``task`` (main thread only; a no-op elsewhere)."""
    if task is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    if not _stack:
        for s in SIGNALS:
            loop.add_signal_handler(s, _on_signal, s)
    _stack.append(task)
    try:
        yield
    finally:
        _stack.remove(task)
        if task not in _stack:
            _cancelled.pop(task, None)
        if not _stack:
            for s in SIGNALS:
                loop.remove_signal_handler(s)
