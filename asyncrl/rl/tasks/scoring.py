"""Calls of the user's code (a task's ``score``, an environment's ``step``) that cannot take a run
down: each runs under a deadline, and what it raises, a hang, or a value that is not a score
becomes an `Outcome` with an error kind, counted, instead of an exception in the sampler.

Error kinds: ``"raised"`` (any exception, ``SystemExit`` included), ``"timeout"`` (past
``timeout_s``), ``"bad_value"`` (the caller's ``convert`` refused the value: NaN, None, a str).

Where the code runs: a sync function on a pool of daemon threads of its own, never the event
loop's default executor (a hung user function would take a worker of it for good); an ``async``
one as a task on the caller's loop. A call past its deadline answers ``"timeout"`` at once and its
thread is abandoned (counted in `UserCalls.hung`); daemon threads, so one that never returns does
not hold the process at exit either. A hung thread keeps its place until it returns, so while
every place is held a call waits (a deadline per round of the queue ahead) and then counts as a
``"timeout"`` too: a function that hangs for good ends in the failure budget below, one that is
only slow now and then costs nothing but its own calls. An ``async`` function that blocks the loop (a
``time.sleep`` inside ``async def``) cannot be stopped by anyone: write ``await`` in them.

Too many failures end the run, not just the completion: `UserCalls.check` raises
`TaskFailureError` once at least ``min_calls`` calls were made and more than ``max_failure_rate``
of them failed, with the first failure's traceback. The driver catches it by its type (it crosses
processes as itself) and stops the run instead of restarting the sampler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import queue
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from asyncrl.rl.tasks.base import TaskError

ERROR_KINDS = ("raised", "timeout", "bad_value")
"""What can go wrong with a call, as `Outcome.error` and the keys of `UserCalls.take_counts`."""


class TaskFailureError(TaskError):
    """The task's own code fails too often (or hangs its workers) for the run to mean anything:
    the message names the task, the failure share against ``--task.max_failure_rate`` and the
    first failure's traceback. Stops the run; restarting the process would fail the same way."""


class Outcome(NamedTuple):
    """A call's result: ``value`` (converted) when ``error`` is "", else ``error`` is one of
    ERROR_KINDS and ``detail`` says what happened (a traceback, where the call hung)."""

    value: Any
    error: str = ""
    detail: str = ""
    reason: str = ""
    """One line for a failure's kind (`failure_kinds`): ``Type: first line of its message`` for
    ``"raised"`` (``module.Type`` outside the builtins), what ran late for ``"timeout"``, what was
    refused for ``"bad_value"``."""


class UserCalls:
    """Runs one task's ``score``/``step`` calls under a deadline of ``timeout_s`` each, on
    ``workers`` threads of its own, and counts what fails. See the module docstring.

    At most ``workers`` calls run at once per event loop; a call waits for a free one first (its
    deadline starts when it runs). A thread that hangs keeps its place until it returns: hangs
    shrink the pool, and a call that finds no place in time counts as a timeout (see the module
    docstring). Hung threads are shared by every loop that uses the object, free places are
    counted per loop (the trainer's evaluation runs a loop per call)."""

    def __init__(
        self,
        task_name: str,
        timeout_s: float,
        max_failure_rate: float,
        min_calls: int = 50,
        workers: int = 16,
        *,
        stop_early: bool = False,
    ):
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(
                f"task {task_name}: the score deadline must be a finite number of seconds > 0, not {timeout_s!r}"
            )
        if not 0.0 <= max_failure_rate <= 1.0:  # NaN fails too
            raise ValueError(f"task {task_name}: max_failure_rate must be in [0, 1], not {max_failure_rate!r}")
        if min_calls < 1 or workers < 2:
            raise ValueError(
                f"task {task_name}: min_calls must be >= 1 and workers >= 2, not {min_calls} and {workers}"
            )
        self.task_name, self.timeout_s, self.max_failure_rate = task_name, float(timeout_s), float(max_failure_rate)
        self.min_calls, self.workers = min_calls, workers
        self.stop_early = stop_early
        """`check` after every call: `call` raises `TaskFailureError` as soon as the budget is spent.
        For a caller that scores a fixed set (the held-out evaluation): what is left of it would
        only add failures, at a deadline per hung worker (a reward that hangs held a held-out set
        for many minutes: benchmarks/README.md, "Figures that were in the code"). A sampler
        checks between its groups instead."""
        self.calls = 0
        """Calls made (finished, failed or timed out) since construction."""
        self.failures = 0
        self.first_traceback = ""
        """The first failure's traceback (or where the first hung call was), "" while none failed."""
        self._counts = dict.fromkeys(("calls", *ERROR_KINDS), 0)  # since the last take_counts
        self._hung = 0
        self._waiting = 0  # calls waiting for a place to run (on any loop)
        self._lock = threading.Lock()  # counters: done callbacks run on the worker threads
        self._pool = _DaemonPool(workers, f"task-{task_name}")
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def hung(self) -> int:
        """Threads abandoned past their deadline that still run."""
        return self._hung

    async def call(
        self, fn: Callable[..., Any], *args: Any, what: str, convert: Callable[[Any], Any] | None = None
    ) -> Outcome:
        """``fn(*args)`` under the deadline; ``convert(value)`` (e.g. `as_score`) turns the value
        into what the caller uses, and what it raises counts as ``"bad_value"``. ``what`` names the
        call in messages ("score", "step"). Raises only `TaskFailureError` (called after `close`,
        or with ``stop_early`` once the failure budget is spent)."""
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(self.workers)
        if not await self._acquire(gate):
            late = f"{what} found no free worker in time"
            outcome = Outcome(None, "timeout", late, late)
            self._record(what, outcome)
            return outcome
        if _is_async(fn):
            outcome = await self._run_async(fn, args, what, gate)
        else:
            outcome = await self._run_sync(fn, args, what, gate, loop)
        if not outcome.error and convert is not None:
            try:
                outcome = Outcome(convert(outcome.value))
            except Exception as exc:
                detail = f"{what}() returned a bad value: {type(exc).__name__}: {exc}"
                outcome = Outcome(None, "bad_value", detail, _first_line(detail))
        self._record(what, outcome)
        return outcome

    def take_counts(self) -> dict[str, int]:
        """Calls and failures per error kind since the previous take (for metrics)."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return counts

    def check(self) -> None:
        """Raise `TaskFailureError` once at least ``min_calls`` calls were made and more than
        ``max_failure_rate`` of them failed."""
        calls, failures = self.calls, self.failures
        if calls >= self.min_calls and failures / calls > self.max_failure_rate:
            raise TaskFailureError(
                f"task {self.task_name}: {failures} of {calls} score/step calls failed ({failures / calls:.0%}, more "
                f"than --task.max_failure_rate {self.max_failure_rate:g}); the first failure:\n{self.first_traceback}"
            )

    def close(self) -> None:
        """Stop the workers without waiting for them (a hung one is abandoned). Idempotent."""
        self._pool.shutdown()

    # --- internals --------------------------------------------------------------------------------

    async def _acquire(self, gate: asyncio.Semaphore) -> bool:
        """Take a place to run in; False if none came in time. Each place frees within a
        deadline (or hangs, which the failure budget bounds), so a wait of a deadline per round of
        the queue ahead, and two more, means the places are gone."""
        free = max(self.workers - self._hung, 1)
        wait_s = self.timeout_s * (self._waiting // free + 2)
        self._waiting += 1
        acquiring = asyncio.ensure_future(gate.acquire())
        try:
            # asyncio.wait, not wait_for: a cancel arriving with the place must not lose it
            done, _ = await asyncio.wait([acquiring], timeout=wait_s)
        except asyncio.CancelledError:
            if acquiring.done() and not acquiring.cancelled():
                gate.release()  # got the place as we were cancelled
            else:
                acquiring.cancel()  # a place it gets meanwhile Semaphore.acquire gives back itself
            raise
        finally:
            self._waiting -= 1
        if not done:
            acquiring.cancel()
        return bool(done)

    async def _run_sync(self, fn, args, what: str, gate: asyncio.Semaphore, loop) -> Outcome:
        where: list[int] = []  # the worker thread's id, for the stack of a call that hangs
        try:
            future = self._pool.submit(_on_thread, where, fn, args)
        except RuntimeError:
            gate.release()
            raise TaskFailureError(f"task {self.task_name}: {what} called after close()") from None
        # The place is given back when the thread is really done, not when we stop waiting.
        future.add_done_callback(lambda _: _call_soon(loop, gate.release))
        waited = asyncio.wrap_future(future)
        start = loop.time()
        done, _ = await asyncio.wait([waited], timeout=self.timeout_s)
        if not done:
            with self._lock:
                self._hung += 1
            future.add_done_callback(self._unhang)  # at once if it finished meanwhile
            waited.add_done_callback(_retrieve)
            frame = sys._current_frames().get(where[0]) if where else None
            stack = "".join(traceback.format_list(_users(traceback.extract_stack(frame)))) if frame is not None else ""
            late = f"{what} ran past its {self.timeout_s:g} s deadline"
            return Outcome(None, "timeout", f"{late}; it was at:\n{stack}", late)
        if waited.cancelled():  # close() dropped it before a worker took it
            raise TaskFailureError(f"task {self.task_name}: {what} was dropped by close()")
        exc = waited.exception()
        if exc is not None:
            return _raised(exc)
        value = waited.result()
        if inspect.isawaitable(value):  # a sync function that returned a coroutine: run it here
            return await self._await(value, what, max(self.timeout_s - (loop.time() - start), 1e-3))
        return Outcome(value)

    async def _run_async(self, fn, args, what: str, gate: asyncio.Semaphore) -> Outcome:
        try:
            awaitable = fn(*args)
        except BaseException as exc:  # e.g. the wrong number of arguments
            gate.release()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return _raised(exc)
        try:
            return await self._await(awaitable, what, self.timeout_s)
        finally:
            gate.release()

    async def _await(self, awaitable, what: str, timeout_s: float) -> Outcome:
        task = asyncio.ensure_future(_guarded(awaitable))
        try:
            done, _ = await asyncio.wait([task], timeout=timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()  # it may ignore the cancel; nobody waits for it
            frames = "".join(
                traceback.format_list(_users(traceback.StackSummary.extract((f, f.f_lineno) for f in task.get_stack())))
            )
            late = f"{what} ran past its {timeout_s:g} s deadline"
            return Outcome(None, "timeout", f"{late}; it was at:\n{frames}", late)
        return task.result()

    def _unhang(self, _future: concurrent.futures.Future) -> None:
        with self._lock:
            self._hung -= 1

    def _record(self, what: str, outcome: Outcome) -> None:
        with self._lock:
            self.calls += 1
            self._counts["calls"] += 1
            if outcome.error:
                self.failures += 1
                self._counts[outcome.error] += 1
                if not self.first_traceback:
                    self.first_traceback = f"{what}: {outcome.detail}"
        if self.stop_early:
            self.check()


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _on_thread(where: list[int], fn, args):
    where.append(threading.get_ident())
    return fn(*args)


async def _guarded(awaitable) -> Outcome:
    """The user's awaitable as an `Outcome`: what it raises, ``SystemExit`` included, stays here
    (asyncio would let a ``SystemExit`` out of a task through the loop)."""
    try:
        return Outcome(await awaitable)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        return _raised(exc)


def failure_kinds(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """The failed ``outcomes`` counted by kind, one line each: the error kind and the first one's
    reason (``raised openai.BadRequestError: Error code: 400 - ...``). Failures are of one kind
    when their error kinds and the heads of their reasons (up to the first ``": "``: the type of
    what was raised) match, so messages that differ only by a number are one line, not one each."""
    kinds: dict[tuple[str, str], list] = {}
    for outcome in outcomes:
        if outcome.error:
            kind = kinds.setdefault((outcome.error, outcome.reason.split(": ", 1)[0]), [outcome, 0])
            kind[1] += 1
    return {f"{o.error} {o.reason}".rstrip(): count for o, count in kinds.values()}


def _raised(exc: BaseException) -> Outcome:
    kind = type(exc).__qualname__
    if type(exc).__module__ != "builtins":
        kind = f"{type(exc).__module__.split('.')[0]}.{kind}"  # openai.BadRequestError, not openai._exceptions.
    return Outcome(None, "raised", _format(exc), _first_line(f"{kind}: {exc}" if str(exc).strip() else kind))


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _format(exc: BaseException) -> str:
    """``exc``'s traceback from the user's first frame: the frames of this module that ran the
    call are ours, not something the user can act on."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


def _users(stack: traceback.StackSummary) -> list[traceback.FrameSummary]:
    """A hung call's stack from the frame after this module's last one (the thread's start and
    the worker loop above it are ours)."""
    ours = [i for i, frame in enumerate(stack) if frame.filename == __file__]
    return list(stack[ours[-1] + 1 :] if ours and ours[-1] + 1 < len(stack) else stack)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # an abandoned call's error is not "never retrieved"


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # that loop is closed: nobody waits for its places any more
        pass


class _DaemonPool:
    """``workers`` daemon threads taking jobs from a queue. Not a ThreadPoolExecutor: its threads
    are joined at interpreter exit, so one hung user function would keep the process alive."""

    def __init__(self, workers: int, name: str):
        self._workers, self._name = workers, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started = self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            if not self._started:  # threads only once needed: building a task spawns none
                for i in range(self._workers):
                    threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True).start()
                self._started = True
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:  # jobs not started are cancelled
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                job[0].cancel()
            for _ in range(self._workers if self._started else 0):
                self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # SystemExit from user code ends the call, not the thread
                future.set_exception(exc)
            else:
                future.set_result(result)
