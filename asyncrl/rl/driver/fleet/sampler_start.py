"""The samplers' start: one lost while it starts is not the end of the run.

Where each part of this lives, and why: the supervisor starts a sampler again when its process is
lost during its start (killed, silent, past its start deadline), within the same
``--run.sampler_max_restarts`` as its restarts later (`Supervisor.spawn`; generic, since any actor
with restarts can be lost while it starts, and the budget is one count either way). A sampler
still not up after that is gone for good, as one whose restarts run out later in the run: the
supervisor keeps it DEAD (``keep_if_lost``) and the run goes on with the others (`start_samplers`
records it; `Membership` counts it gone). Only when none came up does the run stop.

A start the sampler's own code refused (its constructor raised: a bad setting, a model too large
for its GPU, a bug) is neither retried nor survived: every sampler runs the same code on the same
config, a retry or the others would fail the same way, and the message is what the user needs; it
stops the run as it is (one line for an `ActionableError`, the traceback for a bug).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from asyncrl.errors import first_line
from asyncrl.rl.driver.faults import NoSamplersError, append_event
from asyncrl.rl.driver.fleet.handles import Log, SamplerHandle

T = TypeVar("T")

CANCEL_S = 30.0
"""How long the other starts may take to end once cancelled (a cancelled start kills its process
at once; this bounds the wait for it)."""


async def start_samplers(
    spawn: Callable[[int], Awaitable[SamplerHandle]],
    count: int,
    *,
    wave_of: Callable[[int], int] = lambda i: 0,
    log: Log,
    events_path: str = "",
) -> list[SamplerHandle]:
    """Spawn samplers ``0 .. count-1`` with ``spawn(i)`` (a `Supervisor.spawn` with
    ``keep_if_lost=True``) in waves, those of a wave concurrently, in the order of ``wave_of(i)``.
    Samplers that share one GPU go in different waves (vLLM measures the free memory as it starts,
    and two engines starting at once on one GPU would each count the other's): the device plan's
    `DevicePlan.start_wave`. Each start is bounded by the supervisor's start deadlines, its retries included.

    Returns every handle: a sampler that never came up is a DEAD one, said in one line of the log
    and a ``start_failed`` event in faults.jsonl (``events_path``); one that came up after lost
    starts, a line and a ``start_retried`` event. Raises `NoSamplersError` if none came up, and the error
    of a start that was refused (the others are cancelled first)."""
    by_index: dict[int, SamplerHandle] = {}
    for wave in sorted({wave_of(i) for i in range(count)}):
        members = [i for i in range(count) if wave_of(i) == wave]
        started = await all_or_first_error([asyncio.ensure_future(spawn(i)) for i in members])
        by_index.update(zip(members, started))
    handles = [by_index[i] for i in range(count)]
    up = [h for h in handles if not _gone(h)]
    for h in handles:
        info = h.info()
        restarts = f"restarts {info.restarts}/{info.max_restarts}"
        if _gone(h):
            why = _reason(h.name, info.error or info.state)
            if up:  # else the line that stops the run names each
                log(
                    f"{h.name} never came up ({restarts}, --run.sampler_max_restarts): {why}; "
                    f"the run goes on with {len(up)} of {count} sampler(s)"
                )
            append_event(
                events_path,
                {
                    "event": "start_failed",
                    "sampler": h.name,
                    "step": 0,
                    "detail": why,
                    "restarts": info.restarts,
                    "at": time.time(),
                },
            )
        elif info.restarts:
            log(f"{h.name} came up after {info.restarts} lost start(s) ({restarts} used, --run.sampler_max_restarts)")
            append_event(
                events_path,
                {
                    "event": "start_retried",
                    "sampler": h.name,
                    "step": 0,
                    "detail": f"up after {restarts} (its start was lost)",
                    "restarts": info.restarts,
                    "at": time.time(),
                },
            )
    if not up:
        raise NoSamplersError(
            f"no sampler came up (--run.sampler_max_restarts {handles[0].info().max_restarts}): "
            + "; ".join(f"{h.name}: {_reason(h.name, h.info().error or 'dead')}" for h in handles)
        )
    return handles


async def all_or_first_error(tasks: Sequence[asyncio.Future[T]]) -> list[T]:
    """Every task's result; or, as soon as one raises (or this is cancelled), the others
    cancelled and awaited (bounded by ``CANCEL_S``), and that error raised."""
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)  # each bounded by its start deadlines
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=CANCEL_S)
    for t in tasks:
        failure = t.exception() if t.done() and not t.cancelled() else None
        if failure is not None:
            raise failure
    return [t.result() for t in tasks]


def _gone(handle: SamplerHandle) -> bool:
    return handle.info().state.final


def _reason(name: str, error: BaseException | str) -> str:
    """An actor's error in one line, without the ``actor 'NAME': `` its message begins with."""
    line = first_line(error)
    prefix = f"actor {name!r}: "
    return line[len(prefix) :] if line.startswith(prefix) else line
