"""SIGINT/SIGTERM as cancellation: the innermost registered task is cancelled, so ``finally``
blocks and ``async with Supervisor()`` shut everything down in order. One handler per loop is
installed while any task is registered (the launcher's, then the supervisor's inside it).

A second signal while that shutdown runs is a request to stop waiting: `force_exit` kills the
actors' process groups and ends the process at once with ``128 + signal``. The launcher keeps that
meaning until the process ends (`force_exit_on_signals`), since after ``main()`` returns the event
loop still closes, and that can wait on threads nothing can interrupt (a warm start in
``asyncio.to_thread``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
received: list[int] = []
"""Signals received while a task was registered, in order; ``asyncrl launch`` turns the first
into its exit code (128 + signal number)."""

_stack: list[asyncio.Task] = []
_cancelled: dict[asyncio.Task, int] = {}
_stopping = False  # a signal began the shutdown of the tasks registered now: the next one forces
_force_hooks: list[Callable[[], object]] = []
_saved_handlers: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}


def _on_signal(signum: int) -> None:
    global _stopping
    received.append(signum)
    if _stopping:
        force_exit(signum)
    if _stack:
        _stopping = True
        task = _stack[-1]
        _cancelled.setdefault(task, signum)
        task.cancel(f"received {signal.Signals(signum).name}")


def cancelled_by_signal(task: asyncio.Task | None) -> int | None:
    """The signal that cancelled ``task``, if one did."""
    return _cancelled.get(task) if task is not None else None


@contextlib.contextmanager
def cancel_on_signals(task: asyncio.Task | None):
    """While inside, SIGINT and SIGTERM cancel ``task`` (main thread only; a no-op elsewhere)."""
    global _stopping
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
            _stopping = False
            for s in SIGNALS:
                loop.remove_signal_handler(s)


@contextlib.contextmanager
def on_force_exit(hook: Callable[[], object]):
    """While inside, `force_exit` calls ``hook()`` (say, SIGKILL to process groups one tracks
    and removal of one's socket directory) before it ends the process. It must not block."""
    _force_hooks.append(hook)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _force_hooks.remove(hook)


def force_exit(signum: int) -> None:
    """End the process now, with ``128 + signum``: run the `on_force_exit` hooks, SIGKILL the
    process group of every child of this process (each actor leads its own, so its descendants
    go too), and ``os._exit`` without unwinding (no ``finally``, no thread joins)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(
            f"\nasyncrl: {signal.Signals(signum).name} while shutting down: killing the actors and exiting now\n"
        )
    for hook in reversed(_force_hooks):
        with contextlib.suppress(Exception):
            hook()
    kill_child_groups()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)


def kill_child_groups() -> None:
    """SIGKILL the process group led by each child of this process (Linux: read from /proc)."""
    me, mine = os.getpid(), os.getpgrp()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            ppid, pgrp = (int(x) for x in stat[stat.rindex(b")") + 2 :].split()[1:3])
        except (OSError, ValueError):
            continue  # gone meanwhile, or not readable
        if ppid == me and pgrp == pid and pgrp != mine:  # a child leading its own group: ours to kill
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgrp, signal.SIGKILL)


def force_exit_on_signals() -> None:
    """From now on SIGINT/SIGTERM end the process at once (`force_exit`): for the launcher, once
    ``main()`` is over and only the event loop's own teardown is left. Main thread only;
    `restore_signals` undoes it."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        previous = signal.signal(s, _force_handler)
        _saved_handlers.setdefault(s, previous)


def restore_signals() -> None:
    """Put back the handlers `force_exit_on_signals` replaced."""
    if threading.current_thread() is not threading.main_thread():
        return
    while _saved_handlers:
        s, previous = _saved_handlers.popitem()
        signal.signal(s, previous)


def _force_handler(signum: int, frame) -> None:
    received.append(signum)
    force_exit(signum)
